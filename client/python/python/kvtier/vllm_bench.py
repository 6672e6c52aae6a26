"""What the vLLM tier costs, measured: `python -m kvtier.vllm_bench [--server ADDR]`.

Starts a local `kvtier serve` (or uses `--server`), builds `kvtier.vllm.KvtierTier` the way vLLM's
factory does, over a CPU region of 2 MiB chunks like vLLM's CPU tier, and reports:

- lookup latency of 128 keys, p50/p99: `exists_keys` on the client, and the tier's lookup batch
  (what vLLM's async lookup thread runs once per request per step);
- load throughput of 2 MiB chunks from kvtier into the region's rows (the promotion path: one
  `submit_load` job per `--job-chunks` chunks on the tier's worker threads, until
  `get_finished_jobs` reports them), beside a plain memcpy of the same bytes in the same run, and
  the store throughput of the same jobs.

Needs vLLM 0.33 (the tier's base classes) and the `kvtier` binary (see kvtier.server).
"""

import argparse
import json
import mmap
import os
import statistics
import sys
import time
import types

import numpy as np


def _spec(chunk_bytes):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("bench",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes // 16,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig(name="kvtier-vllm-bench", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=16),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )
    return types.SimpleNamespace(config=cfg)


def _region(num_chunks, chunk_bytes):
    """Shared anonymous memory, pre-faulted, as vLLM's /dev/shm region: (rows, memoryview)."""
    buf = mmap.mmap(-1, num_chunks * chunk_bytes)
    rows = np.frombuffer(buf, np.uint8).reshape(num_chunks, chunk_bytes)
    rows[:] = 0
    return rows, memoryview(buf).cast("B", (num_chunks, chunk_bytes))


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def run(addr, *, chunks=256, job_chunks=8, lookups=300, io_threads=4, connections=4, repeats=3):
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    chunk_bytes = 2 << 20
    rows, view = _region(chunks * 2, chunk_bytes)
    rng = np.random.default_rng(0)
    # Incompressible-looking KV: random bf16-ish bytes.
    rows[:chunks] = rng.integers(0, 256, (chunks, chunk_bytes), dtype=np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvtierTier", "module_path": "kvtier.vllm", "server": addr, "tenant": "bench",
         "io_threads": io_threads, "connections": connections, "timeout_s": 30.0},
        view, _spec(chunk_bytes))
    if tier.disabled:
        raise SystemExit(f"tier disabled: {tier.disabled}")
    keys = [make_offload_key(rng.bytes(32), 0) for _ in range(chunks)]
    job_id = [0]

    def jobs(load, dst0):
        out = []
        for i in range(0, chunks, job_chunks):
            job_id[0] += 1
            ids = np.arange(i, min(i + job_chunks, chunks), dtype=np.int32) + dst0
            out.append(TransferJob(job_id=job_id[0], keys=keys[i:i + job_chunks], chunk_ids=ids,
                                   is_promotion=load, req_context=ReqContext("bench")))
        return out

    def run_jobs(js, load):
        t0 = time.perf_counter()
        for j in js:
            (tier.submit_load if load else tier.submit_store)(j)
        want, ok = {j.job_id for j in js}, 0
        while want:
            for r in tier.get_finished_jobs():
                want.discard(r.job_id)
                ok += r.success
            time.sleep(0.0002)
        dt = time.perf_counter() - t0
        if ok != len(js):
            raise SystemExit(f"{len(js) - ok} of {len(js)} {'load' if load else 'store'} jobs failed")
        return dt

    total = chunks * chunk_bytes
    store_s = run_jobs(jobs(False, 0), load=False)
    load_s, memcpy_s = [], []
    for _ in range(repeats):
        rows[chunks:] = 0
        load_s.append(run_jobs(jobs(True, chunks), load=True))
        if not np.array_equal(rows[chunks:], rows[:chunks]):
            raise SystemExit("loaded bytes differ from the stored ones")
        rows[chunks:] = 0
        t0 = time.perf_counter()
        np.copyto(rows[chunks:], rows[:chunks])
        memcpy_s.append(time.perf_counter() - t0)

    # Lookups of 128 keys: 96 stored (fewer if fewer chunks), the rest not.
    n_hit = min(96, chunks)
    probe = keys[:n_hit] + [make_offload_key(rng.bytes(32), 0) for _ in range(128 - n_hit)]
    client_lat, tier_lat = [], []
    for _ in range(lookups):
        t0 = time.perf_counter()
        got = tier._client.exists_keys(tier._ns, probe)
        client_lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got2 = tier._batch_lookup(probe)
        tier_lat.append(time.perf_counter() - t0)
    if sum(got) != n_hit or sum(got2) != n_hit:
        raise SystemExit(f"lookups found {sum(got)}/{sum(got2)} of {n_hit} stored keys")
    tier.shutdown()
    gb = total / 1e9
    return {
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "job_chunks": job_chunks,
        "io_threads": io_threads,
        "lookup_128_client_p50_ms": statistics.median(client_lat) * 1e3,
        "lookup_128_client_p99_ms": _pct(client_lat, 99) * 1e3,
        "lookup_128_tier_p50_ms": statistics.median(tier_lat) * 1e3,
        "lookup_128_tier_p99_ms": _pct(tier_lat, 99) * 1e3,
        "store_gb_s": gb / store_s,
        "load_gb_s": gb / min(load_s),
        "load_gb_s_median": gb / statistics.median(load_s),
        "memcpy_gb_s": gb / min(memcpy_s),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", help="a running kvtier (default: start one here)")
    ap.add_argument("--chunks", type=int, default=256, help="2 MiB chunks moved per pass (default 256 = 512 MiB)")
    ap.add_argument("--job-chunks", type=int, default=8, help="chunks per vLLM job (default 8)")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--lookups", type=int, default=300, help="128-key lookups timed (default 300)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    kw = dict(chunks=a.chunks, job_chunks=a.job_chunks, lookups=a.lookups, io_threads=a.io_threads,
              connections=a.connections)
    if a.server:
        res = run(a.server, **kw)
    else:
        from kvtier.server import LocalServer

        dram = f"{max(1, (a.chunks * 2 * 3) // 1024 + 1)}GiB"
        with LocalServer(dram_capacity=dram) as srv:
            res = run(srv.addr, **kw)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"kvtier.vllm bench: {res['chunks']} chunks of {res['chunk_bytes'] >> 20} MiB, "
          f"{res['job_chunks']} per job, {res['io_threads']} io threads, {os.cpu_count()} CPUs")
    print(f"lookup, 128 keys: client p50 {res['lookup_128_client_p50_ms']:.3f} ms  p99 "
          f"{res['lookup_128_client_p99_ms']:.3f} ms | tier batch p50 {res['lookup_128_tier_p50_ms']:.3f} ms  "
          f"p99 {res['lookup_128_tier_p99_ms']:.3f} ms")
    print(f"load into the CPU region: {res['load_gb_s']:.2f} GB/s (median {res['load_gb_s_median']:.2f}); "
          f"memcpy of the same bytes: {res['memcpy_gb_s']:.2f} GB/s; store: {res['store_gb_s']:.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
