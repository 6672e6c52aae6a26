"""One shared buffer, two calls at once, measured: an engine's prefetch (a load of `--blocks`
1 MiB blocks into some pages of its pool) and its backup (a store of as many from other pages of
the same pool), each alone and then both at once from two threads, against a local `kvtier
serve`. The baseline is the two run one after the other (what a client that serializes calls on
one buffer gives): `both / (load + store)` below 1 is overlap.

    python -m kvtier.shared_buffer_bench --blocks 64 --rounds 8 --repeat 5

The server's DRAM tier is filled once first (every page touched, later stores reuse evicted
slots), so the stores measure copies, not the kernel faulting fresh pages in. Times are medians
of `--repeat` runs.
"""

import argparse
import statistics
import threading
import time

import numpy as np

import kvtier
from kvtier.server import LocalServer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=64, help="1 MiB blocks per call")
    ap.add_argument("--rounds", type=int, default=8, help="calls per thread per run")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kvtier-bin", default=None, help="the kvtier binary (default: found as LocalServer finds it)")
    args = ap.parse_args()
    blocks, mib = args.blocks, 1 << 20
    with LocalServer(dram_capacity="1GiB", binary=args.kvtier_bin) as srv:
        c = kvtier.Client(srv.addr, never_raise=False)
        n = kvtier.Namespace("bench", "m@1", layers=8, kv_heads=8, head_dim=128, dtype="fp32", block_tokens=16)
        assert n.block_bytes == mib
        junk = np.ones(blocks * mib, dtype=np.uint8)
        for r in range(max(1, 1536 // blocks)):
            c.store_keys(n, [b"warm%d-%d" % (r, i) for i in range(blocks)], [junk[i * mib : (i + 1) * mib] for i in range(blocks)])
        keys = [b"prefix-%d" % i for i in range(blocks)]
        kv = np.random.default_rng(1).integers(1, 255, size=blocks * mib, dtype=np.uint8)
        assert c.store_keys(n, keys, [kv[i * mib : (i + 1) * mib] for i in range(blocks)]) == [True] * blocks

        pool = np.frombuffer(c.alloc_buffer(2 * blocks * mib), dtype=np.uint8)
        pool[blocks * mib :] = 7
        prefetch = [pool[i * mib : (i + 1) * mib] for i in range(blocks)]
        backup = [pool[(blocks + i) * mib : (blocks + i + 1) * mib] for i in range(blocks)]
        stored = [0]

        def load():
            for _ in range(args.rounds):
                assert c.load_keys_into(n, keys, prefetch) == [True] * blocks

        def store():
            for _ in range(args.rounds):
                stored[0] += 1
                assert all(c.store_keys(n, [b"backup%d-%d" % (stored[0], i) for i in range(blocks)], backup))

        med = {}
        for name, fns in [("load", [load]), ("store", [store]), ("both", [load, store])]:
            runs = []
            for _ in range(args.repeat):
                threads = [threading.Thread(target=f) for f in fns]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                runs.append(time.perf_counter() - t0)
            med[name] = statistics.median(runs)
            moved = len(fns) * args.rounds * blocks
            print(f"{name:>5}: {med[name] * 1e3:7.0f} ms median  {moved / 1024 / med[name]:5.2f} GiB/s  "
                  f"(runs: {', '.join(f'{r * 1e3:.0f}' for r in runs)} ms)")
        print(f"both / (load + store) = {med['both'] / (med['load'] + med['store']):.2f}")
        st = c.samenode_stats()
        print(f"same-node loads {st['loads']}, stores {st['stores']}, fallbacks {st['fallbacks']}")


if __name__ == "__main__":
    main()
