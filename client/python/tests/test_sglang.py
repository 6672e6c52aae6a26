"""kvtier.sglang.KvtierHiCacheStorage inside SGLang 0.5.23's real HiCache code, against real
`kvtier serve` processes: the backend is created by SGLang's own `StorageBackendFactory` from the
`dynamic` extra config, over a real CPU `MHATokenToKVPoolHost`, and driven by the cache
controller's own page set/get functions (`HiCacheController._generic_page_set`,
`_page_set_zero_copy`, `_generic_page_get`, `_page_get_zero_copy`), for every host layout and
both paths; keys are SGLang's own page hashes."""

import hashlib
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

if os.environ.get("KVTIER_REQUIRE_ENGINES"):  # CI: a broken SGLang install fails instead of skipping
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not installed (requirements-engines.txt installs it)")
torch = pytest.importorskip("torch")

from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import kvtier.sglang as kv_sglang  # noqa: E402
from kvtier.server import LocalServer  # noqa: E402

PAGE = 16
LAYERS = 4
HEADS = 2
DIM = 64
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
PATHS = ["generic", "zero_copy"]
DEADLINE = 2.0  # the backends' timeout_s in these tests


# ------------------------------------------------------------------------------------ SGLang parts


def make_pool(layout, *, head_dim=DIM, fill=None, seed=0, allocator="default"):
    """A real CPU MHA host pool (4 layers, 2 heads, bf16, 16-token pages, 9 pages) over CPU
    "device" buffers, filled with random bf16 values (or `fill`); `allocator="shm"` puts it in
    shared memory, as SGLang's `"allocator": "shm"` does."""
    cap = 64
    k = tuple(torch.zeros(cap, HEADS, head_dim, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.zeros(cap, HEADS, head_dim, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                          layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=head_dim, v_head_dim=head_dim, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=cap, start_layer=0,
                                end_layer=LAYERS, allocator_type=allocator)
    buf = pool.kv_buffer
    if fill is None:
        g = torch.Generator().manual_seed(seed)
        buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float32).to(torch.bfloat16))
    else:
        buf.fill_(fill)
    return pool


def make_mla_pool(layout, *, fill=None, seed=0):
    """A real CPU MLA host pool (2 layers, kv_lora_rank 64 + rope 16, bf16, 16-token pages)."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    cap, rank, rope = 64, 64, 16
    bufs = tuple(torch.zeros(cap, 1, rank + rope, dtype=torch.bfloat16) for _ in range(2))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                         layer_indices=(0, 1), device_layer_num=2, page_size=PAGE, kv_lora_rank=rank,
                         qk_rope_head_dim=rope, kv_cache_dim=rank + rope, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=cap, start_layer=0, end_layer=2, target_layer_num=2)
    buf = pool.kv_buffer
    if fill is None:
        g = torch.Generator().manual_seed(seed)
        buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float32).to(torch.bfloat16))
    else:
        buf.fill_(fill)
    return pool


def storage_config(addr, *, zero_copy, tp_rank=0, tp_size=1, layout="page_first", mla=False, **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=layout != "layer_first",
        model_name="tiny-llama",
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.sglang",
                      "class_name": "KvtierHiCacheStorage", "interface_v1": int(zero_copy), "server": addr,
                      "tenant": "acme", "timeout_s": DEADLINE, "exists_timeout_s": 1.0, **extra})


class Engine:
    """One SGLang instance's storage side: the backend as the controller attaches it (the factory,
    then `register_mem_pool_host` and `on_host_pools_registered`), and the controller's own page
    functions bound to a stand-in holding what they read."""

    def __init__(self, addr, layout, path, *, tp_rank=0, tp_size=1, pool=None, mla=False, **extra):
        self.pool = pool if pool is not None else (make_mla_pool if mla else make_pool)(layout, fill=0)
        zero_copy = path == "zero_copy"
        cfg = storage_config(addr, zero_copy=zero_copy, tp_rank=tp_rank, tp_size=tp_size, layout=layout, mla=mla,
                             **extra)
        self.backend = StorageBackendFactory.create_backend("dynamic", cfg, self.pool)
        assert isinstance(self.backend, kv_sglang.KvtierHiCacheStorage)
        self.backend.register_mem_pool_host(self.pool)
        self.backend.on_host_pools_registered()
        self.ctl = SimpleNamespace(storage_backend=self.backend, storage_host_pool=self.pool,
                                   mem_pool_host=self.pool, page_size=PAGE)
        if zero_copy:
            self._set, self._get = HiCacheController._page_set_zero_copy, HiCacheController._page_get_zero_copy
        else:
            self._set, self._get = HiCacheController._generic_page_set, HiCacheController._generic_page_get

    def set(self, keys, first_page):
        """The backup thread's page set: True when every page was stored."""
        return self._set(self.ctl, keys, host_indices(first_page, len(keys)))

    def get(self, keys, first_page):
        """The prefetch thread's page get: the number of leading pages loaded into the pool."""
        op = SimpleNamespace(request_id="req", is_terminated=lambda: False)
        return self._get(self.ctl, op, keys, host_indices(first_page, len(keys)))

    def exists(self, keys):
        return self.backend.batch_exists(keys)

    def page(self, i):
        """Page `i`'s bytes as SGLang's generic path sees them."""
        return page_bytes(self.pool, i)


def host_indices(first_page, n):
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def page_bytes(pool, i):
    return pool.get_data_page(i * PAGE).contiguous().view(torch.uint8).numpy().copy()


_native_hash = None  # whether SGLang's JIT page hash builds here (None: not tried yet)


def sglang_keys(n, seed):
    """SGLang's own page keys for `n` pages of random tokens (its SHA-256 chain)."""
    global _native_hash
    tokens = np.random.default_rng(seed).integers(0, 32000, n * PAGE).tolist()
    keys = None
    if _native_hash is not False:
        try:
            from sglang.srt.mem_cache.utils import get_hash_str

            keys = get_hash_str(tokens, None, page_size=PAGE)
            _native_hash = True
        except Exception:  # no compiler for SGLang's JIT hash (tried once): the same chain in Python
            _native_hash = False
    if keys is None:
        keys, prev = [], b""
        for p in range(n):
            prev = hashlib.sha256(prev + np.asarray(tokens[p * PAGE:(p + 1) * PAGE], "<u4").tobytes()).digest()
            keys.append(prev.hex())
    assert len(keys) == n and all(len(k) == 64 for k in keys)
    return list(keys)


def test_sglang_keys_are_the_sha256_page_chain():
    """The keys the tests use are SGLang's: d_i = sha256(d_{i-1} || page tokens as u32 LE)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = list(range(100, 100 + 3 * PAGE))
    try:
        keys = get_hash_str(tokens, None, page_size=PAGE)
    except Exception as e:  # pragma: no cover - needs g++, ninja and OpenSSL headers
        pytest.skip(f"SGLang's JIT page hash does not build here: {e}")
    prev = b""
    for p in range(3):
        prev = hashlib.sha256(prev + np.asarray(tokens[p * PAGE:(p + 1) * PAGE], "<u4").tobytes()).digest()
        assert keys[p] == prev.hex()


_seed = iter(range(1000, 100000))


def fresh_keys(n):
    return sglang_keys(n, next(_seed))


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_bit_exact(server, layout, path):
    writer = Engine(server.addr, layout, path, pool=make_pool(layout, seed=1))
    keys = fresh_keys(4)
    assert writer.set(keys, first_page=0) is True
    assert writer.exists(keys + fresh_keys(1)) == 4
    assert writer.exists(fresh_keys(1) + keys) == 0  # leading hits only

    # Another instance (a zeroed pool) loads the pages into other host pages.
    reader = Engine(server.addr, layout, path)
    assert reader.exists(keys) == 4
    assert reader.get(keys, first_page=3) == 4
    for i in range(4):
        np.testing.assert_array_equal(reader.page(3 + i), writer.page(i))
    assert not reader.page(2).any() and not reader.page(7).any(), "pages outside the load are untouched"

    # Storing again sends nothing new and still succeeds.
    assert writer.set(keys, first_page=0) is True


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_shared_memory_host_pool_moves_pages_over_the_same_node_socket(server, layout):
    """With `"allocator": "shm"` SGLang's host pool is shared memory: the backend registers it and
    the zero-copy functions move every page's segments over the server's same-node socket (one
    copy by the server, no payload on a socket), bit-exact; a pool in ordinary memory goes over TCP."""
    writer = Engine(server.addr, layout, "zero_copy", pool=make_pool(layout, seed=11, allocator="shm"),
                    allocator="shm")
    assert writer.backend._regions, "the shared host pool is registered"
    keys = fresh_keys(4)
    assert writer.set(keys, first_page=0) is True
    st = writer.backend.client.samenode_stats()
    assert st["stores"] >= 1 and not st["fallbacks"], st

    reader = Engine(server.addr, layout, "zero_copy", pool=make_pool(layout, fill=0, allocator="shm"),
                    allocator="shm")
    assert reader.get(keys, first_page=3) == 4
    for i in range(4):
        np.testing.assert_array_equal(reader.page(3 + i), writer.page(i))
    assert not reader.page(2).any() and not reader.page(7).any(), "pages outside the load are untouched"
    st = reader.backend.client.samenode_stats()
    assert st["loads"] >= 1 and not st["fallbacks"], st

    # The same pages into a pool in ordinary memory: over TCP, the same bytes.
    plain = Engine(server.addr, layout, "zero_copy")
    assert not plain.backend._regions
    assert plain.get(keys, first_page=1) == 4
    for i in range(4):
        np.testing.assert_array_equal(plain.page(1 + i), writer.page(i))
    assert plain.backend.client.samenode_stats()["loads"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_a_missing_middle_page_stops_the_get(server, path):
    writer = Engine(server.addr, "page_first", path, pool=make_pool("page_first", seed=2))
    keys = fresh_keys(4)
    assert writer.set([keys[0], keys[1]], first_page=0)
    assert writer.set([keys[3]], first_page=3)
    assert writer.exists(keys) == 2
    reader = Engine(server.addr, "page_first", path)
    assert reader.get(keys, first_page=4) == 2
    for i in range(2):
        np.testing.assert_array_equal(reader.page(4 + i), writer.page(i))


@pytest.mark.parametrize("path", PATHS)
def test_a_page_of_another_size_is_a_miss_and_leaves_the_pool_untouched(server, path):
    keys = fresh_keys(4)
    # Another deployment (head_dim 32: pages half the size) stores under the same SGLang keys.
    other = Engine(server.addr, "page_first", path, pool=make_pool("page_first", head_dim=32, seed=3))
    assert other.set(keys, first_page=0)
    assert other.exists(keys) == 4
    reader = Engine(server.addr, "page_first", path, pool=make_pool("page_first", fill=7.0))
    before = reader.pool.kv_buffer.clone()
    assert reader.exists(keys) == 0
    assert reader.get(keys, first_page=0) == 0
    assert torch.equal(reader.pool.kv_buffer, before)

    # The generic functions given a tensor of the wrong size: a miss / a failed set, no exception.
    b = reader.backend
    small = torch.zeros(b.ns_flat.block_bytes // 2 // 2, dtype=torch.bfloat16)
    assert b.batch_set(fresh_keys(1), [small]) is False
    target = torch.full((b.ns_flat.block_bytes // 2 + 8,), 3.0, dtype=torch.bfloat16)
    assert b.batch_get(keys[:1], [target]) == [None]
    assert (target == 3.0).all()
    assert b.get(keys[0], target) is None


def test_tp_ranks_do_not_see_each_others_pages(server):
    keys = fresh_keys(3)
    rank0 = Engine(server.addr, "page_first", "zero_copy", tp_rank=0, tp_size=2, pool=make_pool("page_first", seed=4))
    rank1 = Engine(server.addr, "page_first", "zero_copy", tp_rank=1, tp_size=2, pool=make_pool("page_first", seed=5))
    assert rank0.set(keys[:2], first_page=0)
    assert rank0.exists(keys) == 2
    assert rank1.exists(keys) == 0
    assert rank1.set(keys, first_page=0)
    assert rank1.exists(keys) == 3 and rank0.exists(keys) == 2
    # Each rank reads back its own shard.
    for rank, n in ((rank0, 2), (rank1, 3)):
        fresh = Engine(server.addr, "page_first", "zero_copy", tp_rank=rank.backend.storage_config.tp_rank, tp_size=2)
        assert fresh.get(keys, first_page=4) == n
        for i in range(n):
            np.testing.assert_array_equal(fresh.page(4 + i), rank.page(i))
    # A single-GPU deployment (TP 1) is another namespace again.
    assert Engine(server.addr, "page_first", "zero_copy").exists(keys) == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_pages_are_shared_by_every_rank_and_written_once(server, layout, path):
    keys = fresh_keys(3)
    rank0 = Engine(server.addr, layout, path, tp_rank=0, tp_size=2, mla=True, pool=make_mla_pool(layout, seed=9))
    rank1 = Engine(server.addr, layout, path, tp_rank=1, tp_size=2, mla=True, pool=make_mla_pool(layout, seed=10))
    assert rank0.backend.is_writer and not rank1.backend.is_writer
    # SGLang skips backups on non-writers; one asked anyway succeeds without storing anything.
    assert rank1.set(keys, first_page=0) is True
    assert rank1.exists(keys) == 0
    assert rank0.set(keys, first_page=0) is True
    assert rank1.exists(keys) == 3
    reader = Engine(server.addr, layout, path, tp_rank=1, tp_size=2, mla=True)
    assert reader.get(keys, first_page=4) == 3
    for i in range(3):
        np.testing.assert_array_equal(reader.page(4 + i), rank0.page(i))


def test_layouts_with_the_same_page_bytes_share_pages(server):
    """layer_first's flat page and page_first_direct's pages are both [k|v][layer][tok][head][dim];
    page_first's two paths give the same bytes; layer_first's two paths do not."""
    keys = fresh_keys(2)
    w = Engine(server.addr, "layer_first", "generic", pool=make_pool("layer_first", seed=6))
    assert w.set(keys, first_page=0)
    r = Engine(server.addr, "page_first_direct", "zero_copy")
    assert r.get(keys, first_page=1) == 2
    for i in range(2):
        np.testing.assert_array_equal(r.page(1 + i), w.page(i))
    assert Engine(server.addr, "layer_first", "zero_copy").exists(keys) == 0
    assert Engine(server.addr, "page_first", "generic").exists(keys) == 0

    keys = fresh_keys(2)
    w = Engine(server.addr, "page_first", "zero_copy", pool=make_pool("page_first", seed=7))
    assert w.set(keys, first_page=0)
    r = Engine(server.addr, "page_first", "generic")
    assert r.get(keys, first_page=2) == 2
    for i in range(2):
        np.testing.assert_array_equal(r.page(2 + i), w.page(i))


@pytest.mark.parametrize("path", PATHS)
def test_a_killed_server_gives_misses_and_never_raises(path):
    srv = LocalServer(dram_capacity="64MiB")
    try:
        e = Engine(srv.addr, "page_first", path, pool=make_pool("page_first", seed=8))
        keys = fresh_keys(4)
        assert e.set(keys, first_page=0) and e.exists(keys) == 4
        srv.proc.kill()  # SIGKILL: no goodbye to the client
        srv.proc.wait()

        t0 = time.monotonic()
        assert e.exists(keys) == 0
        assert e.backend.exists(keys[0]) is False
        assert e.get(keys, first_page=4) == 0
        assert e.backend.batch_get_v1(keys, host_indices(4, 4)) == [False] * 4
        assert e.backend.batch_get(keys) == [None] * 4
        assert e.backend.get(keys[0]) is None
        assert e.set(fresh_keys(2), first_page=0) is False
        assert e.backend.batch_set_v1(keys, host_indices(0, 4)) == [False] * 4
        assert e.backend.set(keys[0], e.pool.get_data_page(0)) is False
        assert time.monotonic() - t0 < 10 * DEADLINE
        assert e.backend.client.misses, "the failures are recorded"
        assert e.backend.stats["errors"] > 0
    finally:
        srv.stop()


def test_unreachable_server_and_hybrid_pools_answer_misses():
    """A server that never existed, and the v2 (hybrid-model side pool) calls: the same answers on
    every rank, no exception."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = "127.0.0.1:%d" % s.getsockname()[1]
    e = Engine(addr, "page_first", "zero_copy")
    keys = fresh_keys(2)
    assert e.exists(keys) == 0
    assert e.get(keys, first_page=0) == 0
    assert e.set(keys, first_page=0) is False
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    t = PoolTransfer(name=PoolName.MAMBA, host_indices=host_indices(0, 2), keys=keys)
    res = e.backend.batch_exists_v2(keys, [t])
    assert res.kv_hit_pages == 0
    assert e.backend.batch_get_v2([t]) == {PoolName.MAMBA: [False, False]}
    assert e.backend.batch_set_v2([t]) == {PoolName.MAMBA: [False, False]}


def test_missing_server_address_is_refused_at_attach():
    cfg = storage_config("", zero_copy=True)
    cfg.extra_config.pop("server")
    with pytest.raises(ValueError, match="server"):
        StorageBackendFactory.create_backend("dynamic", cfg, None)
