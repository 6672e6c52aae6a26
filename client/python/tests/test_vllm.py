"""kvtier.vllm.KvtierTier inside vLLM 0.33's real offloading code, against real `kvtier serve`
processes: the tiering manager, the scheduler with the OffloadingConnector, a server killed,
hung and restarted, namespace isolation, and refused configurations. See vllm_harness.py for
what stands in for the GPU worker."""

import logging
import os
import time

import numpy as np
import pytest

if os.environ.get("KVTIER_REQUIRE_ENGINES"):  # CI: a broken vLLM install fails instead of skipping
    import vllm.v1.kv_offload.tiering.base  # noqa: F401

pytest.importorskip("vllm", reason="vLLM is not installed (`bash scripts/test engines` installs it)")

import vllm_harness as h  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402

import kvtier.vllm as kv_vllm  # noqa: E402

HIT, MISS, RETRY, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.HIT_PENDING
CHUNK = 4096
LOOKUP_DEADLINE = 0.5  # h.tier_config's lookup_timeout_s
JOB_DEADLINE = 2.0  # h.tier_config's timeout_s


def rand_keys(n, seed, hash_bytes=32):
    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(hash_bytes), 0) for _ in range(n)]


@pytest.fixture(scope="module")
def kvs(tmp_path_factory):
    srv = h.KvServer(tmp_path_factory.mktemp("kvtier-vllm")).start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _no_shm_leak():
    before = {f for f in os.listdir("/dev/shm") if f.startswith("vllm_offload_")}
    yield
    after = {f for f in os.listdir("/dev/shm") if f.startswith("vllm_offload_")}
    assert after <= before, f"shared-memory regions left behind: {after - before}"


# ------------------------------------------------------------------------- a tier on its own


def standalone_tier(addr, *, num_chunks=8, spec=None, **kw):
    """The tier as vLLM's factory builds it, over a plain primary region (no manager), so a test
    can submit jobs and poll results itself."""
    arr = np.zeros((num_chunks, CHUNK), np.int8)
    tier = SecondaryTierFactory.create_secondary_tier(h.tier_config(addr, **kw), memoryview(arr),
                                                      spec or h.offloading_spec(chunk_bytes=CHUNK))
    return tier, arr.view(np.uint8)


def job(job_id, keys, chunks, *, load=False):
    return TransferJob(job_id=job_id, keys=list(keys), chunk_ids=np.asarray(chunks, np.int32), is_promotion=load,
                       req_context=ReqContext(f"job-{job_id}"))


def collect(tier, job_ids, timeout_s):
    """Polls get_finished_jobs until every job in `job_ids` is reported; asserts each is reported
    once and nothing else is. Returns {job_id: JobResult}."""
    got = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for r in tier.get_finished_jobs():
            assert r.job_id in job_ids and r.job_id not in got, f"job {r.job_id} reported twice or unknown"
            got[r.job_id] = r
        if set(got) == set(job_ids):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {set(job_ids) - set(got)} not reported within {timeout_s} s")
        time.sleep(0.01)
    time.sleep(0.05)
    assert list(tier.get_finished_jobs()) == []
    return got


def tier_lookup(tier, keys, req_id, timeout_s=10.0):
    """Looks keys up once per step (flushing the async lookups at each step end) until no answer
    is RETRY. Returns (answers, seconds taken, steps)."""
    ctx = ReqContext(req_id)
    tier.on_new_request(ctx)
    t0 = time.monotonic()
    steps = 0
    while True:
        answers = [tier.lookup(k, ctx) for k in keys]
        if RETRY not in answers:
            tier.on_request_finished(ctx)
            return answers, time.monotonic() - t0, steps
        assert time.monotonic() - t0 < timeout_s, "lookups stayed RETRY"
        tier.on_schedule_end(h.END)
        steps += 1
        time.sleep(0.01)


# ------------------------------------------------------------------------- T1: the manager


def test_tiering_manager_round_trip(kvs):
    keys = rand_keys(4, seed=1)
    m1, tier1, rows1 = h.make_manager(kvs.addr, chunk_bytes=CHUNK)
    assert tier1.disabled is None
    written = h.store_through(m1, rows1, keys)
    assert len(written) == 4
    stats = tier1.get_stats()
    assert stats.data["data"][kv_vllm.M_STORE_BYTES][()] == 4 * CHUNK
    assert kv_vllm.M_STORE_FAILED not in stats.data["data"]
    assert set(stats.data["data"]) <= set(kv_vllm.KvtierTier.build_metric_definitions({}))
    m1.shutdown()

    # An engine restart: a fresh manager, tier and client, the same kvtier server.
    m2, tier2, rows2 = h.make_manager(kvs.addr, chunk_bytes=CHUNK)
    ctx, history, answers = h.lookup_until(m2, keys, "reader", {PENDING, HIT})
    assert history[0] == [RETRY] * 4  # the async lookup is in flight
    assert all(a in (RETRY, PENDING, HIT) for step in history for a in step), history  # never a MISS
    h.wait_idle(m2)  # the promotions (kvtier -> CPU rows) finish
    assert [m2.lookup(k, ctx) for k in keys] == [HIT] * 4
    spec = m2.prepare_load(keys, ctx)
    for key, chunk in zip(keys, spec.block_ids):
        assert rows2[chunk].tobytes() == written[key]
    m2.complete_load(keys, ctx)
    m2.on_request_finished(ctx)
    m2.shutdown()


# ------------------------------------------------------------------------- T2: the scheduler


def test_scheduler_loads_a_prefix_another_engine_stored(kvs, tmp_path):
    model = h.write_model_dir(tmp_path)
    prompt = list(range(1, 65))  # 4 blocks of 16 tokens

    a = h.Engine(model, h.tier_config(kvs.addr), engine_id="t2-a")
    try:
        assert a.tier.disabled is None and a.tier.hash_algo == "sha256"
        ra = a.request("a", prompt)
        scheduled, loads = a.run(ra)
        assert sum(scheduled) == 64 and not loads
        stored = [a.written[c] for c in a.stored_chunks]
        assert len(stored) == 4
        # vLLM's region is its own /dev/shm file: the tier registered it, and the chunks went
        # from vLLM's rows to the server over the same-node socket, with no TCP fallback.
        assert a.tier._regions, "the CPU tier's shared region is registered"
        st = a.tier._client.samenode_stats()
        assert st["stores"] >= 1 and st["fallbacks"] == {}, st
        assert kvs.served("samenode_store") >= 1
    finally:
        a.shutdown()

    b = h.Engine(model, h.tier_config(kvs.addr), engine_id="t2-b")
    try:
        rb = b.request("b", prompt + list(range(100, 116)))  # 80 tokens, the first 64 stored by A
        assert rb.block_hashes[:4] == ra.block_hashes[:4]
        scheduled, loads = b.run(rb)
        assert scheduled[0] == 0  # waiting on the kvtier lookup
        assert [n for n in scheduled if n] == [16], scheduled  # only the last 16 tokens are computed
        assert len(loads) == 1 and len(loads[0].dst_spec.block_ids) == 4  # 4 GPU blocks loaded
        (promoted,) = b.loaded.values()
        assert promoted == stored  # the bytes A's worker wrote, promoted from kvtier into B's CPU rows
        # Promoted by the server straight into B's own shared file, over the same-node socket.
        st = b.tier._client.samenode_stats()
        assert st["loads"] >= 1 and st["fallbacks"] == {}, st
        assert kvs.served("samenode_load") >= 1
        assert b.tier.get_stats() is not None or True
    finally:
        b.shutdown()


# ------------------------------------------------------------------ a dead, hung, restarted server


def test_server_killed_mid_run_then_restarted(tmp_path):
    # A small DRAM tier over a disk tier: what DRAM evicts is on disk, which a restart keeps.
    srv = h.KvServer(tmp_path / "data", dram="1MiB", disk="64MiB").start()
    try:
        tier, rows = standalone_tier(srv.addr, num_chunks=512)
        rows[:] = np.random.default_rng(5).integers(0, 256, rows.shape, dtype=np.uint8)
        keys = rand_keys(4, seed=2)
        tier.submit_store(job(1, keys, [0, 1, 2, 3]))
        assert collect(tier, {1}, JOB_DEADLINE + 2)[1].success
        # 1.6 MB more pushes the first chunks out of DRAM, onto disk.
        tier.submit_store(job(2, rand_keys(400, seed=20), range(100, 500)))
        assert collect(tier, {2}, JOB_DEADLINE + 5)[2].success
        assert tier_lookup(tier, keys, "r1")[0] == [HIT] * 4
        srv.until_demoted()

        srv.kill()

        # Lookups: MISS within the deadline (RETRY meanwhile), never an exception.
        answers, took, _ = tier_lookup(tier, keys, "r2")
        assert answers == [MISS] * 4
        assert took < LOOKUP_DEADLINE + 1.0, took
        # Jobs: each reported once, as failed, within the job deadline.
        other = rand_keys(2, seed=3)
        t0 = time.monotonic()
        tier.submit_store(job(3, other, [4, 5]))
        tier.submit_load(job(4, keys[:2], [6, 7], load=True))
        got = collect(tier, {3, 4}, JOB_DEADLINE + 2)
        assert not got[3].success and not got[4].success
        assert time.monotonic() - t0 < JOB_DEADLINE + 2
        # drain_jobs returns (bounded by the job deadline); the drained job is reported at the next poll.
        tier.submit_store(job(5, other, [4, 5]))
        t0 = time.monotonic()
        tier.drain_jobs()
        assert time.monotonic() - t0 < JOB_DEADLINE + 2
        assert not collect(tier, {5}, 0.0)[5].success
        assert not tier.has_pending_work()
        stats = tier.get_stats().data["data"]
        assert stats[kv_vllm.M_STORE_FAILED][()] == 2 and stats[kv_vllm.M_LOAD_FAILED][()] == 1
        assert stats[kv_vllm.M_LOOKUP_ERRORS][()] >= 1

        # Restarted on the same data directory: once the client reconnects (it backs off for a
        # second after a failed connect), the chunks stored before the kill are hits again.
        srv.start()
        t0 = time.monotonic()
        while tier_lookup(tier, keys, f"r3-{time.monotonic()}")[0] != [HIT] * 4:
            assert time.monotonic() - t0 < 10, "hits never came back"
            time.sleep(0.1)
        rows[200:204] = 0
        tier.submit_load(job(6, keys, [200, 201, 202, 203], load=True))
        assert collect(tier, {6}, JOB_DEADLINE + 2)[6].success
        assert (rows[200:204] == rows[0:4]).all()
        tier.submit_store(job(7, other, [4, 5]))
        assert collect(tier, {7}, JOB_DEADLINE + 2)[7].success
        tier.shutdown()
    finally:
        srv.stop()


def test_jobs_in_flight_when_the_server_dies_are_each_reported_once(tmp_path):
    srv = h.KvServer(tmp_path / "data").start()
    try:
        tier, rows = standalone_tier(srv.addr, num_chunks=64, io_threads=2)
        rows[:] = np.random.default_rng(6).integers(0, 256, rows.shape, dtype=np.uint8)
        got = {}
        for i in range(40):
            if i == 20:
                # Kill it with jobs queued and running: some of the first 20 may still succeed.
                while len(got) < 5:
                    got.update((r.job_id, r) for r in tier.get_finished_jobs())
                srv.kill()
            keys = rand_keys(2, seed=100 + i)
            chunks = [(2 * i) % 64, (2 * i + 1) % 64]
            if i % 3 == 0:
                tier.submit_load(job(i, keys, chunks, load=True))
            else:
                tier.submit_store(job(i, keys, chunks))
        got.update(collect(tier, set(range(40)) - set(got), 40 * JOB_DEADLINE))
        assert sorted(got) == list(range(40))
        assert any(got[i].success for i in range(20) if i % 3), "stores before the kill succeed"
        assert not any(got[i].success for i in range(20, 40))
        tier.shutdown()
    finally:
        srv.stop()


def test_manager_survives_a_dead_server(tmp_path):
    """vLLM's manager asserts that every finished job is one it knows: against a dead server the
    manager still sees each store reported, lookups settle at MISS, nothing raises."""
    srv = h.KvServer(tmp_path / "data")  # never started: connection refused
    m, tier, rows = h.make_manager(srv.addr, chunk_bytes=CHUNK)
    keys = rand_keys(4, seed=7)
    h.store_through(m, rows, keys)  # returns once every job was reported
    m2, _, _ = h.make_manager(srv.addr, chunk_bytes=CHUNK)
    t0 = time.monotonic()
    _, history, answers = h.lookup_until(m2, keys, "reader", {MISS})
    assert time.monotonic() - t0 < LOOKUP_DEADLINE + 1.0
    m.shutdown()
    m2.shutdown()


def test_hung_server_is_a_miss_within_the_deadline():
    hung = h.HungServer()
    try:
        tier, rows = standalone_tier(hung.addr)
        keys = rand_keys(3, seed=8)
        answers, took, _ = tier_lookup(tier, keys, "r")
        assert answers == [MISS] * 3
        assert took < LOOKUP_DEADLINE + 1.0, took
        t0 = time.monotonic()
        tier.submit_store(job(1, keys, [0, 1, 2]))
        tier.submit_load(job(2, keys, [3, 4, 5], load=True))
        got = collect(tier, {1, 2}, JOB_DEADLINE + 3)
        assert not got[1].success and not got[2].success
        assert time.monotonic() - t0 < JOB_DEADLINE + 3
        tier.drain_jobs()
        tier.shutdown()
    finally:
        hung.close()


# ----------------------------------------------------------------------------- isolation


def test_cache_salt_and_model_keep_chunks_apart(kvs, tmp_path):
    model = h.write_model_dir(tmp_path, "tiny-llama")
    other_model = h.write_model_dir(tmp_path, "other-llama")
    prompt = list(range(200, 264))
    long_prompt = prompt + list(range(300, 316))

    a = h.Engine(model, h.tier_config(kvs.addr), engine_id="iso-a")
    try:
        scheduled, _ = a.run(a.request("a", prompt, cache_salt="tenant-x"))
        assert sum(scheduled) == 64
    finally:
        a.shutdown()

    b = h.Engine(model, h.tier_config(kvs.addr), engine_id="iso-b")
    try:
        # No salt, another salt: the salted chunks are not found; everything is computed.
        for rid, salt in (("plain", None), ("salt-y", "tenant-y")):
            scheduled, loads = b.run(b.request(rid, long_prompt, cache_salt=salt))
            assert sum(scheduled) == 80 and not loads, (rid, scheduled)
        # The same salt: a hit.
        scheduled, loads = b.run(b.request("salt-x", long_prompt, cache_salt="tenant-x"))
        assert [n for n in scheduled if n] == [16] and len(loads) == 1
    finally:
        b.shutdown()

    c = h.Engine(other_model, h.tier_config(kvs.addr), engine_id="iso-c")
    try:
        assert c.tier.namespace_fields["model"] != b.tier.namespace_fields["model"]
        scheduled, loads = c.run(c.request("salt-x", long_prompt, cache_salt="tenant-x"))
        assert sum(scheduled) == 80 and not loads, scheduled
    finally:
        c.shutdown()

    # The same bytes under another tenant, layout or hash algorithm are other namespaces too.
    keys = rand_keys(2, seed=9)
    writer, rows = standalone_tier(kvs.addr)
    writer.submit_store(job(1, keys, [0, 1]))
    assert collect(writer, {1}, JOB_DEADLINE + 2)[1].success
    assert tier_lookup(writer, keys, "w")[0] == [HIT, HIT]
    variants = [
        dict(tenant="other"),
        dict(salt="s3cret"),
        dict(revision="v2"),
        dict(hash_algo="sha256_cbor"),
        dict(spec=h.offloading_spec(dtype="float16", chunk_bytes=CHUNK)),
        dict(spec=h.offloading_spec(model="another-model", chunk_bytes=CHUNK)),
    ]
    for kw in variants:
        t, _ = standalone_tier(kvs.addr, **kw)
        assert t.disabled is None, kw
        assert tier_lookup(t, keys, "v")[0] == [MISS, MISS], kw
        t.shutdown()
    writer.shutdown()


# ------------------------------------------------------------------------ refused configurations


def test_xxhash_without_pythonhashseed_is_refused(kvs, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    model = h.write_model_dir(tmp_path)
    # vLLM's xxhash needs the `xxhash` module, which this environment lacks: the requests are
    # hashed with sha256 while the engine is configured (and the tier sees) xxhash.
    with caplog.at_level(logging.ERROR, logger="vllm.kvtier"):
        e = h.Engine(model, h.tier_config(kvs.addr), engine_id="xx", hash_algo="xxhash", request_hash="sha256")
    try:
        assert e.tier.disabled and "PYTHONHASHSEED" in e.tier.disabled
        assert any("PYTHONHASHSEED" in r.getMessage() for r in caplog.records)
        r = e.request("x", list(range(1, 81)))
        scheduled, loads = e.run(r)  # an always-empty tier: computed in full, no exception
        assert sum(scheduled) == 80 and not loads
    finally:
        e.shutdown()

    # Straight on the tier: MISS at once, jobs fail, no exception.
    tier, _ = standalone_tier(kvs.addr, hash_algo="xxhash")
    assert tier.disabled
    keys = rand_keys(2, seed=10, hash_bytes=16)
    assert tier_lookup(tier, keys, "x")[0] == [MISS, MISS]
    tier.submit_store(job(1, keys, [0, 1]))
    tier.submit_load(job(2, keys, [2, 3], load=True))
    got = collect(tier, {1, 2}, 1.0)
    assert not got[1].success and not got[2].success
    tier.drain_jobs()
    tier.shutdown()

    # With a pinned seed, xxhash is accepted (and is part of the namespace).
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    tier, _ = standalone_tier(kvs.addr, hash_algo="xxhash")
    assert tier.disabled is None and tier.namespace_fields["hash_algo"] == "xxhash"
    tier.shutdown()


def test_bad_configs_and_keys_are_misses_not_exceptions(kvs):
    # No server, a quantizing codec (refused by opaque namespaces), nonsense options: an
    # always-empty tier, never an exception out of the constructor.
    for kw in (dict(server=None), dict(codec="fp8"), dict(timeout_s="soon"), dict(lookup_timeout_s=0),
               dict(locality="MARS"), dict(salt=b"x" * 65)):
        tier, _ = standalone_tier(kvs.addr, **kw)
        assert tier.disabled, kw
        keys = rand_keys(1, seed=11)
        assert tier_lookup(tier, keys, "r")[0] == [MISS]
        tier.submit_store(job(1, keys, [0]))
        assert not collect(tier, {1}, 1.0)[1].success
        tier.shutdown()
    # A key whose hash is not the configured algorithm's length: a MISS, never RETRY.
    tier, _ = standalone_tier(kvs.addr)
    short = rand_keys(1, seed=12, hash_bytes=16)
    ctx = ReqContext("r")
    assert tier.lookup(short[0], ctx) == MISS
    # A job with fewer chunks than keys, an out-of-range chunk: failed jobs.
    tier.submit_store(job(2, rand_keys(2, seed=13), [0]))
    tier.submit_load(job(3, rand_keys(1, seed=14), [99], load=True))
    got = collect(tier, {2, 3}, 1.0)
    assert not got[2].success and not got[3].success
    tier.shutdown()
    # After shutdown: still no exception.
    assert tier.lookup(rand_keys(1, seed=15)[0], ctx) == MISS
    tier.submit_store(job(4, rand_keys(1, seed=16), [0]))
    assert not collect(tier, {4}, 1.0)[4].success
