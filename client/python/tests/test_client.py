"""The Python client against a real server: buffers in and out, codecs, sessions, and errors as
exceptions (raising mode) or misses (never-raise mode)."""

import numpy as np
import pytest

import kvtier


def ns(codec="raw", tenant="acme"):
    return kvtier.Namespace(tenant, "m@1", layers=2, kv_heads=2, head_dim=64, dtype="fp32", block_tokens=16, codec=codec)


def kv_for(n_tokens, seed=0):
    per_token = ns().token_bytes // 4
    return np.random.default_rng(seed).standard_normal(n_tokens * per_token).astype(np.float32)


def test_store_lookup_load_round_trip(server):
    c = kvtier.Client(server.addr, never_raise=False)
    n = ns()
    toks = list(range(1000, 1040))  # 2 full blocks + 8 tokens
    kv = kv_for(32)
    assert c.store(n, toks, kv) == 2
    assert c.lookup(n, toks) == 32
    out = np.zeros_like(kv)
    assert c.load_into(n, toks, out) == 32
    np.testing.assert_array_equal(out, kv)
    # `load` returns a new bytearray; a view as float32 is the same KV.
    back = np.frombuffer(c.load(n, toks), dtype=np.float32)
    np.testing.assert_array_equal(back, kv)
    # An output with room for one block gets one block.
    small = np.zeros(n.block_bytes // 4, dtype=np.float32)
    assert c.load_into(n, toks, small) == 16
    np.testing.assert_array_equal(small, kv[: len(small)])
    # Stores from a later block send only those blocks.
    toks2 = list(range(2000, 2048))
    assert c.store(n, toks2, kv_for(16, 1), first_block=2) == 1
    assert c.lookup(n, toks2) == 0  # blocks 0 and 1 are missing, so no prefix
    assert c.store(n, toks2, kv_for(32, 2)) == 2
    assert c.lookup(n, toks2) == 48
    # Stats give every figure of a tier (pinned and allocated bytes were left out).
    dram = c.stats(n)["tiers"]["dram"]
    assert dram["blocks"] == 5 and dram["resident_bytes"] == 5 * n.block_bytes, dram
    assert dram["allocated_bytes"] >= dram["resident_bytes"] and dram["pinned_bytes"] == 0, dram


def test_token_ids_as_integer_arrays(server):
    import array

    c = kvtier.Client(server.addr, never_raise=False)
    n = ns(tenant="token-arrays")
    toks = list(range(70_000, 70_048))  # ids above 2**16: a narrowing cast would be caught
    kv = kv_for(48, 9)
    assert c.store(n, np.array(toks, dtype=np.int64), kv) == 3
    # Every integer array names the same blocks as the list does.
    for ids in [toks, np.array(toks, dtype=np.int32), np.array(toks, dtype=np.uint32),
                np.array(toks, dtype=np.uint64), array.array("I", toks), array.array("q", toks)]:
        assert c.lookup(n, ids) == 48, type(ids)
    out = np.zeros_like(kv)
    assert c.load_into(n, np.array(toks, dtype=np.int32), out) == 48
    np.testing.assert_array_equal(out, kv)
    # Big-endian arrays are their values, not their bytes read little-endian (they were).
    for dtype in (">i4", ">u4", ">i8", ">u8"):
        assert c.lookup(n, np.array(toks, dtype=dtype)) == 48, dtype
    # A strided view (every other id) is read in order, not as raw memory.
    wide = np.array([[t, 0] for t in toks], dtype=np.int64)[:, 0]
    assert not wide.flags.c_contiguous and c.lookup(n, wide) == 48
    # Ids that are not token ids are refused in both modes, naming the problem.
    for mode in (False, True):
        cm = kvtier.Client(server.addr, never_raise=mode)
        with pytest.raises(ValueError, match="not in 0..2"):
            cm.lookup(n, np.array([1, -5, 3], dtype=np.int64))
        with pytest.raises(ValueError, match="not in 0..2"):
            cm.lookup(n, np.array([2**32], dtype=np.uint64))
        with pytest.raises(ValueError, match="one-dimensional"):
            cm.lookup(n, np.array(toks, dtype=np.int64).reshape(3, 16))
        with pytest.raises(ValueError, match="integer array or a sequence"):
            cm.lookup(n, np.array(toks, dtype=np.float32))
        with pytest.raises(ValueError, match="integer array or a sequence"):
            cm.lookup(n, [1, 2, -3])


def test_codecs_shrink_and_decode(server):
    c = kvtier.Client(server.addr, never_raise=False)
    toks = list(range(3000, 3064))
    kv = kv_for(64, 3)
    raw_bytes = kv.nbytes
    for codec, name, bound, shrink in [
        ("fp8", "fp8_e4m3", 0.07, 0.3),
        ("nvfp4", "nvfp4", 0.2, 0.17),
        ("nvfp4+had", "nvfp4+had", 0.2, 0.17),
        ("raw+lz4", "raw+lz4", 0.0, 1.01),
    ]:
        w = ns(codec, tenant=f"codec-{codec}")
        assert w.codec == name
        before = kvtier.resident_bytes(c, w)
        assert c.store(w, toks, kv) == 4
        held = kvtier.resident_bytes(c, w) - before
        assert 0 < held <= raw_bytes * shrink, (codec, held, raw_bytes)
        out = np.zeros_like(kv)
        assert c.load_into(ns(tenant=f"codec-{codec}"), toks, out) == 64  # a raw reader decodes
        err = np.abs(out - kv).max() / np.abs(kv).max()
        assert err <= bound, (codec, err)
        if bound:
            assert err > 0
    with pytest.raises(ValueError, match="unknown codec"):
        ns("int3")


def test_lossless_sink_blocks_stay_exact(server):
    c = kvtier.Client(server.addr, never_raise=False)
    w = kvtier.Namespace(
        "sink", "m@1", layers=2, kv_heads=2, head_dim=64, dtype="fp32", codec="nvfp4+had", lossless_sink_blocks=1
    )
    assert w.lossless_sink_blocks == 1 and w.with_codec("fp8").lossless_sink_blocks == 1
    toks = list(range(7000, 7048))
    kv = kv_for(48, 6)
    assert c.store(w, toks, kv) == 3
    out = np.zeros_like(kv)
    assert c.load_into(ns(tenant="sink"), toks, out) == 48
    per_block = w.block_bytes // 4
    np.testing.assert_array_equal(out[:per_block], kv[:per_block])  # block 0: raw
    assert not np.array_equal(out[per_block:], kv[per_block:])  # the rest: quantized
    assert np.abs(out - kv).max() / np.abs(kv).max() < 0.2
    # Blocks 0-1 stored, then block 2 from `first_block=2`: block 0 raw, block 2 quantized.
    toks2 = list(range(8000, 8048))
    assert c.store(w, toks2, kv[: 2 * per_block], first_block=0) == 2
    assert c.store(w, toks2, kv[2 * per_block :], first_block=2) == 1
    assert c.load_into(ns(tenant="sink"), toks2, out) == 48
    np.testing.assert_array_equal(out[:per_block], kv[:per_block])
    assert not np.array_equal(out[2 * per_block :], kv[2 * per_block :])


def test_sessions_and_their_errors(server):
    c = kvtier.Client(server.addr, never_raise=False)
    n = ns(tenant="sessions")
    toks = list(range(40))
    kv = kv_for(40, 4)
    info = c.park(n, "s1", toks, kv, ttl_s=60, priority=2)
    assert (info["token_count"], info["blocks"], info["has_tail"], info["priority"]) == (40, 2, True, 2)
    got_info, got_kv = c.resume(n, "s1")
    np.testing.assert_array_equal(np.frombuffer(got_kv, dtype=np.float32), kv)
    # Extend: whole context now 56 tokens; KV from block 2 (token 32) on.
    toks2 = toks + list(range(500, 516))
    kv2 = kv_for(56, 5)
    kv2[:32 * (n.token_bytes // 4)] = kv[:32 * (n.token_bytes // 4)]
    info2 = c.extend(n, "s1", info["version"], 40, toks2, kv2[32 * (n.token_bytes // 4):])
    assert info2["token_count"] == 56 and info2["version"] == info["version"] + 1
    _, got = c.resume(n, "s1")
    np.testing.assert_array_equal(np.frombuffer(got, dtype=np.float32), kv2)
    out = np.zeros_like(kv2)
    assert c.resume_into(n, "s1", out)["token_count"] == 56
    np.testing.assert_array_equal(out, kv2)
    with pytest.raises(kvtier.InvalidRequestError, match="holds"):
        c.resume_into(n, "s1", np.zeros(10, np.float32))
    with pytest.raises(kvtier.VersionConflictError):
        c.extend(n, "s1", info["version"], 40, toks2, kv2[32 * (n.token_bytes // 4):])
    assert [s["id"] for s in c.list_sessions(n)] == ["s1"]
    assert c.drop_session(n, "s1")
    with pytest.raises(kvtier.SessionNotFoundError, match="not found") as e:
        c.resume(n, "s1")
    # A server's refusal says its code once, and its kind once (the code leads).
    assert str(e.value).startswith("KV:Session:NotFound: ") and str(e.value).count("not found") == 1, e.value
    # An extend whose context doesn't start with the session's tokens is refused, changing nothing.
    info3 = c.park(n, "s3", toks, kv)
    other = list(range(1000, 1056))
    with pytest.raises(kvtier.InvalidRequestError, match="does not continue session") as e:
        c.extend(n, "s3", info3["version"], 40, other, kv2[32 * (n.token_bytes // 4):])
    assert str(e.value).startswith("KV:Request:Invalid: ") and str(e.value).count("KV:Request:Invalid") == 1, e.value
    got_info, got = c.resume(n, "s3")
    assert got_info["version"] == info3["version"] and got_info["token_count"] == 40
    np.testing.assert_array_equal(np.frombuffer(got, dtype=np.float32), kv)
    assert c.drop_session(n, "s3")
    with pytest.raises(ValueError, match="tail"):
        c.park(n, "s2", toks, kv[:-1])  # one float short
    with pytest.raises(ValueError, match="ttl_s"):
        c.park(n, "s2", toks, kv, ttl_s=-1)


def test_bad_arguments_are_value_errors_in_both_modes(server):
    for bad in (0, -1, float("nan"), float("inf"), 1e30):
        with pytest.raises(ValueError, match="timeout_s"):
            kvtier.Client(server.addr, timeout_s=bad)
    # An address that can't name a node is refused when the client is made (every call failed,
    # or missed for ever in never-raise mode).
    for bad, match in [("garbage addr", "not a server address"), ("127.0.0.1", "names no port"), (":7070", "no host")]:
        with pytest.raises(ValueError, match=match):
            kvtier.Client(bad)
    for kwargs, match in [
        (dict(dtype="int7"), "dtype"),
        (dict(order="random"), "order"),
        (dict(hashing="md5"), "hashing"),
        (dict(layers=0), "layers|empty|invalid"),
        (dict(block_tokens=0), "block|invalid"),
    ]:
        args = dict(layers=2, kv_heads=2, head_dim=64) | kwargs
        with pytest.raises(ValueError, match=match):
            kvtier.Namespace("acme", "m@1", **args)
    n = ns(tenant="badargs")
    toks = list(range(40))
    for c in (kvtier.Client(server.addr, never_raise=False), kvtier.Client(server.addr)):
        with pytest.raises(ValueError, match="ttl_s"):
            c.park(n, "s", toks, kv_for(40), ttl_s=1e30)
        with pytest.raises(ValueError, match="past the tokens"):
            c.extend(n, "s", 1, 41, toks, kv_for(8))
        with pytest.raises(ValueError, match="tail"):
            c.extend(n, "s", 1, 32, toks, kv_for(7))  # 8 tokens from block 2 on
        with pytest.raises(ValueError, match="read-only"):
            c.resume_into(n, "s", bytes(10))
        with pytest.raises(ValueError, match="priority"):
            c.park(n, "s", toks, kv_for(40), priority=5)  # was clamped to 2
        with pytest.raises(ValueError, match="priority"):
            c.park(n, "s", toks, kv_for(40), priority=-1)  # was an OverflowError
    # A codec that can't take the dtype is refused when the namespace is made (every store failed).
    with pytest.raises(ValueError, match="quantizes"):
        kvtier.Namespace("acme", "m@1", layers=2, kv_heads=2, head_dim=64, dtype="fp8", codec="fp8")
    # Nothing was parked by any of them.
    assert kvtier.Client(server.addr).list_sessions(n) == []


def test_bad_buffers_are_refused_clearly(server):
    c = kvtier.Client(server.addr, never_raise=False)
    n = ns()
    toks = list(range(64))
    with pytest.raises(ValueError, match="whole number"):
        c.store(n, toks, kv_for(16)[:-3])
    with pytest.raises(ValueError, match="read-only"):
        c.load_into(n, toks, bytes(n.block_bytes))
    with pytest.raises(ValueError, match="contiguous"):
        c.store(n, toks, kv_for(32).reshape(2, -1)[:, ::2])
    # More KV than the tokens make blocks: the caller's argument, in both modes (it was a server
    # refusal, a quiet 0 in never-raise mode).
    for cm in (c, kvtier.Client(server.addr)):
        with pytest.raises(ValueError, match="blocks from block"):
            cm.store(n, toks, kv_for(16), first_block=4)  # past the 4 full blocks of 64 tokens
        with pytest.raises(ValueError, match="blocks from block"):
            cm.store(n, toks, kv_for(16), first_block=2**64 - 1)  # no overflow on the way
        with pytest.raises(ValueError, match="blocks from block"):
            cm.store(n, toks[:40], kv_for(48))  # 3 blocks of KV, 2 full blocks of tokens
    # A load buffer with room for no block of the prefix asked for: refused in both modes (it
    # returned 0, read as a miss).
    for cm in (c, kvtier.Client(server.addr)):
        with pytest.raises(ValueError, match="no room for one"):
            cm.load_into(n, toks, np.zeros(n.block_bytes // 8, np.float32))
    for bad in (0, 2**62):
        with pytest.raises(ValueError, match="connections must be"):
            kvtier.Client(server.addr, connections=bad)
    # Sizes no buffer can have: refused, not a wrapped multiplication.
    huge = kvtier.Namespace("acme", "huge@1", layers=1024, kv_heads=1024, head_dim=4096, dtype="fp32",
                            block_tokens=65536)
    assert huge.block_bytes == 2**51
    with pytest.raises(ValueError, match="address space"):
        c.store_keys(huge, [b"k%d" % i for i in range(8192)], b"")
    with pytest.raises(ValueError, match="bytes"):
        c.load_keys_into(huge, [b"k%d" % i for i in range(8192)], bytearray(0))
    # The server keeps serving.
    assert c.store(n, toks, kv_for(64)) == 4


def test_never_raise_is_the_default(server):
    dead = kvtier.Client("127.0.0.1:1", timeout_s=1.0)
    n = ns()
    toks = list(range(32))
    assert dead.lookup(n, toks) == 0
    assert dead.store(n, toks, kv_for(32)) == 0
    assert dead.load_into(n, toks, np.zeros(2 * n.block_bytes // 4, np.float32)) == 0
    assert len(dead.load(n, toks)) == 0
    assert dead.park(n, "s", toks, kv_for(32)) is None
    assert dead.resume(n, "s") is None
    assert dead.last_miss[0] == "connect"
    assert sum(dead.misses.values()) == 6
    # A live server with a missing session: a miss too, with the server's reason.
    live = kvtier.Client(server.addr)
    assert live.resume(n, "nope") is None
    assert live.last_miss[0] == "session_not_found"
    # Raising mode: the same failure is an exception naming the reason.
    with pytest.raises(kvtier.UnavailableError, match="connect"):
        kvtier.Client("127.0.0.1:1", never_raise=False, timeout_s=1.0).lookup(n, toks)


def test_a_forked_child_gets_its_own_runtime_and_the_parent_is_unharmed(server):
    # multiprocessing's default start method on Linux: a child forked after the parent used
    # kvtier hung on its first call (the runtime it inherited has no threads, and its epoll
    # instance is the parent's), and the parent often died of a segfault. Then, with the parent's
    # threads busy in calls at the fork: a child's first FP8 store waited forever on the parallel
    # pool the parent had started (its threads are not in the child), and children hung or
    # crashed in the runtime's thread parking, whose one process-wide table they inherited with
    # locks held by the parent's threads.
    import gc
    import multiprocessing as mp
    import threading
    import warnings

    # The parent's client is held only here, so a child can drop its copy of it.
    held = [kvtier.Client(server.addr, never_raise=False, timeout_s=5)]
    n = ns(tenant="fork")
    n8 = ns(codec="fp8", tenant="fork")
    toks = list(range(5000, 5032))
    kv = kv_for(32, 4)
    assert held[0].store(n, toks, kv) == 2
    # Several FP8 blocks in one call: encoded in parallel, which starts the parent's pool.
    toks8 = list(range(6000, 6064))
    assert held[0].store(n8, toks8, kv_for(64, 5)) == 4
    stop = threading.Event()

    def busy():
        out = np.zeros_like(kv)
        while not stop.is_set():
            held[0].load_into(n, toks, out)
            held[0].lookup(n8, toks)

    ctx = mp.get_context("fork")
    results = ctx.Queue()

    def child(i):
        try:
            fresh = kvtier.Client(server.addr, never_raise=False, timeout_s=5)
            got = np.zeros_like(kv)
            n_loaded = fresh.load_into(n, toks, got)
            mine = list(range(10_000 + 64 * i, 10_064 + 64 * i))
            stored8 = fresh.store(n8, mine, kv_for(64, 5))
            back8 = fresh.load(n8, mine)
            # The same input, encoded by the parent: the same bytes back.
            same8 = back8 == fresh.load(n8, toks8)
            try:
                held[0].lookup(n, toks)
                said = "no error"
            except kvtier.KvtierError as e:
                said = str(e)
            # Dropped here, the parent's client must leave the parent's connections alone: they
            # are registered in the epoll instance parent and child share (dropping its sockets
            # deregistered them, and the parent's calls on them then waited forever).
            held.clear()
            gc.collect()
            results.put((n_loaded, bool(np.array_equal(got, kv)), stored8, (len(back8), same8), said))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            results.put(("error", repr(e), "", "", ""))

    threads = [threading.Thread(target=busy) for _ in range(3)]
    for t in threads:
        t.start()
    procs = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded, use of fork()"
            for i in range(12):
                procs.append(ctx.Process(target=child, args=(i,)))
                procs[-1].start()
        for p in procs:
            p.join(30)
            assert not p.is_alive(), "a forked child hung"
            assert p.exitcode == 0
    finally:
        stop.set()
        for t in threads:
            t.join()
        for p in procs:
            if p.is_alive():
                p.kill()
    for _ in procs:
        n_loaded, exact, stored8, loaded8, said = results.get(timeout=5)
        assert (n_loaded, exact) == (32, True), (n_loaded, exact, stored8)
        assert (stored8, loaded8) == (4, (64 * n8.token_bytes, True)), (stored8, loaded8)
        assert "before a fork" in said, said
    # The parent goes on, on the same client and its pooled connections, byte for byte.
    for _ in range(3):
        assert held[0].lookup(n, toks) == 32  # gRPC
        out = np.zeros_like(kv)
        assert held[0].load_into(n, toks, out) == 32  # data plane
        np.testing.assert_array_equal(out, kv)
        assert held[0].exists_keys(n, [b"no such key"]) == [False]


def test_a_namespace_is_registered_again_after_the_server_forgot_it(server):
    # A client caches its registrations: after an unregister (by it or another client), or a
    # node restarted on an empty data dir, every call failed with "unknown namespace" for good.
    a = kvtier.Client(server.addr, never_raise=False)
    b = kvtier.Client(server.addr, never_raise=False)
    n = ns(tenant="re-register")
    toks = list(range(6000, 6032))
    kv = kv_for(32, 5)
    assert a.store(n, toks, kv) == 2
    assert b.lookup(n, toks) == 32
    a.unregister(n)
    # The unregistering client registers it again on its next call: empty, and usable.
    assert a.lookup(n, toks) == 0
    assert a.store(n, toks, kv) == 2
    a.unregister(n)
    # Another client that had it learns on one call (an error that says to retry, of the class
    # a retry is for), then registers it again.
    with pytest.raises(kvtier.UnavailableError, match="unknown namespace.*registers it again.*retry"):
        b.store(n, toks, kv)
    assert b.store(n, toks, kv) == 2
    assert b.lookup(n, toks) == 32
    a.unregister(n)
    with pytest.raises(kvtier.KvtierError):
        b.lookup(n, toks)
    assert b.lookup(n, toks) == 0


def test_namespaces_compare_hash_and_pickle_and_clients_close(server):
    import pickle

    a, b = ns(tenant="eq"), ns(tenant="eq")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != ns(tenant="other") and a != ns(codec="fp8", tenant="eq") and a != "eq"
    for n in (a, kvtier.Namespace.opaque("acme", "m@1", block_bytes=4096, engine="vllm", salt=b"s", codec="raw")):
        back = pickle.loads(pickle.dumps(n))
        assert back == n and back.id == n.id and repr(back) == repr(n)
    # `with` closes the client's connections; the client still works after (it connects again).
    toks = list(range(7000, 7032))
    with kvtier.Client(server.addr, never_raise=False) as c:
        assert c.store(a, toks, kv_for(32, 6)) == 2
    assert c.lookup(a, toks) == 32
    c.close()
    assert c.lookup(pickle.loads(pickle.dumps(a)), toks) == 32
    # A shared buffer that can't be had is the caller's size, not a "connection failed".
    with pytest.raises(ValueError, match="cannot allocate a shared buffer"):
        c.alloc_buffer(2**50)


def test_ctrl_c_interrupts_a_call_to_a_server_that_never_answers():
    # The call waits up to its timeout_s (20 s here) for a server that accepted and went silent;
    # Ctrl-C a second in is taken within a moment, not when the call gives up.
    import signal
    import subprocess
    import sys
    import time

    from servers import HungServer

    hung = HungServer()
    # Python's own SIGINT handler installed even where the test runs with SIGINT ignored (a
    # background job of a non-interactive shell), which a child would inherit.
    script = f"""
import signal, time, kvtier
signal.signal(signal.SIGINT, signal.default_int_handler)
c = kvtier.Client("{hung.addr}", never_raise=False, timeout_s=20)
ns = kvtier.Namespace.opaque("acme", "stall", block_bytes=4096)
print("calling", flush=True)
t0 = time.monotonic()
try:
    c.exists_keys(ns, [b"a"])
    print("answered", flush=True)
except KeyboardInterrupt:
    print(f"interrupted {{time.monotonic() - t0:.2f}}", flush=True)
"""
    try:
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "calling"
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=30)
        assert out.startswith("interrupted"), out
        assert float(out.split()[1]) < 3.0, out
    finally:
        if p.poll() is None:
            p.kill()
        hung.close()
