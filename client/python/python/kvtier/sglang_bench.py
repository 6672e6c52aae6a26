"""What the SGLang backend costs, measured: `python -m kvtier.sglang_bench [--server ADDR]`.

Starts a local `kvtier serve` (or uses `--server`), builds SGLang's own CPU host pool
(`MHATokenToKVPoolHost`, `page_first`, bf16) and attaches `kvtier.sglang.KvtierHiCacheStorage`
through SGLang's backend factory, the way SGLang's cache controller does. A writer pool stores
`--pages` pages with the zero-copy `batch_set_v1`; then readers load them into other host pages
with `batch_get_v1`, alternating, `--rounds` times:

- a pool in shared memory (`"allocator": "shm"`, registered: the same-node socket, one copy by the
  server into SGLang's pages),
- a pool in ordinary memory (SGLang's default allocator: over TCP, received into the pages),

beside a memcpy of the same pages inside the pool (`torch` copy of the page rows) in the same
round. Reports medians and ratios. Needs SGLang 0.5.23 and the `kvtier` binary (kvtier.server).
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _pool(layers, heads, head_dim, page, pages, allocator):
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    cap = page * pages
    k = tuple(torch.zeros(cap, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(cap, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                          layout=KVBufferLayout.NHD),
        page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    # Host pool of 2x the "device" capacity: the loads land in the upper half.
    return MHATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=page, layout="page_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=cap, start_layer=0,
                                end_layer=layers, allocator_type=allocator)


def _backend(addr, pool, allocator):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierHiCacheStorage",
             "interface_v1": 1, "server": addr, "tenant": "bench", "timeout_s": 30.0}
    if allocator == "shm":
        extra["allocator"] = "shm"
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="kvtier-sglang-bench", extra_config=extra)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def run(addr, *, pages=32, layers=32, heads=8, head_dim=128, page=16, rounds=15):
    import torch

    writer_pool = _pool(layers, heads, head_dim, page, pages, "default")
    g = torch.Generator().manual_seed(0)
    writer_pool.kv_buffer.copy_(torch.randn(writer_pool.kv_buffer.shape, generator=g).to(torch.bfloat16))
    writer = _backend(addr, writer_pool, "default")
    rng = np.random.default_rng(int(time.time()))
    keys = [rng.bytes(32).hex() for _ in range(pages)]
    src = torch.arange(0, pages * page, dtype=torch.int64)
    dst = torch.arange(pages * page, 2 * pages * page, dtype=torch.int64)
    if not all(writer.batch_set_v1(keys, src)):
        raise SystemExit(f"storing the pages failed: {writer.client.last_miss}")
    page_bytes = writer_pool.get_size_per_token() * page
    total = pages * page_bytes

    readers = {name: _backend(addr, _pool(layers, heads, head_dim, page, pages, name), name)
               for name in ("shm", "default")}
    if not readers["shm"]._regions:
        raise SystemExit("the shared-memory pool was not registered")
    want = [writer_pool.get_data_page(i * page).contiguous() for i in range(pages)]
    times = {"shm": [], "default": [], "memcpy": []}
    for r in range(rounds):
        order = ("shm", "default") if r % 2 == 0 else ("default", "shm")
        for name in order:
            b = readers[name]
            b.mem_pool_host.kv_buffer.zero_()
            t0 = time.perf_counter()
            got = b.batch_get_v1(keys, dst)
            times[name].append(time.perf_counter() - t0)
            if not all(got):
                raise SystemExit(f"{name}: {sum(got)} of {pages} pages loaded ({b.client.last_miss})")
            for i in (0, pages - 1):
                if not torch.equal(b.mem_pool_host.get_data_page((pages + i) * page).contiguous(), want[i]):
                    raise SystemExit(f"{name}: page {i} differs from the stored one")
        # The same pages copied inside a pool: K and V rows of every page, as one copy each.
        kv = readers["default"].mem_pool_host.kv_buffer
        t0 = time.perf_counter()
        kv[:, pages * page:2 * pages * page].copy_(writer_pool.kv_buffer[:, :pages * page])
        times["memcpy"].append(time.perf_counter() - t0)
    if readers["shm"].client.samenode_stats()["loads"] < rounds:
        raise SystemExit(f"the shared pool's loads did not take the same-node path: "
                         f"{readers['shm'].client.samenode_stats()}")
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = total / 1e9
    return {
        "pages": pages,
        "page_bytes": page_bytes,
        "rounds": rounds,
        "samenode_load_gb_s": gb / med["shm"],
        "tcp_load_gb_s": gb / med["default"],
        "memcpy_gb_s": gb / med["memcpy"],
        "samenode_vs_memcpy": med["memcpy"] / med["shm"],
        "tcp_vs_memcpy": med["memcpy"] / med["default"],
        "samenode_vs_tcp": med["default"] / med["shm"],
        "samenode_stats": readers["shm"].client.samenode_stats(),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", help="a running kvtier (default: start one here)")
    ap.add_argument("--pages", type=int, default=32, help="pages per batch (default 32)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    kw = dict(pages=a.pages, layers=a.layers, page=a.page_tokens, rounds=a.rounds)
    if a.server:
        res = run(a.server, **kw)
    else:
        from kvtier.server import LocalServer

        with LocalServer(dram_capacity="4GiB") as srv:
            res = run(srv.addr, **kw)
    if a.json:
        print(json.dumps(res, indent=1, default=str))
        return
    print(f"kvtier.sglang bench: {res['pages']} pages of {res['page_bytes'] >> 10} KiB per batch_get_v1, "
          f"medians of {res['rounds']} rounds, {os.cpu_count()} CPUs")
    print(f"same-node (shm pool): {res['samenode_load_gb_s']:.2f} GB/s ({res['samenode_vs_memcpy']:.2f}x memcpy) | "
          f"TCP (ordinary pool): {res['tcp_load_gb_s']:.2f} GB/s ({res['tcp_vs_memcpy']:.2f}x memcpy) | "
          f"memcpy: {res['memcpy_gb_s']:.2f} GB/s | same-node / TCP: {res['samenode_vs_tcp']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
