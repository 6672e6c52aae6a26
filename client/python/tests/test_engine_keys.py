"""The engine-key API from Python (what the vLLM, SGLang and LMCache adapters call) against a real
server: engine hashes as keys in opaque namespaces, per-key existence, stores from one buffer, a
list of buffers or raw segments, loads straight into buffers and segments, deadlines, and the
mistakes a caller can make."""

import time

import numpy as np
import pytest

import kvtier

BB = 64 * 1024 + 512  # an engine's chunk: not a power of two


def opaque(**kw):
    args = dict(block_bytes=BB, engine="vllm", engine_layout="NHD", kv_dtype="bfloat16", page_tokens=16,
                hash_algo="sha256", salt=b"tenant-secret")
    args.update(kw)
    return kvtier.Namespace.opaque("acme", "llama@rev1", **args)


def hashes(n, seed=0):
    return [bytes([seed]) + i.to_bytes(4, "big") * 8 for i in range(n)]


def blocks(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, BB), dtype=np.uint8)


def test_store_exists_load_round_trip(server):
    c = kvtier.Client(server.addr, never_raise=False)
    ns = opaque()
    assert ns.is_opaque and ns.lossless and ns.block_bytes == BB
    keys, kv = hashes(6), blocks(6)
    # Out of order, with a hole at 2: existence is per key.
    order = [4, 0, 1, 3, 5]
    assert c.store_keys(ns, [keys[i] for i in order], kv[order]) == [True] * 5
    assert c.exists_keys(ns, keys) == [True, True, False, True, True, True]
    # A second store reports what was already there.
    assert c.store_keys(ns, keys[:3], kv[:3], report=True) == ["present:raw", "present:raw", "stored"]
    out = np.zeros_like(kv)
    assert c.load_keys_into(ns, keys, out) == [True] * 6
    np.testing.assert_array_equal(out, kv)
    # A list of per-key buffers (rows of an engine's pool, in any order).
    rows = np.zeros((8, BB), dtype=np.uint8)
    got = c.load_keys_into(ns, [keys[5], keys[0], hashes(1, seed=9)[0]], [rows[7], rows[2], rows[3]])
    assert got == [True, True, False]
    np.testing.assert_array_equal(rows[7], kv[5])
    np.testing.assert_array_equal(rows[2], kv[0])
    assert not rows[3].any(), "a miss writes nothing"


def test_segments_gather_and_scatter(server):
    c = kvtier.Client(server.addr, never_raise=False)
    ns = opaque(engine_layout="layer_first")
    keys, kv = hashes(3, seed=1), blocks(3, seed=1)
    # Each block as 4 planes in separate arrays, stored from their addresses.
    planes = [np.ascontiguousarray(b.reshape(4, -1)[j]) for b in kv for j in range(4)]
    segs = [[(planes[4 * i + j].ctypes.data, planes[4 * i + j].nbytes) for j in range(4)] for i in range(3)]
    assert c.store_keys_segments(ns, keys, segs) == [True] * 3
    # Loaded into 2 segments per key of other sizes.
    dst = [(np.zeros(1000, np.uint8), np.zeros(BB - 1000, np.uint8)) for _ in range(3)]
    dsegs = [[(a.ctypes.data, a.nbytes), (b.ctypes.data, b.nbytes)] for a, b in dst]
    assert c.load_keys_into_segments(ns, keys, dsegs) == [True] * 3
    for i, (a, b) in enumerate(dst):
        np.testing.assert_array_equal(np.concatenate([a, b]), kv[i])


def test_caller_mistakes_raise_value_error_before_sending(server):
    c = kvtier.Client(server.addr)  # never-raise: still, a caller's bug is a ValueError
    ns = opaque()
    keys, kv = hashes(2), blocks(2)
    with pytest.raises(ValueError, match="bytes"):
        c.store_keys(ns, keys, kv.reshape(-1)[:-1])
    with pytest.raises(ValueError, match="bytes"):
        c.exists_keys(ns, ["not-bytes"])
    buf = np.zeros(2 * BB, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        c.load_keys_into_segments(ns, keys, [[(buf.ctypes.data, BB)], [(buf.ctypes.data + 100, BB)]])
    with pytest.raises(ValueError, match="overlap"):
        c.load_keys_into(ns, keys, [buf[:BB], buf[:BB]])
    with pytest.raises(ValueError, match="segments hold"):
        c.load_keys_into_segments(ns, keys[:1], [[(buf.ctypes.data, BB - 1)]])
    with pytest.raises(ValueError, match="read-only"):
        c.load_keys_into(ns, keys, bytes(2 * BB))
    # Quantizing codecs don't apply to an engine's opaque bytes.
    with pytest.raises(ValueError, match="quantizes|raw"):
        opaque(codec="fp8")
    with pytest.raises(ValueError, match="pp_rank"):
        opaque(pp_rank=2, pp_world=2)


def test_identity_fields_keep_engines_apart(server):
    c = kvtier.Client(server.addr, never_raise=False)
    base = opaque()
    keys, kv = hashes(1, seed=3), blocks(1, seed=3)
    assert c.store_keys(base, keys, kv) == [True]
    assert c.exists_keys(base, keys) == [True]
    for other in [opaque(engine_layout="HND"), opaque(kv_dtype="fp8_e5m2"), opaque(tp_rank=1, tp_world=2),
                  opaque(pp_rank=1, pp_world=2), opaque(hash_algo="xxhash"), opaque(page_tokens=32),
                  opaque(salt=b"other-tenant"), opaque(engine="sglang"), opaque(block_bytes=BB * 2)]:
        assert other.id != base.id, repr(other)
        assert c.exists_keys(other, keys) == [False], repr(other)


def test_dead_server_is_a_miss_within_the_deadline():
    from kvtier.server import LocalServer

    srv = LocalServer(dram_capacity="64MiB")
    c = kvtier.Client(srv.addr)
    ns = opaque()
    keys, kv = hashes(2, seed=5), blocks(2, seed=5)
    assert c.store_keys(ns, keys, kv) == [True, True]
    srv.stop()
    t = time.monotonic()
    assert c.exists_keys(ns, keys, timeout_s=0.5) == [False, False]
    out = np.zeros_like(kv)
    assert c.load_keys_into(ns, keys, out, timeout_s=0.5) == [False, False]
    assert c.store_keys(ns, keys, kv, timeout_s=0.5) == [False, False]
    assert time.monotonic() - t < 5
    assert c.last_miss[0] in ("connect", "io", "timeout", "protocol"), c.last_miss
    raising = kvtier.Client(srv.addr, never_raise=False)
    with pytest.raises(kvtier.UnavailableError):
        raising.exists_keys(ns, keys, timeout_s=0.5)
