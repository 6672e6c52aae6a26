"""What a Python engine gets on the wire: blocks stored and loaded through `kvtier.Client`, and the
same blocks through LMCache's own remote client against its standalone server, one run of one
(block size, concurrency) cell per call. `kvtier-bench blocks` runs this file as a subprocess and
puts its figures beside the Rust paths, Redis and the loopback TCP limit of the same run.

    python -m kvtier.wire_bench kvtier --server 127.0.0.1:7070 --size 1048576 --concurrency 4 --ops 64
    python -m kvtier.wire_bench lmcache --port 65432 --size 1048576 --concurrency 4 --ops 64

`c` threads each run `ops` operations back to back, one block per operation (the GIL is released
inside every kvtier call). Paths, each stored then loaded:

- `python`: `Client.store(ns, tokens, kv)` then `Client.load_into(ns, tokens, out)` (lookup and
  load in one request, received into `out`), in a token namespace;
- `python-keys`: `Client.store_keys` then `Client.load_keys_into` with engine hashes, in a
  `Namespace.opaque` namespace (what the vLLM, SGLang and LMCache adapters call);
- `python-samenode`: the same calls with every block in memory from `Client.alloc_buffer` (a
  shared buffer: stores from it, loads into it), so they take the same-node path — the server
  copies each block straight between its DRAM tier and the caller's pages, no TCP — as an engine
  on the server's host does (the vLLM and SGLang adapters register their host memory). The
  client's `samenode_stats()` must count every one of them as a same-node call; otherwise (the
  server on another host, no same-node socket) the path is left out and `skipped` says why;
- `lmcache`: LMCache 0.5.6's `lm://` protocol (`ClientMetaMessage` / `ServerMetaMessage`, as its
  `LMCServerConnector` speaks it): a PUT of the chunk's bytes (unanswered: each thread's store
  phase ends with an EXIST round trip, so it counts until the server has taken every chunk),
  then a GET received with `recv_into` into the caller's buffer — one connection per thread.

Every load lands in the thread's buffer of `DEST_SLOTS` blocks, the i-th operation's into block
`i % DEST_SLOTS` (as the Rust paths of `kvtier-bench blocks` do): an engine's KV pages are far
larger than a core's cache, and a one-block buffer reused by every load would stay in cache and
flatter every path. The check after each load phase compares every slot with the stored bytes.

Prints one JSON object on stdout: per path, the wall time of the store and load phases, every
operation's latency (seconds), the CPU seconds each phase cost (`[server, driver]`: the server's
given `--server-pid`, else null; the driver's own, every thread), the kvtier namespace ids written
(the caller purges them), and `skipped`: paths left out, with the reason.
"""

import argparse
import json
import socket
import struct
import sys
import threading
import time

MIB = 1 << 20
# Blocks of each thread's destination buffer, filled in turn (kvtier-bench's `DEST_SLOTS`).
DEST_SLOTS = 8


def layout_for(size):
    """(kv_heads, block_tokens) of the 32-layer, head-dim-128 bf16 layout whose block is `size`
    bytes (kvtier-bench's `layout_for`)."""
    per_head_token = 2 * 32 * 128 * 2
    if size >= per_head_token * 8:
        return 8, size // (per_head_token * 8)
    return max(size // per_head_token, 1), 1


def payload(size, seed):
    import numpy as np

    return ((np.arange(size, dtype=np.uint64) * 131 + seed * 7) % 253).astype(np.uint8)


def process_cpu_s(pid):
    """CPU seconds process `pid` has used so far, all its threads (the kernel's per-process CPU
    clock, as `clock_getcpuclockid` makes it); None when it can't be read."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        return None


def cpu_mark(server_pid):
    return (process_cpu_s(server_pid) if server_pid else None, time.process_time())


def cpu_spent(mark, server_pid):
    """[server seconds or None, this process's seconds] since `mark`."""
    now = cpu_mark(server_pid)
    server = now[0] - mark[0] if now[0] is not None and mark[0] is not None else None
    return [server, now[1] - mark[1]]


def run_threads(c, body, server_pid=None):
    """Runs `body(task)` on `c` threads released together; (wall seconds, latencies, CPU seconds
    of the server `server_pid` (None without one) and of this process while they ran)."""
    start = threading.Barrier(c + 1)
    lats = [None] * c
    errors = []

    def worker(task):
        try:
            start.wait()
            lats[task] = body(task)
        except BaseException as e:  # reported below, after every thread has ended
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(c)]
    for t in threads:
        t.start()
    mark = cpu_mark(server_pid)
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu = cpu_spent(mark, server_pid)
    if errors:
        raise errors[0]
    return wall, [x for lat in lats for x in lat], cpu


def dest_slots(size):
    """One thread's destination: `DEST_SLOTS` blocks of `size` bytes, written before the clock
    starts (its pages faulted in), as a list of one-block views."""
    import numpy as np

    buf = np.ones(size * DEST_SLOTS, dtype=np.uint8)
    return [buf[i * size:(i + 1) * size] for i in range(DEST_SLOTS)]


def shared_slots(client, size, data):
    """`dest_slots` in one `Client.alloc_buffer` shared buffer, plus one more block holding `data`
    (the source of this thread's same-node stores): (slots, source)."""
    import numpy as np

    buf = np.frombuffer(client.alloc_buffer(size * (DEST_SLOTS + 1)), dtype=np.uint8)
    buf.fill(1)
    src = buf[DEST_SLOTS * size:]
    src[:] = np.frombuffer(data, dtype=np.uint8)
    return [buf[i * size:(i + 1) * size] for i in range(DEST_SLOTS)], src


def samenode_calls(client):
    """Same-node loads and stores so far, and the last reason a call went over TCP instead."""
    st = client.samenode_stats()
    return st["loads"], st["stores"], st["last_fallback"]


def check_slots(system, outs, data, n):
    """Every slot a load wrote holds the stored bytes (all payloads are `data`)."""
    import numpy as np

    for t, slots in enumerate(outs):
        for i, out in enumerate(slots[:n]):
            if not np.array_equal(out, data):
                raise RuntimeError(f"{system}: thread {t}'s slot {i} differs from the stored bytes")


def timed_ops(n, op):
    lat = []
    for i in range(n):
        t = time.perf_counter()
        op(i)
        lat.append(time.perf_counter() - t)
    return lat


def bench_kvtier(args):
    import numpy as np

    import kvtier

    size, c, n = args.size, args.concurrency, args.ops
    heads, bt = layout_for(size)
    client = kvtier.Client(args.server, never_raise=False, connections=c, timeout_s=300.0)
    tag = f"{size}-{c}-{args.run}"
    ns = kvtier.Namespace("bench-py", f"wire-{tag}", layers=32, kv_heads=heads, head_dim=128, dtype="bf16",
                          block_tokens=bt)
    nso = kvtier.Namespace.opaque("bench-py", f"wire-{tag}", block_bytes=size, engine="bench")
    assert ns.block_bytes == size and nso.block_bytes == size
    data = payload(size, c)
    # Every operation's tokens (one block) and engine hash, made before the clock starts.
    tokens = [[np.arange(bt, dtype=np.uint32) + np.uint32(((t * n + i) * bt) % (1 << 31)) for i in range(n)]
              for t in range(c)]
    keys = [[struct.pack("<QQQ", size, t, i) for i in range(n)] for t in range(c)]
    near_keys = [[struct.pack("<QQQQ", size, t, i, 1) for i in range(n)] for t in range(c)]
    outs = [dest_slots(size) for _ in range(c)]
    near = [shared_slots(client, size, data) for _ in range(c)]
    res, skipped = {}, {}

    def check(ok, what):
        if not ok:
            # `last_miss` records failures (timeouts, refusals, bad bytes); a plain miss (the block
            # is not stored, e.g. evicted because --size x --ops x --concurrency overfills the
            # server's DRAM) leaves it empty.
            why = client.last_miss or "not stored (a miss, not an error: evicted, or never written?)"
            raise RuntimeError(f"{what} failed: {why}")

    def store(t):
        return timed_ops(n, lambda i: check(client.store(ns, tokens[t][i], data) == 1, "store"))

    def load(t):
        out = outs[t]
        return timed_ops(n, lambda i: check(client.load_into(ns, tokens[t][i], out[i % DEST_SLOTS]) == bt,
                                            "load_into"))

    def store_keys(t):
        return timed_ops(n, lambda i: check(client.store_keys(nso, [keys[t][i]], data) == [True], "store_keys"))

    def load_keys(t):
        out = outs[t]
        return timed_ops(n, lambda i: check(client.load_keys_into(nso, [keys[t][i]], out[i % DEST_SLOTS]) == [True],
                                            "load_keys_into"))

    def store_near(t):
        src = near[t][1]
        return timed_ops(n, lambda i: check(client.store_keys(nso, [near_keys[t][i]], src) == [True], "store_keys"))

    def load_near(t):
        out = near[t][0]
        return timed_ops(n, lambda i: check(client.load_keys_into(nso, [near_keys[t][i]], out[i % DEST_SLOTS])
                                            == [True], "load_keys_into"))

    paths = (("python", store, load, outs), ("python-keys", store_keys, load_keys, outs),
             ("python-samenode", store_near, load_near, [slots for slots, _ in near]))
    for system, st, ld, dests in paths:
        before = samenode_calls(client)
        s_wall, s_lat, s_cpu = run_threads(c, st, args.server_pid)
        for slots in dests:
            for out in slots:
                out.fill(1)
        l_wall, l_lat, l_cpu = run_threads(c, ld, args.server_pid)
        check_slots(system, dests, data, n)
        after = samenode_calls(client)
        if system == "python-samenode" and (after[0] - before[0], after[1] - before[1]) != (c * n, c * n):
            skipped[system] = (f"{after[0] - before[0]} of {c * n} loads and {after[1] - before[1]} of {c * n} "
                               f"stores took the same-node path (last fallback: {after[2]})")
            continue
        res[system] = {"store_s": s_wall, "load_s": l_wall, "store_lat": s_lat, "load_lat": l_lat,
                       "store_cpu": s_cpu, "load_cpu": l_cpu}
    return {"bytes": size * c * n, "paths": res, "namespaces": [ns.id, nso.id], "skipped": skipped}


class LmcacheConn:
    """One connection speaking LMCache 0.5.6's `lm://` protocol (see `lmcache.v1.protocol`): a
    fixed-size `ClientMetaMessage` header, then the payload for a PUT; a `ServerMetaMessage`
    header, then the payload for a GET hit."""

    def __init__(self, port, size):
        import torch

        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode

        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.Cmd, self.Msg, self.SMsg, self.Ret = ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode
        self.Key = CacheEngineKey
        self.size = size
        # A KV_2LTD chunk of uint8 is `size` bytes: [2, layers, tokens, hidden] with hidden = size / (2*32*256).
        self.shape = torch.Size([2, 32, 256, size // (2 * 32 * 256)])
        self.dtype = torch.uint8
        self.fmt = MemoryFormat.KV_2LTD

    def key(self, task, i):
        import torch

        # Keys depend on the cell, not the run: a later run's PUT replaces the earlier run's chunk.
        return self.Key("kvtier-wire-bench", 1, 0, (self.size << 40) ^ (task << 24) ^ i, torch.bfloat16)

    def put(self, key, buf):
        m = self.Msg(self.Cmd.PUT, key, self.size, self.fmt, self.dtype, self.shape)
        self.sock.sendall(m.serialize())
        self.sock.sendall(buf)

    def exists(self, key):
        """EXIST round trip: answered after every earlier request on this connection was handled
        (the server serves a connection in order), so a PUT, which has no answer, is known to be
        stored once this returns."""
        m = self.Msg(self.Cmd.EXIST, key, 0, self.fmt, self.dtype, self.shape)
        self.sock.sendall(m.serialize())
        meta = self.SMsg.deserialize(recv_exact(self.sock, self.SMsg.packlength()))
        return meta.code == self.Ret.SUCCESS

    def get_into(self, key, out):
        m = self.Msg(self.Cmd.GET, key, 0, self.fmt, self.dtype, self.shape)
        self.sock.sendall(m.serialize())
        head = recv_exact(self.sock, self.SMsg.packlength())
        meta = self.SMsg.deserialize(head)
        if meta.code != self.Ret.SUCCESS:
            raise RuntimeError(f"lmcache GET missed ({meta.code})")
        if meta.length != len(out):
            raise RuntimeError(f"lmcache GET returned {meta.length} bytes, expected {len(out)}")
        view = memoryview(out)
        got = 0
        while got < meta.length:
            k = self.sock.recv_into(view[got:], meta.length - got)
            if k == 0:
                raise RuntimeError("lmcache server closed the connection")
            got += k


def recv_exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise RuntimeError("connection closed")
        got += k
    return bytes(buf)


def bench_lmcache(args):
    size, c, n = args.size, args.concurrency, args.ops
    data = payload(size, c)
    conns = [LmcacheConn(args.port, size) for _ in range(c)]
    keys = [[conns[t].key(t, i) for i in range(n)] for t in range(c)]
    outs = [dest_slots(size) for _ in range(c)]

    def store(t):
        lat = timed_ops(n, lambda i: conns[t].put(keys[t][i], data))
        # A PUT has no answer: the phase ends when the server has taken the last one.
        t0 = time.perf_counter()
        if not conns[t].exists(keys[t][n - 1]):
            raise RuntimeError("lmcache lost a chunk it was sent")
        lat[-1] += time.perf_counter() - t0
        return lat

    def load(t):
        return timed_ops(n, lambda i: conns[t].get_into(keys[t][i], outs[t][i % DEST_SLOTS]))

    s_wall, s_lat, s_cpu = run_threads(c, store, args.server_pid)
    l_wall, l_lat, l_cpu = run_threads(c, load, args.server_pid)
    check_slots("lmcache", outs, data, n)
    for conn in conns:
        conn.sock.close()
    return {"bytes": size * c * n, "paths": {"lmcache": {"store_s": s_wall, "load_s": l_wall, "store_lat": s_lat,
                                                         "load_lat": l_lat, "store_cpu": s_cpu, "load_cpu": l_cpu}},
            "namespaces": []}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=["kvtier", "lmcache"])
    ap.add_argument("--server", help="kvtier gRPC address (target kvtier)")
    ap.add_argument("--port", type=int, help="LMCache server port on 127.0.0.1 (target lmcache)")
    ap.add_argument("--size", type=int, default=MIB, help="block bytes")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--ops", type=int, default=64, help="operations per thread")
    ap.add_argument("--run", type=int, default=0, help="run number (keeps runs' namespaces apart)")
    ap.add_argument("--server-pid", type=int, help="the server's pid: its CPU time per phase is reported")
    args = ap.parse_args(argv)
    out = bench_kvtier(args) if args.target == "kvtier" else bench_lmcache(args)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
