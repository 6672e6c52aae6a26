"""Reload instead of re-prefill, measured: for each context length, the time a transformers model
takes to prefill it, against the time to look it up in kvtier, load it, rebuild the
`DynamicCache` and prefill the one last token — raw and with each codec — and the bytes moved.
The load alone is timed into plain memory (TCP) and into a `Client.alloc_buffer` shared buffer
(the same-node path when the server is on this host), beside a memcpy of the same raw bytes.

    python -m kvtier.reload_bench --contexts 2048,8192,32768 --out bench-out/reload.json

The model is SmolLM2-135M's architecture (30 layers, 9 query / 3 KV heads of 64, 135M
parameters) built from its config with random weights: speed does not depend on the weights, and
nothing is downloaded. A local `kvtier serve` is started (see `kvtier.server`). Times are medians
of `--repeat` runs (prefill of 8K tokens and more: once, it takes minutes on a CPU).
"""

import argparse
import json
import os
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvtier
from kvtier import resident_bytes
from kvtier.server import LocalServer
from kvtier.transformers import KvCacheStore


def smollm2_135m(max_tokens):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=max(8192, max_tokens + 64),
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def timed(fn, repeat):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--codecs", default="raw,fp8,nvfp4,nvfp4+had")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens), as engines do for long prompts")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dram", default="8GiB")
    ap.add_argument("--out", default="bench-out/reload_vs_prefill.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    codecs = args.codecs.split(",")
    model = smollm2_135m(max(contexts))
    params = sum(p.numel() for p in model.parameters())
    rows = []
    with LocalServer(dram_capacity=args.dram) as srv:
        client = kvtier.Client(srv.addr, never_raise=False, timeout_s=600)
        for n in contexts:
            tokens = torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            stores = {c: KvCacheStore(client, model, tenant=f"bench-{c}-{n}", codec=c) for c in codecs}

            def prefill():
                st = stores[codecs[0]]
                cache = DynamicCache(config=model.config)
                for a in range(0, n, args.chunk):
                    logits = st.forward(tokens[a : a + args.chunk], cache)
                return logits, cache

            reps = 1 if n >= 8192 else args.repeat
            t_prefill, (ref_logits, cache) = timed(prefill, reps)
            bt = stores[codecs[0]].block_tokens
            raw_bytes = (n - n % bt) * stores[codecs[0]].ns.token_bytes
            for c in codecs:
                st = stores[c]
                before = resident_bytes(client, st.ns)
                kv = st.cache_to_blocks(cache, 0, n)
                t0 = time.perf_counter()
                stored = client.store(st.ns, tokens, kv)
                t_store = time.perf_counter() - t0
                wire = resident_bytes(client, st.ns) - before
                del kv

                def reload():
                    hit = st.lookup(tokens)
                    c2, m = st.load(tokens, max_tokens=n - 1)
                    logits = st.forward(tokens[m:], c2)
                    return hit, m, logits

                t_reload, (hit, m, logits) = timed(reload, args.repeat)
                # The parts: lookup + load into a buffer (kvtier's share), and a memcpy of the
                # same raw KV bytes (the floor any reload from host memory pays).
                # Into plain memory (the data plane, over loopback TCP) and into a shared buffer
                # (`Client.alloc_buffer`: the same-node path, one copy by the server).
                buf = torch.empty(n * st.ns.token_bytes // model.dtype.itemsize, dtype=model.dtype)
                t_load, _ = timed(lambda: (st.lookup(tokens), client.load_into(st.ns, tokens, buf)), args.repeat)
                sbuf = torch.frombuffer(client.alloc_buffer(buf.numel() * buf.element_size()), dtype=model.dtype)
                t_load_sn, _ = timed(lambda: (st.lookup(tokens), client.load_into(st.ns, tokens, sbuf)), args.repeat)
                t_memcpy, _ = timed(lambda: buf.clone(), args.repeat)
                del buf, sbuf
                diff = (logits - ref_logits).abs().max().item()
                row = {
                    "context": n,
                    "codec": c,
                    "prefill_s": t_prefill,
                    "reload_s": t_reload,
                    "load_s": t_load,
                    "load_samenode_s": t_load_sn,
                    "memcpy_raw_s": t_memcpy,
                    "speedup": t_prefill / t_reload,
                    "store_s": t_store,
                    "blocks_stored": stored,
                    "hit_tokens": hit,
                    "reused_tokens": m,
                    "raw_kv_bytes": raw_bytes,
                    "bytes_moved": wire,
                    "max_logit_diff": diff,
                }
                rows.append(row)
                print(
                    f"{n:>6} {c:>10}  prefill {t_prefill:8.2f} s  reload {t_reload:6.3f} s  "
                    f"x{t_prefill / t_reload:7.1f}  (load {t_load:6.3f} s, same-node {t_load_sn:6.3f} s, "
                    f"memcpy {t_memcpy:6.3f} s)  "
                    f"moved {wire / 2**20:8.1f} MiB "
                    f"({wire / raw_bytes:.2f} of raw)  max|dlogit| {diff:.2e}",
                    flush=True,
                )
            del cache
    report = {
        "model": "SmolLM2-135M architecture (random weights)",
        "parameters": params,
        "threads": args.threads,
        "kv_dtype": str(model.dtype),
        "token_bytes": stores[codecs[0]].ns.token_bytes,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
