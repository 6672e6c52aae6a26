"""A namespace purged through one node of a real two-node cluster (a real redis-server keeps the
membership) is purged on the other too, so no copy comes back through the peer tier; a member the
purge could not reach is named in a RuntimeWarning, and purged when it answers again."""

import os
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

import kvtier
from servers import KvServer


def ns():
    return kvtier.Namespace("acme", "m@cluster", layers=2, kv_heads=2, head_dim=64, dtype="fp32", block_tokens=16)


def kv_for(n_tokens, seed=0):
    per_token = ns().token_bytes // 4
    return np.random.default_rng(seed).standard_normal(n_tokens * per_token).astype(np.float32)


def metric(server, name):
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.metrics().splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def until(check, what, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stop_process(pid):
    """SIGSTOP, returning once every thread of the process is stopped: `kill` returns before that,
    and until then its other threads go on answering what arrives (tests/support's stop_process)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped():
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return False
        for t in tasks:
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # a thread that ended meanwhile
            # The state follows the command's closing parenthesis.
            if not stat.rpartition(") ")[2].startswith("T"):
                return False
        return True

    until(stopped, f"process {pid} to stop", timeout_s=5.0)


@pytest.fixture(scope="module")
def redis_url():
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def answers():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    until(answers, "redis-server to listen")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait()


@pytest.fixture
def cluster(tmp_path, redis_url):
    nodes = []
    try:
        for node_id in ("p1", "p2"):
            cfg = tmp_path / f"{node_id}.toml"
            # A TTL far above a test's stall: a stopped node stays a member, and calls to it fail.
            cfg.write_text(f'cluster = "{redis_url}"\nnode_id = "{node_id}"\ncluster_ttl = "60s"\npeer_rebalance = "off"\n'
                           f'cluster_rf = 2\npeer_timeout = "1s"\n')
            nodes.append(KvServer(tmp_path / node_id, config=cfg).start())
        for n in nodes:
            until(lambda n=n: metric(n, "kvtier_membership_members") == 2, "both nodes to see each other")
        yield nodes
    finally:
        for n in nodes:
            if n.proc is not None and n.proc.poll() is None:
                os.kill(n.proc.pid, signal.SIGCONT)
            n.stop()


def stored_on_both(cluster, n, toks, kv):
    a = kvtier.Client(cluster[0].addr, never_raise=False)
    b = kvtier.Client(cluster[1].addr, never_raise=False)
    assert a.store(n, toks, kv) == len(toks) // 16
    until(lambda: metric(cluster[0], "kvtier_peer_forwarded_blocks_total") >= len(toks) // 16,
          "the blocks to reach p2")
    return a, b


def test_a_purge_through_one_node_purges_the_other(cluster):
    n, toks, kv = ns(), list(range(7000, 7064)), kv_for(64)
    a, b = stored_on_both(cluster, n, toks, kv)
    assert b.lookup(n, toks) == 64
    # Four blocks here and their four copies on p2.
    assert a.purge(n) == 8
    assert a.lookup(n, toks) == 0
    assert b.lookup(n, toks) == 0
    out = np.zeros_like(kv)
    assert b.load_into(n, toks, out) == 0


def test_a_member_the_purge_missed_is_named_and_purged_when_back(cluster):
    n, toks, kv = ns(), list(range(8000, 8064)), kv_for(64, seed=1)
    a, b = stored_on_both(cluster, n, toks, kv)
    pid = cluster[1].proc.pid
    stop_process(pid)
    try:
        with pytest.warns(RuntimeWarning, match=r"did not reach 1 member.*p2"):
            assert a.purge(n) == 4
    finally:
        os.kill(pid, signal.SIGCONT)
    # p2 answers again: the purge it missed reaches it, and nothing of the namespace is left.
    until(lambda: b.lookup(n, toks) == 0, "the owed purge to reach p2")
    # The purge that timed out may have reached p2 once it resumed (it was on the socket); the
    # owed one is sent again all the same and counted once p2 has answered it.
    until(lambda: metric(cluster[0], "kvtier_peer_deletes_retried_total") >= 1, "the owed purge to be retried")


def test_a_park_the_cluster_could_not_copy_raises_unavailable(cluster):
    # cluster_rf 2: a park is acknowledged once both nodes hold it. p2 stalled (still a member):
    # the park is kept on p1 but not acknowledged, and said as the cluster's state (worth
    # retrying), not as a bad request.
    n, toks, kv = ns(), list(range(9000, 9040)), kv_for(40, seed=2)
    a = kvtier.Client(cluster[0].addr, never_raise=False)
    pid = cluster[1].proc.pid
    stop_process(pid)
    try:
        with pytest.raises(kvtier.UnavailableError, match=r"^KV:Cluster:Unavailable: too few copies: .*held by 1 of 2 nodes"):
            a.park(n, "short", toks, kv)
    finally:
        os.kill(pid, signal.SIGCONT)
    # Kept on p1 all along, at the version the error named: it resumes there, exact bytes.
    info, got = a.resume(n, "short")
    assert info["version"] == 1 and info["token_count"] == 40
    np.testing.assert_array_equal(np.frombuffer(got, dtype=np.float32), kv)
