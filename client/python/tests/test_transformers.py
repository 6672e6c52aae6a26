"""End to end with a real transformers model on CPU: KV computed once, stored in a real kvtier
server, reloaded (in another process too) gives the same tokens as computing it again."""

import json
import random
import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

import kvtier
from kvtier.accuracy import score_codecs
from kvtier.transformers import KvCacheStore

from conftest import run_engine

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(model_dir):
    return LlamaForCausalLM.from_pretrained(model_dir).eval()


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def reference(model, tokens, n):
    """Greedy tokens and logits from a full prefill, kvtier not involved."""
    st = KvCacheStore(kvtier.Client("127.0.0.1:1"), model, tenant="ref")
    step = st.prefill(tokens, reuse=False, store=False)
    return st.greedy(step, n)


def make_store(server, model, tenant, codec="raw"):
    return KvCacheStore(kvtier.Client(server.addr, never_raise=False), model, tenant=tenant, codec=codec)


def test_reload_in_a_fresh_process_matches_full_prefill(server, model, model_dir, tmp_path):
    p = prompt(1, 300)
    pf = tmp_path / "prompt.json"
    pf.write_text(json.dumps(p))
    stored = json.loads(run_engine("store", server.addr, model_dir, pf))
    assert stored == {"reused": 0, "lookup": 288}

    out = tmp_path / "reload.pt"
    got = json.loads(run_engine("reload", server.addr, model_dir, pf, out, 32))
    assert got["reused"] == 288, "the second process should reuse every full block"
    r = torch.load(out)
    want_tokens, want_logits = reference(model, p, 32)
    assert r["tokens"] == want_tokens
    assert r["logits"].shape == want_logits.shape == (32, 512)
    # Same KV bytes; only the order of floating-point sums differs (12 new tokens vs 300).
    torch.testing.assert_close(r["logits"], want_logits, atol=1e-4, rtol=1e-4)


def test_partial_hit_prefills_only_the_missing_suffix(server, model):
    st = make_store(server, model, "partial")
    a = prompt(2, 256)
    assert st.prefill(a).reused_tokens == 0
    b = a[:192] + prompt(3, 64)  # shares the first 75%
    assert st.lookup(b) == 192
    step = st.prefill(b)
    assert step.reused_tokens == 192
    tokens, logits = st.greedy(step, 16)
    want_tokens, want_logits = reference(model, b, 16)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    # The suffix it computed was stored: b is now a full hit. Its last token is always prefilled
    # (the engine needs its logits), so the last block is loaded and cut to 15 of its 16 tokens.
    assert st.lookup(b) == 256
    step = st.prefill(b, store=False)
    assert step.reused_tokens == 255
    tokens, logits = st.greedy(step, 16)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    # The server is on this host: the adapter's loads and stores went through the same-node path.
    sn = st.client.samenode_stats()
    assert sn["loads"] >= 2 and sn["stores"] >= 2 and sn["fallbacks"] == {}, sn


def test_agent_session_park_resume_extend(server, model):
    st = make_store(server, model, "agent")
    sid = "agent-7"
    # Turn 1: prompt, 8 generated tokens, parked (40 + 7 tokens of KV: not a whole block).
    t1 = prompt(4, 40)
    step = st.prefill(t1, store=False)
    gen1, _ = st.greedy(step, 8)
    info = st.park(sid, step.tokens, step.cache)
    assert info["token_count"] == 47 and info["has_tail"]
    ctx = t1 + gen1

    # Turn 2: resumed, the user's next message prefilled after it, extended.
    info, cache = st.resume(sid)
    assert info["token_count"] == 47 and cache.get_seq_length() == 47
    turn2 = ctx + prompt(5, 30)
    step = st.continue_session(cache, turn2, reused=47)
    gen2, logits2 = st.greedy(step, 8)
    want2, want_logits2 = reference(model, turn2, 8)
    assert gen2 == want2
    torch.testing.assert_close(logits2, want_logits2, atol=1e-4, rtol=1e-4)
    info = st.extend(sid, info, step.tokens, step.cache)
    assert info["token_count"] == len(turn2) + 7 and info["version"] == 2
    ctx = turn2 + gen2

    # Turn 3: resumed again; same tokens as recomputing the whole conversation.
    info, cache = st.resume(sid)
    assert cache.get_seq_length() == len(ctx) - 1
    turn3 = ctx + prompt(6, 20)
    step = st.continue_session(cache, turn3, reused=len(ctx) - 1)
    gen3, _ = st.greedy(step, 8)
    want3, _ = reference(model, turn3, 8)
    assert gen3 == want3

    assert st.client.drop_session(st.ns, sid)
    with pytest.raises(kvtier.SessionNotFoundError):
        st.resume(sid)


def test_quantized_kv_stays_close_to_raw(server, model):
    tokens = prompt(8, 512 + 257)
    codecs = ["fp8", "nvfp4", "fp8+had", "nvfp4+had"]
    res = score_codecs(
        lambda spec, c, sink: KvCacheStore(
            kvtier.Client(server.addr, never_raise=False), model, tenant=f"acc-{spec}", codec=c, lossless_sink_blocks=sink
        ),
        codecs,
        tokens,
        512,
        256,
    )
    for c, a in res.items():
        print(f"{c:10} KL {a.kl_mean:.5f} (max {a.kl_max:.4f}) top-1 {a.top1:.3f} ppl {a.ppl:.2f} vs {a.ppl_ref:.2f}")
    assert res["raw"].kl_mean == 0.0 and res["raw"].top1 == 1.0
    # A randomly initialised model is far more sensitive than a trained one (no redundancy, sharp
    # random attention): measured here fp8 KL 0.020 / top-1 0.80, nvfp4 KL 0.28 / top-1 0.42.
    # The bounds are generous; the real-model numbers are `python -m kvtier.accuracy`'s job.
    for c in ("fp8", "fp8+had"):
        assert res[c].kl_mean < 0.06 and res[c].top1 > 0.65, c
    for c in ("nvfp4", "nvfp4+had"):
        assert res[c].kl_mean < 0.6 and res[c].top1 > 0.25, c
    # 8 bits per element stay closer than 4.
    assert res["fp8"].kl_mean < res["nvfp4"].kl_mean / 4
    for c in codecs:
        assert res[c].kl_mean > 0.0, f"{c} changed nothing: was it quantized?"


def test_adapter_refuses_what_it_cannot_do(server, model):
    with pytest.raises(TypeError, match="kvtier.Client"):
        KvCacheStore("127.0.0.1:1", model)
    st = make_store(server, model, "adapter-errors")
    with pytest.raises(ValueError, match="empty prompt"):
        st.prefill([])
    step = st.prefill(prompt(10, 20), store=False)
    with pytest.raises(ValueError, match="nothing new"):
        st.continue_session(step.cache, step.tokens, reused=20)
    # A cache whose layers hold different lengths (a sliding-window layer) is refused, not sliced.
    step.cache.layers[1].keys = step.cache.layers[1].keys[:, :, 4:]
    with pytest.raises(ValueError, match="sliding-window"):
        st.park("s", step.tokens, step.cache)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KvCacheStore(kvtier.Client("127.0.0.1:1"), LlamaForCausalLM(model.config).to(torch.float64))


def test_dead_server_is_a_miss_and_the_model_recomputes(model):
    client = kvtier.Client("127.0.0.1:1", timeout_s=2.0)  # never raises: the engine default
    st = KvCacheStore(client, model, tenant="dead")
    p = prompt(9, 100)
    step = st.prefill(p)
    assert step.reused_tokens == 0
    tokens, _ = st.greedy(step, 8)
    assert tokens == reference(model, p, 8)[0]
    assert client.last_miss[0] == "connect"
    assert st.park("s", step.tokens, step.cache) is None
    assert st.resume("s") == (None, None)


def test_without_torch_the_import_says_what_to_install():
    # A fresh interpreter where `import torch` fails, as on a machine without it.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n"
        "    import kvtier.transformers\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    print('imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kvtier.transformers needs torch and transformers 5" in out.stdout, out.stdout
    assert "kvtier[transformers]" in out.stdout
