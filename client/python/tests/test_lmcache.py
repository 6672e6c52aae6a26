"""kvtier.lmcache.KvtierConnectorAdapter inside LMCache 0.5.6's real remote-storage path, against
real `kvtier serve` processes: LMCache's `RemoteBackend` creates the connector through its plugin
path (`remote_storage_plugins: ["kvtier"]`), over a real `LocalCPUBackend`, with LMCache's naive
serde and its `InstrumentedRemoteConnector` wrapper, and an asyncio loop on a thread as in the
engine."""

import asyncio
import inspect
import os
import threading
import time

import pytest

if os.environ.get("KVTIER_REQUIRE_ENGINES"):  # CI: a broken LMCache install fails instead of skipping
    import lmcache.v1.storage_backend.remote_backend  # noqa: F401

pytest.importorskip("lmcache.v1.storage_backend.remote_backend",
                    reason="LMCache is not installed (requirements-engines.txt installs it)")
torch = pytest.importorskip("torch")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import ConnectorContext  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

import kvtier.lmcache as kv_lmcache  # noqa: E402
from servers import HungServer, KvServer  # noqa: E402

CHUNK = 16
LAYERS = 2
HEADS = 2
DIM = 64
MODEL = "tiny-llama"
BLOCKING_TIMEOUT = 3  # LMCache's blocking_timeout_secs in these tests
TIMEOUT = 2.0  # the connector's timeout_s (below BLOCKING_TIMEOUT)


# ------------------------------------------------------------------------------------------- loop


@pytest.fixture(scope="module")
def loop():
    """LMCache's event loop, run on a thread as the engine does."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(5)


# ------------------------------------------------------------------------------- LMCache parts


def engine_config(addr, *, url=None, plugin="kvtier", **extra):
    url = url or f"kvtier://{addr}?tenant=acme&timeout_s={TIMEOUT}&lookup_timeout_s=1"
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05, remote_serde="naive",
        remote_storage_plugins=[plugin], blocking_timeout_secs=BLOCKING_TIMEOUT,
        extra_config={f"remote_storage_plugin.{plugin}.module_path": "kvtier.lmcache",
                      f"remote_storage_plugin.{plugin}.class_name": "KvtierConnectorAdapter",
                      f"remote_storage_plugin.{plugin}.url": url, **extra})


def engine_metadata(*, worker_id=0, world_size=1, head_dim=DIM):
    return LMCacheMetadata(model_name=MODEL, world_size=world_size, local_world_size=world_size,
                           worker_id=worker_id, local_worker_id=worker_id, kv_dtype=torch.bfloat16,
                           kv_shape=(LAYERS, 2, CHUNK, HEADS, head_dim), chunk_size=CHUNK)


class Lmc:
    """LMCache's storage side for one worker: a local CPU backend and the remote backend with the
    kvtier plugin, as LMCache's storage manager builds them."""

    def __init__(self, addr, loop, *, plugin="kvtier", md=None, cfg=None, **extra):
        self.cfg = cfg or engine_config(addr, plugin=plugin, **extra)
        self.md = md or engine_metadata()
        self.local = LocalCPUBackend(self.cfg, self.md, dst_device="cpu")
        self.remote = RemoteBackend(self.cfg, self.md, loop, self.local, dst_device="cpu", plugin_name=plugin)
        self.loop = loop

    @property
    def connector(self):
        return self.remote.connection.getWrappedConnector()

    def chunk(self, seed, tokens=CHUNK):
        """A chunk from LMCache's allocator, filled with random bf16 values (KV_2LTD)."""
        shape = self.md.get_shapes(tokens)[0]
        obj = self.local.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        g = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(shape, generator=g).to(torch.bfloat16))
        return obj

    def put(self, key, obj):
        self.remote.submit_put_task(key, obj).result(timeout=BLOCKING_TIMEOUT + 5)

    def run(self, coro, timeout=BLOCKING_TIMEOUT + 5):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.remote.close()


_hash = iter(range(1, 10**9))


def key(*, worker_id=0, world_size=1):
    return CacheEngineKey(MODEL, world_size, worker_id, next(_hash) * 0x9E3779B97F4A7C15 % (1 << 63),
                          torch.bfloat16)


def allocated_bytes(local):
    """What LMCache's CPU allocator has handed out and not got back: (bytes, allocations)."""
    alloc = getattr(local.memory_allocator, "pin_allocator", local.memory_allocator)
    return alloc.total_allocated_size, alloc.num_active_allocations


# ------------------------------------------------------------------------------------------ tests


def test_the_plugin_path_creates_the_connector(server, loop):
    a = kv_lmcache.KvtierConnectorAdapter()
    assert a.can_parse(f"kvtier://{server.addr}") and a.can_parse("plugin://kvtier")
    assert a.can_parse("plugin://kvtier.second") and not a.can_parse("plugin://kvblockd")
    assert not a.can_parse("redis://x:1")

    lmc = Lmc(server.addr, loop)
    assert isinstance(lmc.connector, kv_lmcache.KvtierRemoteConnector)
    assert lmc.connector.addr == server.addr and lmc.connector.tenant == "acme"
    assert lmc.connector.timeout_s == TIMEOUT
    lmc.close()

    # A named second instance, with its own url key.
    lmc = Lmc(server.addr, loop, plugin="kvtier.second")
    assert isinstance(lmc.connector, kv_lmcache.KvtierRemoteConnector)
    lmc.close()

    # The deprecated remote_url: kvtier://host:port.
    cfg = engine_config(server.addr)
    cfg.remote_url = f"kvtier://{server.addr}"
    md = engine_metadata()
    local = LocalCPUBackend(cfg, md, dst_device="cpu")
    rb = RemoteBackend(cfg, md, loop, local, dst_device="cpu")
    assert isinstance(rb.connection.getWrappedConnector(), kv_lmcache.KvtierRemoteConnector)
    rb.close()

    # No url for the plugin: LMCache swallows the creation error and runs without the backend.
    cfg = engine_config(server.addr)
    del cfg.extra_config["remote_storage_plugin.kvtier.url"]
    rb = RemoteBackend(cfg, md, loop, local, dst_device="cpu", plugin_name="kvtier")
    assert rb.connection is None
    with pytest.raises(ValueError, match="url"):
        a.create_connector(ConnectorContext("plugin://kvtier", loop, local, cfg, md, "kvtier"))
    # An option that isn't a number says which (it was Python's bare conversion error).
    cfg = engine_config(server.addr)
    cfg.extra_config["remote_storage_plugin.kvtier.url"] = f"kvtier://{server.addr}?timeout_s=soon"
    with pytest.raises(ValueError, match="option timeout_s='soon' is not a float"):
        a.create_connector(ConnectorContext("plugin://kvtier", loop, local, cfg, md, "kvtier"))


def test_put_contains_get_round_trip(server, loop):
    lmc = Lmc(server.addr, loop)
    obj = lmc.chunk(seed=1)
    before = obj.get_ref_count()
    k = key()
    assert not lmc.remote.contains(k)
    lmc.put(k, obj)
    assert obj.get_ref_count() == before, "put leaves the chunk's reference count as it was"
    assert lmc.remote.contains(k)
    assert not lmc.remote.contains(key())
    got = lmc.remote.get_blocking(k)
    assert got is not None and got.get_shape() == obj.get_shape() and got.get_dtype() == torch.bfloat16
    assert torch.equal(got.tensor.view(torch.int16), obj.tensor.view(torch.int16))
    got.ref_count_down()

    # Batched: put, contains (prefix), get.
    keys = [key() for _ in range(3)]
    objs = [lmc.chunk(seed=10 + i) for i in range(3)]
    refs = [o.get_ref_count() for o in objs]
    for o in objs[:2]:
        o.ref_count_up()  # as RemoteBackend does before a put; LMCache's wrapper releases it after
    lmc.run(lmc.remote.connection.batched_put(keys[:2], objs[:2]))
    assert [o.get_ref_count() for o in objs] == refs
    assert lmc.remote.batched_contains(keys) == 2
    assert lmc.run(lmc.remote.batched_async_contains("look-1", keys)) == 2
    got = lmc.remote.batched_get_blocking(keys[:2])
    for g, o in zip(got, objs):
        assert torch.equal(g.tensor.view(torch.int16), o.tensor.view(torch.int16))
        g.ref_count_down()
    got = lmc.run(lmc.remote.batched_get_non_blocking("look-1", keys))
    assert len(got) == 2
    for g in got:
        g.ref_count_down()

    # Another deployment's chunk shape (head_dim 32) under the same LMCache key: a miss.
    other = Lmc(server.addr, loop, md=engine_metadata(head_dim=32))
    assert not other.remote.contains(k)
    assert other.remote.get_blocking(k) is None
    other.close()
    lmc.close()


def test_partial_chunk_round_trip(server, loop):
    lmc = Lmc(server.addr, loop)
    for tokens in (5, 1, CHUNK - 1):
        obj = lmc.chunk(seed=tokens, tokens=tokens)
        k = key()
        lmc.put(k, obj)
        assert lmc.remote.contains(k)
        got = lmc.remote.get_blocking(k)
        assert got is not None
        assert tuple(got.get_shape()) == (2, LAYERS, tokens, HEADS * DIM)
        assert got.get_size() == obj.get_size()
        assert torch.equal(got.tensor.view(torch.int16), obj.tensor.view(torch.int16))
        got.ref_count_down()
        obj.ref_count_down()
    lmc.close()


def test_exists_sync_is_synchronous(server, loop):
    assert not inspect.iscoroutinefunction(kv_lmcache.KvtierRemoteConnector.exists_sync)
    lmc = Lmc(server.addr, loop, use_exists_sync=True)
    k = key()
    lmc.put(k, lmc.chunk(seed=3))
    assert lmc.connector.exists_sync(k) is True
    assert lmc.connector.exists_sync(key()) is False

    # With `use_exists_sync`, `contains` answers even while LMCache's event loop is busy.
    blocked = threading.Event()
    release = threading.Event()

    def block():
        blocked.set()
        release.wait(10)

    loop.call_soon_threadsafe(block)
    assert blocked.wait(5)
    try:
        t0 = time.monotonic()
        assert lmc.remote.contains(k) is True
        assert time.monotonic() - t0 < 2
    finally:
        release.set()
    lmc.close()


def test_reference_counts_balanced_over_1000_puts_and_gets(server, loop):
    lmc = Lmc(server.addr, loop)
    obj = lmc.chunk(seed=4)
    base_ref = obj.get_ref_count()
    base_bytes = allocated_bytes(lmc.local)
    t0 = time.monotonic()
    for i in range(1000):
        k = key()
        lmc.put(k, obj)
        got = lmc.remote.get_blocking(k)
        assert got is not None
        if i % 100 == 0:
            assert torch.equal(got.tensor.view(torch.int16), obj.tensor.view(torch.int16))
        got.ref_count_down()
    took = time.monotonic() - t0
    assert obj.get_ref_count() == base_ref
    assert allocated_bytes(lmc.local) == base_bytes, "every chunk a get allocated was released"
    # Misses allocate nothing that stays allocated either.
    for _ in range(50):
        assert lmc.remote.get_blocking(key()) is None
    assert lmc.run(lmc.remote.batched_get_non_blocking("x", [key() for _ in range(4)])) == []
    assert allocated_bytes(lmc.local) == base_bytes
    print(f"1000 put+get pairs of {obj.get_size()} bytes: {took:.2f} s")
    lmc.close()


def test_killed_server_gives_misses_within_the_deadline_then_hits_after_a_restart(tmp_path, loop):
    srv = KvServer(tmp_path / "data").start()
    try:
        lmc = Lmc(srv.addr, loop)
        obj = lmc.chunk(seed=5)
        ref = obj.get_ref_count()
        base_bytes = allocated_bytes(lmc.local)
        k = key()
        lmc.put(k, obj)
        assert lmc.remote.contains(k)

        srv.kill()
        t0 = time.monotonic()
        assert lmc.remote.contains(k) is False
        assert lmc.connector.exists_sync(k) is False
        assert lmc.remote.get_blocking(k) is None
        assert lmc.remote.batched_contains([k]) == 0
        assert lmc.run(lmc.remote.batched_async_contains("x", [k])) == 0
        assert lmc.run(lmc.remote.batched_get_non_blocking("x", [k])) == []
        lmc.put(key(), obj)  # fails quietly
        took = time.monotonic() - t0
        assert took < BLOCKING_TIMEOUT * 3, took
        assert obj.get_ref_count() == ref
        assert allocated_bytes(lmc.local) == base_bytes
        assert lmc.connector.stats["errors"] > 0

        # Restarted (DRAM only: what it held is gone): the same connector stores and hits again.
        srv.start()
        deadline = time.monotonic() + 15
        while True:
            lmc.put(k, obj)
            if lmc.remote.contains(k) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert lmc.remote.contains(k)
        got = lmc.remote.get_blocking(k)
        assert got is not None and torch.equal(got.tensor.view(torch.int16), obj.tensor.view(torch.int16))
        got.ref_count_down()
        assert obj.get_ref_count() == ref
        lmc.close()
    finally:
        srv.stop()


def test_hung_server_gives_misses_within_blocking_timeout(loop):
    hung = HungServer()
    try:
        lmc = Lmc(hung.addr, loop)
        obj = lmc.chunk(seed=6)
        ref = obj.get_ref_count()
        base_bytes = allocated_bytes(lmc.local)
        k = key()
        t0 = time.monotonic()
        assert lmc.remote.contains(k) is False
        assert time.monotonic() - t0 < BLOCKING_TIMEOUT
        t0 = time.monotonic()
        assert lmc.remote.get_blocking(k) is None
        assert time.monotonic() - t0 < BLOCKING_TIMEOUT
        t0 = time.monotonic()
        lmc.put(k, obj)
        assert time.monotonic() - t0 < BLOCKING_TIMEOUT
        assert obj.get_ref_count() == ref
        assert allocated_bytes(lmc.local) == base_bytes
        lmc.close()
    finally:
        hung.close()


def test_lookups_stay_within_their_timeout_while_puts_wait_on_a_frozen_server(tmp_path, loop):
    # A node frozen (SIGSTOP: a black-holed or partitioned peer looks the same) while the engine
    # keeps offloading: lookups ran on the puts' threads, queued behind puts of up to timeout_s
    # each, and took 5-14 s against a 1 s lookup_timeout_s (LMCache waits for `contains` with
    # no timeout of its own).
    import os
    import signal
    import threading

    srv = KvServer(tmp_path / "data").start()
    try:
        lmc = Lmc(srv.addr, loop)
        w = lmc.connector
        obj = lmc.chunk(seed=8)
        k = key()
        lmc.put(k, obj)
        assert lmc.remote.contains(k)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        stop = threading.Event()

        def offload():
            while not stop.is_set():
                lmc.remote.submit_put_task(key(), obj)
                time.sleep(0.1)

        t = threading.Thread(target=offload, daemon=True)
        t.start()
        try:
            time.sleep(1.0)  # puts queued on every I/O thread
            for name, call in (("contains", lambda: lmc.remote.contains(k)),
                               ("batched_contains", lambda: lmc.remote.batched_contains([k])),
                               ("batched_async_contains",
                                lambda: lmc.run(lmc.remote.batched_async_contains("x", [k])))):
                t0 = time.monotonic()
                assert not call(), name
                took = time.monotonic() - t0
                assert took < w.lookup_timeout_s + 1.0, (name, took)
        finally:
            stop.set()
            t.join()
            os.kill(srv.proc.pid, signal.SIGCONT)
        lmc.close()
    finally:
        srv.stop()


def test_workers_and_mla(server, loop):
    """TP workers keep their own chunks (the key and the namespace carry the worker); an MLA
    deployment's chunks are one namespace for every worker."""
    w0 = Lmc(server.addr, loop, md=engine_metadata(worker_id=0, world_size=2))
    w1 = Lmc(server.addr, loop, md=engine_metadata(worker_id=1, world_size=2))
    assert w0.connector.ns.id != w1.connector.ns.id
    k0 = key(worker_id=0, world_size=2)
    w0.put(k0, w0.chunk(seed=7))
    assert w0.remote.contains(k0) and not w1.remote.contains(k0)
    w0.close()
    w1.close()

    mds = []
    for w in (0, 1):
        md = engine_metadata(worker_id=w, world_size=2)
        md.use_mla = True
        md.kv_shape = (LAYERS, 1, CHUNK, 1, DIM)
        mds.append(md)
    m0 = Lmc(server.addr, loop, md=mds[0])
    m1 = Lmc(server.addr, loop, md=mds[1])
    assert m0.connector.ns.id == m1.connector.ns.id
    m0.close()
    m1.close()


def test_a_get_lmcache_stops_waiting_for_releases_its_chunk(server, loop):
    """LMCache cancels a get it stops waiting for (`get_blocking` past blocking_timeout_secs,
    `wait_for` in the non-blocking paths); the chunk the get allocated is released when it lands."""
    lmc = Lmc(server.addr, loop)
    k = key()
    src = lmc.chunk(seed=11)
    lmc.put(k, src)
    base_bytes = allocated_bytes(lmc.local)
    conn = lmc.connector
    real_client, real_local = conn.client, conn.local_cpu_backend
    allocated = []  # held here, so LMCache's garbage-collection safety net cannot hide a leak

    class Recording:
        def __getattr__(self, name):
            return getattr(real_local, name)

        def allocate(self, *a, **kw):
            obj = real_local.allocate(*a, **kw)
            allocated.append(obj)
            return obj

    class Slow:
        def __getattr__(self, name):
            return getattr(real_client, name)

        def load_keys_into_segments(self, *a, **kw):
            time.sleep(0.5)
            return real_client.load_keys_into_segments(*a, **kw)

    conn.client, conn.local_cpu_backend = Slow(), Recording()
    try:
        for coro in (conn.get(k), conn.batched_get([k]), conn.batched_get_non_blocking("x", [k])):
            n = len(allocated)
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
            deadline = time.monotonic() + 10
            while len(allocated) == n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(allocated) == n + 1, "the get allocated its chunk"
            fut.cancel()  # while the load is still on its way
            deadline = time.monotonic() + 5
            while allocated[-1].get_ref_count() != 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert allocated[-1].get_ref_count() == 0
            assert allocated_bytes(lmc.local) == base_bytes
    finally:
        conn.client, conn.local_cpu_backend = real_client, real_local
    got = lmc.remote.get_blocking(k)
    assert got is not None and torch.equal(got.tensor.view(torch.int16), src.tensor.view(torch.int16))
    got.ref_count_down()
    lmc.close()
