"""KV events and routing hints from Python, against a real `kvtier serve`: `watch_events` is an
iterator of plain dicts (the GIL released while it waits) that reports stores, evictions, session
parks and drops with their keys; `route_hint` returns a plain dict naming this node and the prefix
and session it holds; another tenant's namespace can't be watched."""

import threading
import time

import numpy as np
import pytest

import kvtier
from servers import KvServer

TOKEN_A = "python-events-a-0001"
TOKEN_B = "python-events-b-0002"


@pytest.fixture(scope="module")
def events_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("events")
    cfg = d / "kvtier.toml"
    cfg.write_text(
        f'node_id = "py-node"\n\n[[tenants]]\nname = "a"\ntokens = ["{TOKEN_A}"]\n\n'
        f'[[tenants]]\nname = "b"\ntokens = ["{TOKEN_B}"]\n'
    )
    srv = KvServer(d / "data", dram="2MiB", config=cfg).start()
    yield srv
    srv.stop()


def ns(tenant, salt=b""):
    # 2 layers x 2 heads x 64 x fp32 x 16 tokens = 32 KiB per block.
    return kvtier.Namespace(tenant, "m@1", layers=2, kv_heads=2, head_dim=64, dtype="fp32", block_tokens=16, salt=salt)


def collect(stream, done, timeout_s=10.0):
    got = []
    deadline = time.monotonic() + timeout_s
    while not done(got):
        left = deadline - time.monotonic()
        assert left > 0, f"events did not arrive: {got}"
        e = stream.next_event(timeout_s=left)
        if e is not None:
            got.append(e)
    return got


def keys(events, kind):
    return {k for e in events if e["kind"] == kind for k in e["keys"]}


def test_events_and_route_hint(events_server):
    a = kvtier.Client(events_server.addr, never_raise=False, auth_token=TOKEN_A)
    mine = ns("a", b"ev")
    stream = a.watch_events(mine)
    toks = list(range(1000, 1000 + 4 * 16))
    kv = np.random.default_rng(1).standard_normal(4 * 16 * mine.token_bytes // 4).astype(np.float32)
    assert a.store(mine, toks, kv) == 4
    got = collect(stream, lambda g: len(keys(g, "stored")) >= 4)
    assert all(e["node_id"] == "py-node" and e["tier"] == "dram" for e in got)
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys(got, "stored"))
    assert len(keys(got, "stored")) == 4

    # Sessions: parked then dropped, by id.
    a.park(mine, "agent-py", toks, kv)
    assert a.drop_session(mine, "agent-py")
    got = collect(stream, lambda g: any(e["kind"] == "session_dropped" for e in g))
    kinds = [(e["kind"], e["session_id"]) for e in got if e["kind"].startswith("session")]
    assert kinds == [("session_parked", "agent-py"), ("session_dropped", "agent-py")]

    # 2 MiB of DRAM: a flood of 3 MiB evicts, and evictions name the keys that went.
    for i in range(12):
        flood = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8 * 16))
        a.store(mine, flood, np.ones(8 * 16 * mine.token_bytes // 4, np.float32))
    got = collect(stream, lambda g: len(keys(g, "evicted")) >= 8)
    assert all(e["tier"] == "dram" and e["to_tier"] == "" for e in got if e["kind"] == "evicted")

    # Polling without waiting (`timeout_s=0`): what has arrived is taken, then None at once.
    for _ in range(10_000):
        t0 = time.monotonic()
        if stream.next_event(timeout_s=0) is None:
            assert time.monotonic() - t0 < 0.1, "a poll waited"
            break
    a.park(mine, "poll-py", toks, kv)
    deadline = time.monotonic() + 10
    parked = []
    while not parked and time.monotonic() < deadline:
        e = stream.next_event(timeout_s=0)
        if e is None:
            time.sleep(0.01)
        elif e["kind"] == "session_parked":
            parked.append(e["session_id"])
    assert parked == ["poll-py"], parked
    with pytest.raises(ValueError, match="timeout_s"):
        stream.next_event(timeout_s=-1)

    # The routing hint: a plain dict, this node alone (no cluster).
    a.store(mine, toks, kv)
    hint = a.route_hint(mine, toks + [1, 2, 3], session="agent-py")
    assert hint["total_blocks"] == 4 and hint["block_tokens"] == 16 and hint["best"] == "py-node"
    [node] = hint["nodes"]
    assert node["node_id"] == "py-node" and node["reachable"] and node["answering"]
    assert node["prefix_blocks"] == 4 and node["prefix_tokens"] == 64 and not node["holds_session"]
    assert node["grpc_addr"] == events_server.addr
    stream.close()
    assert stream.next_event(timeout_s=0.1) is None


def test_iterating_releases_the_gil_and_another_tenant_is_refused(events_server):
    a = kvtier.Client(events_server.addr, never_raise=False, auth_token=TOKEN_A)
    b = kvtier.Client(events_server.addr, never_raise=False, auth_token=TOKEN_B)
    mine = ns("a", b"gil")
    with pytest.raises(kvtier.ForbiddenError):
        b.watch_events(mine)
    # Even in never-raise mode a watch that can't open raises.
    quiet_b = kvtier.Client(events_server.addr, auth_token=TOKEN_B)
    with pytest.raises(kvtier.ForbiddenError):
        quiet_b.watch_events(mine)

    stream = a.watch_events(mine)
    first = []
    reader = threading.Thread(target=lambda: first.append(next(iter(stream))), daemon=True)
    reader.start()
    # The reader waits inside `next` with the GIL released: this thread keeps running Python.
    spins = 0
    t = time.monotonic()
    while time.monotonic() - t < 0.3:
        spins += 1
    assert spins > 1000 and reader.is_alive()
    toks = list(range(7, 7 + 16))
    assert a.store(mine, toks, np.zeros(16 * mine.token_bytes // 4, np.float32)) == 1
    reader.join(10)
    assert first and first[0]["kind"] == "stored" and len(first[0]["keys"]) == 1
