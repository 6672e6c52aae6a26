"""The same-node path from Python, against real `kvtier serve` processes: `Client.alloc_buffer`
hands out shared memory that NumPy and torch view in place; loads into it and stores from it go
through the server's Unix socket (the client's `samenode_stats` and the server's own request
counters say so), and KV anywhere else goes over TCP as before. Every round trip compares bytes."""

import argparse
import gc
import os
import threading
import urllib.request

import numpy as np
import pytest

import kvtier
from kvtier.server import LocalServer


def ns(tenant, codec="raw"):
    return kvtier.Namespace(tenant, "m@1", layers=2, kv_heads=2, head_dim=64, dtype="fp32", block_tokens=16, codec=codec)


def kv_for(n_blocks, seed):
    n = ns("x").block_bytes // 4 * n_blocks
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def served(server, op):
    """Requests of `op` the server answered (its Prometheus counter)."""
    url = server.metrics_addr
    url = url if url.startswith("http") else f"http://{url}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("kvtier_requests_total{") and f'op="{op}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_alloc_buffer_is_writable_shared_memory_viewed_in_place(server):
    import torch

    c = kvtier.Client(server.addr)
    buf = c.alloc_buffer(1 << 20)
    assert isinstance(buf, kvtier.SharedBuffer) and len(buf) == buf.nbytes == 1 << 20
    mv = memoryview(buf)
    assert not mv.readonly and mv.nbytes == 1 << 20 and mv.format == "B"
    a = np.frombuffer(buf, dtype=np.float32)
    a[10] = 3.5
    t = torch.frombuffer(buf, dtype=torch.float32)
    assert t.data_ptr() == buf.address == a.ctypes.data, "every view is the same memory, no copy"
    assert t[10].item() == 3.5
    t[11] = -1.0
    assert a[11] == -1.0 and bytes(mv[44:48]) == np.float32(-1.0).tobytes()
    # The views keep the memory alive after the buffer object is gone.
    del buf, mv
    gc.collect()
    a[12] = 7.0
    assert t[12].item() == 7.0
    with pytest.raises(ValueError):
        c.alloc_buffer(0)


@pytest.mark.parametrize("poll_us", [2500, 0], ids=["polled", "parked"])
def test_loads_into_and_stores_from_a_shared_buffer_go_over_the_socket(server, poll_us):
    import torch

    # Polled for (the default) or parked on: answers are read alike.
    c = kvtier.Client(server.addr, never_raise=False, samenode_poll_us=poll_us)
    n = ns("samenode-py")
    bb = n.block_bytes
    toks = list(range(5000, 5064))  # 4 full blocks
    kv = kv_for(4, 1)
    loads0, stores0 = served(server, "samenode_load"), served(server, "samenode_store")

    src = c.alloc_buffer(4 * bb)
    a = np.frombuffer(src, dtype=np.float32)
    a[:] = kv
    assert c.store(n, toks, a) == 4
    st = c.samenode_stats()
    assert (st["stores"], st["fallbacks"]) == (1, {}), st
    assert st["active"]

    # Loaded into a second buffer, one block in from its start.
    dst = c.alloc_buffer(5 * bb)
    out = np.frombuffer(dst, dtype=np.float32)[bb // 4 : 5 * bb // 4]
    assert c.load_into(n, toks, out) == 64
    assert bytes(memoryview(dst)[bb : 5 * bb]) == kv.tobytes()
    assert bytes(memoryview(dst)[:bb]) == bytes(bb), "nothing landed before the destination"
    assert c.samenode_stats()["loads"] == 1

    # Keyed: stored from a slice of the buffer, loaded into torch views of another, in reverse.
    keys = [b"key-%d" % i for i in range(4)]
    assert c.store_keys(n, keys, a[: 4 * bb // 4]) == [True] * 4
    t = torch.frombuffer(c.alloc_buffer(4 * bb), dtype=torch.float32)
    per = bb // 4
    views = [t[(3 - i) * per : (4 - i) * per] for i in range(4)]
    assert c.load_keys_into(n, keys, views) == [True] * 4
    for i in range(4):
        assert views[i].numpy().tobytes() == kv[i * per : (i + 1) * per].tobytes()
    # A key never stored is a miss; the others land.
    assert c.load_keys_into(n, [keys[0], b"absent"], views[:2]) == [True, False]

    st = c.samenode_stats()
    assert (st["loads"], st["stores"], st["fallbacks"]) == (3, 2, {}), st
    assert served(server, "samenode_load") - loads0 == 3
    assert served(server, "samenode_store") - stores0 == 2
    # The data plane sees the same blocks.
    back = np.frombuffer(c.load(n, toks), dtype=np.float32)
    np.testing.assert_array_equal(back, kv)


def test_kv_outside_a_shared_buffer_goes_over_tcp(server):
    c = kvtier.Client(server.addr, never_raise=False)
    n = ns("samenode-tcp")
    bb = n.block_bytes
    loads0 = served(server, "samenode_load") + served(server, "samenode_store")
    toks = list(range(6000, 6032))
    kv = kv_for(2, 2)
    assert c.store(n, toks, kv) == 2
    out = np.zeros_like(kv)
    assert c.load_into(n, toks, out) == 32
    np.testing.assert_array_equal(out, kv)
    # Destinations only partly in a shared buffer: the whole call goes the usual way.
    shared = np.frombuffer(c.alloc_buffer(bb), dtype=np.float32)
    plain = np.zeros(bb // 4, dtype=np.float32)
    keys = [b"t0", b"t1"]
    assert c.store_keys(n, keys, kv) == [True, True]
    assert c.load_keys_into(n, keys, [shared, plain]) == [True, True]
    assert shared.tobytes() == kv[: bb // 4].tobytes() and plain.tobytes() == kv[bb // 4 :].tobytes()
    st = c.samenode_stats()
    assert (st["loads"], st["stores"], st["fallbacks"]) == (0, 0, {}), st
    assert served(server, "samenode_load") + served(server, "samenode_store") == loads0


def test_when_the_socket_cannot_be_used_shared_buffers_go_over_tcp_counted(tmp_path):
    n = ns("samenode-fallback")
    toks = list(range(7000, 7032))
    kv = kv_for(2, 3)

    def round_trip(client):
        src = client.alloc_buffer(kv.nbytes)
        np.frombuffer(src, dtype=np.float32)[:] = kv
        assert client.store(n, toks, np.frombuffer(src, dtype=np.float32)) == 2
        dst = client.alloc_buffer(kv.nbytes)
        assert client.load_into(n, toks, np.frombuffer(dst, dtype=np.float32)) == 32
        assert bytes(memoryview(dst)) == kv.tobytes()
        return client.samenode_stats()

    # The socket file removed (as in a container that lacks it).
    with LocalServer() as srv:
        os.remove(os.path.join(srv.data_dir, "kvtier.sock"))
        st = round_trip(kvtier.Client(srv.addr, never_raise=False))
        assert st["fallbacks"] == {"socket_missing": 2}, st
        assert st["last_fallback"][0] == "socket_missing" and "kvtier.sock" in st["last_fallback"][1]
        assert (st["loads"], st["stores"], st["active"]) == (0, 0, False)
        # Turned off: nothing is counted.
        st = round_trip(kvtier.Client(srv.addr, never_raise=False, samenode="off"))
        assert (st["loads"], st["stores"], st["fallbacks"]) == (0, 0, {}), st

    # A server that advertises no socket.
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text('samenode_socket = "off"\n')
    with LocalServer(extra_args=["--config", str(cfg)]) as srv:
        st = round_trip(kvtier.Client(srv.addr, never_raise=False))
        assert st["fallbacks"] == {"not_advertised": 2}, st
    with pytest.raises(ValueError):
        kvtier.Client("127.0.0.1:1", samenode="sometimes")


def test_threads_load_into_one_buffer_and_it_outlives_its_client(server):
    c = kvtier.Client(server.addr, never_raise=False)
    n = ns("samenode-threads")
    bb = n.block_bytes
    docs = [list(range(10_000 + 100 * i, 10_000 + 100 * i + 32)) for i in range(4)]
    kvs = [kv_for(2, 10 + i) for i in range(4)]
    for toks, kv in zip(docs, kvs):
        assert c.store(n, toks, kv) == 2
    buf = c.alloc_buffer(8 * bb)
    a = np.frombuffer(buf, dtype=np.float32)
    per = 2 * bb // 4
    got = [None] * 4

    def load(i):
        got[i] = c.load_into(n, docs[i], a[i * per : (i + 1) * per])

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert got == [32] * 4
    for i in range(4):
        assert a[i * per : (i + 1) * per].tobytes() == kvs[i].tobytes()
    assert c.samenode_stats()["loads"] == 4

    # The client goes away; the buffer stays valid and serves a new client.
    del c
    gc.collect()
    a[:] = 0
    c2 = kvtier.Client(server.addr, never_raise=False)
    assert c2.load_into(n, docs[0], a[:per]) == 32
    assert a[:per].tobytes() == kvs[0].tobytes()
    assert c2.samenode_stats()["loads"] == 1


def test_a_store_from_one_buffer_goes_ahead_while_a_load_fills_other_places_of_it(server):
    """An engine's prefetch (a long load into some pages of its pool) and backup (a store from
    other pages of the same pool) on two threads: the store returns while the load is still
    landing, instead of waiting for the whole load. Bytes land and are stored exactly."""
    c = kvtier.Client(server.addr, never_raise=False)
    n = kvtier.Namespace("samenode-overlap", "m@1", layers=8, kv_heads=8, head_dim=128, dtype="fp32", block_tokens=16)
    bb = n.block_bytes
    assert bb == 1 << 20
    blocks = 128
    keys = [b"prefetch-%d" % i for i in range(blocks)]
    kv = np.random.default_rng(7).integers(1, 255, size=blocks * bb, dtype=np.uint8)
    assert c.store_keys(n, keys, [kv[i * bb : (i + 1) * bb] for i in range(blocks)]) == [True] * blocks

    buf = c.alloc_buffer((blocks + 1) * bb)
    a = np.frombuffer(buf, dtype=np.uint8)
    backup = np.random.default_rng(8).integers(1, 255, size=bb, dtype=np.uint8)
    a[blocks * bb :] = backup  # the page the backup stores, after the prefetch's pages
    got = []
    load = threading.Thread(target=lambda: got.append(c.load_keys_into(n, keys, [a[i * bb : (i + 1) * bb] for i in range(blocks)])))
    load.start()
    while a[bb - 1] == 0:  # the prefetch's first page has landed: it is under way
        pass
    assert c.store_keys(n, [b"backup"], [a[blocks * bb :]]) == [True]
    last_landed = a[blocks * bb - 1] != 0
    load.join()
    assert not last_landed, "the store waited for the whole load"
    assert got == [[True] * blocks]
    assert a[: blocks * bb].tobytes() == kv.tobytes()
    back = np.zeros(bb, dtype=np.uint8)
    assert c.load_keys_into(n, [b"backup"], [back]) == [True]
    assert back.tobytes() == backup.tobytes()
    assert c.samenode_stats()["fallbacks"] == {}


@pytest.fixture
def shm_file():
    """A file under /dev/shm, as vLLM's CPU tier makes its region; removed afterwards."""
    path = f"/dev/shm/kvtier_pytest_{os.getpid()}_{threading.get_ident()}.mmap"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def test_a_dev_shm_file_registered_loads_and_stores_byte_exact_at_offsets(server, shm_file):
    import mmap

    c = kvtier.Client(server.addr, never_raise=False)
    n = ns("samenode-file")
    bb = n.block_bytes
    size = 10 * bb + 4096
    with open(shm_file, "wb") as f:
        f.truncate(size)
    # The engine's own mapping of its file, as vLLM's SharedOffloadRegion makes it.
    fd = os.open(shm_file, os.O_RDWR)
    engine = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    rows = np.frombuffer(engine, dtype=np.uint8)[4096:].reshape(10, bb)
    region = c.register_region(rows)
    assert region.alias == rows.ctypes.data and region.file_offset == 4096 and region.nbytes == 10 * bb

    keys = [bytes([i]) * 32 for i in range(4)]
    kv = np.random.default_rng(3).integers(0, 255, (4, bb), dtype=np.uint8)
    rows[[7, 2, 5, 0]] = kv
    loads0, stores0 = served(server, "samenode_load"), served(server, "samenode_store")
    assert c.store_keys(n, keys, [rows[7], rows[2], rows[5], rows[0]]) == [True] * 4
    assert served(server, "samenode_store") == stores0 + 1, "stored through the socket, from the file"

    # Loaded into other rows of the engine's own mapping: one copy, by the server, into the file.
    rows[[1, 3, 6, 9]] = 0
    assert c.load_keys_into(n, keys, [rows[1], rows[3], rows[6], rows[9]]) == [True] * 4
    assert served(server, "samenode_load") == loads0 + 1
    assert np.array_equal(rows[[1, 3, 6, 9]], kv)
    with open(shm_file, "rb") as f:  # and through the file itself
        f.seek(4096 + 6 * bb)
        assert f.read(bb) == kv[2].tobytes()
    st = c.samenode_stats()
    assert (st["loads"], st["stores"], st["fallbacks"]) == (1, 1, {}), st

    # register_file: the same file by path, at an offset, through the client's own mapping.
    other = c.register_file(shm_file, offset=4096 + 8 * bb, length=2 * bb)
    dst = np.frombuffer(other, dtype=np.uint8).reshape(2, bb)
    assert c.load_keys_into(n, keys[:2], dst) == [True] * 2
    assert np.array_equal(rows[8:10], kv[:2]), "the engine's mapping sees what landed"
    assert os.path.getsize(shm_file) == size
    with pytest.raises(ValueError):
        c.register_region(np.zeros(4096, np.uint8))  # private memory
    # By descriptor (duplicated: closing ours later is fine), the same pages again.
    by_fd = c.register_file(fd, offset=4096 + 9 * bb, length=bb)
    assert np.array_equal(np.frombuffer(by_fd, dtype=np.uint8), kv[1])
    del dst, other, by_fd
    os.close(fd)


def test_a_registered_file_truncated_is_an_error_and_the_server_goes_on(server, shm_file):
    c = kvtier.Client(server.addr, never_raise=False)
    n = ns("samenode-trunc")
    bb = n.block_bytes
    with open(shm_file, "wb") as f:
        f.truncate(4 * bb)
    region = c.register_file(shm_file)
    rows = np.frombuffer(region, dtype=np.uint8).reshape(4, bb)
    rows[0] = 7
    keys = [b"k" * 32]
    assert c.store_keys(n, keys, [rows[0]]) == [True]
    os.truncate(shm_file, bb // 2)  # the engine (or anyone) shrinks the file under the registration
    with pytest.raises(kvtier.KvtierError, match="truncated"):
        c.load_keys_into(n, keys, [rows[2]])
    with pytest.raises(kvtier.KvtierError, match="truncated"):
        c.store_keys(n, [b"j" * 32], [rows[1]])
    assert os.path.getsize(shm_file) == bb // 2, "nobody grew the file back"
    # A never_raise client answers a miss instead.
    quiet = kvtier.Client(server.addr)
    assert quiet.load_keys_into(n, keys, [rows[3]]) == [False]
    # The server serves others as before.
    other = kvtier.Client(server.addr, never_raise=False)
    buf = other.alloc_buffer(bb)
    assert other.load_keys_into(n, keys, buf) == [True]
    assert bytes(memoryview(buf)) == bytes([7]) * bb
    assert other.samenode_stats()["loads"] == 1


def test_the_wire_bench_driver_measures_the_same_node_path_only_when_it_is_taken(server, tmp_path):
    """`kvtier.wire_bench` (the Python side of `kvtier-bench blocks`): every path of a small cell
    moves the stored bytes, and `python-samenode` is reported only when every one of its calls
    went over the same-node socket; otherwise it is left out with the reason."""
    from kvtier import wire_bench

    def cell(srv, run, pid):
        args = argparse.Namespace(server=srv.addr, size=64 << 10, concurrency=2, ops=4, run=run, server_pid=pid)
        return wire_bench.bench_kvtier(args)

    out = cell(server, 0, server.proc.pid)
    assert set(out["paths"]) == {"python", "python-keys", "python-samenode"}, out["skipped"]
    assert out["skipped"] == {} and out["bytes"] == (64 << 10) * 2 * 4
    near = out["paths"]["python-samenode"]
    assert len(near["load_lat"]) == len(near["store_lat"]) == 8 and near["load_s"] > 0
    # Each phase's CPU: the server's (it copied the blocks) and the driver's own.
    for path in out["paths"].values():
        for phase in ("store_cpu", "load_cpu"):
            srv_s, drv_s = path[phase]
            assert srv_s is not None and srv_s > 0 and drv_s > 0, (phase, path[phase])

    cfg = tmp_path / "kvtier.toml"
    cfg.write_text('samenode_socket = "off"\n')
    with LocalServer(extra_args=["--config", str(cfg)]) as srv:
        out = cell(srv, 1, None)
    assert set(out["paths"]) == {"python", "python-keys"}
    # Without the server's pid only the driver's CPU is known.
    assert all(p["load_cpu"][0] is None and p["load_cpu"][1] > 0 for p in out["paths"].values())
    why = out["skipped"]["python-samenode"]
    assert "0 of 8 loads" in why and "not_advertised" in why, why
