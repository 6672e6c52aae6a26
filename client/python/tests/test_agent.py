"""The GPU agent end to end on the host backend: a real `kvtier serve` and a real `kvtier agent`
(small G1 pool) on loopback and Unix sockets; one engine stand-in process (NumPy pages in a sealed
memfd, `agent_engine.py`) stores a prefix through the agent layer by layer, the pool spills into
the server under pressure, and a second stand-in process reloads the prefix layer by layer,
byte-identical. Both services are stopped by pid. Needs only NumPy (no kvtier extension)."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

np = pytest.importorskip("numpy")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
BLOCK_BYTES = 2 * 4 * 2 * 64 * 2 * 16  # K+V × layers × heads × head_dim × fp16 × tokens
POOL_PAGES = 8
BLOCKS = 24


def binary():
    env = os.environ.get("KVTIER_BIN")
    if env:
        return env
    for profile in ("release", "debug"):
        cand = ROOT / "target" / profile / "kvtier"
        if cand.exists():
            return str(cand)
    pytest.skip("no kvtier binary: set KVTIER_BIN or cargo build --bins")


def start(cmd, ready):
    """Starts a service and waits for its `ready` line; its output keeps draining in a thread."""
    env = dict(os.environ, KVTIER_LOG="warn")
    env.pop("KVTIER_CONFIG", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        seen.append(line.rstrip())
        if ready in line:
            threading.Thread(target=lambda: [seen.append(x.rstrip()) for x in proc.stdout], daemon=True).start()
            return proc, seen
        if time.monotonic() > deadline:
            break
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{cmd[1]} did not start: {seen}")


def stop(proc):
    """SIGTERM by pid; the service must exit cleanly."""
    os.kill(proc.pid, signal.SIGTERM)
    return proc.wait(timeout=20)


def metric(url, name):
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def engine(*args):
    out = subprocess.run([sys.executable, str(HERE / "agent_engine.py"), *map(str, args)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"engine stand-in failed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def services(tmp_path):
    kvtier = binary()
    # Every port is the kernel's pick (port 0), read back from the ready lines: a port picked
    # here and released can be taken by another socket before the service binds it.
    server, server_log = start([kvtier, "serve", "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
                                "--no-metrics", "--data-dir", str(tmp_path / "data"), "--dram-capacity", "64MiB"],
                               "listening")
    grpc = next(filter(None, (re.search(r"grpc=(\S+)", x) for x in list(server_log))), None)
    sock = tmp_path / "agent.sock"
    agent = None
    try:
        assert grpc, server_log
        agent, agent_log = start([kvtier, "agent", "--server", grpc.group(1), "--socket", str(sock),
                                  "--device", "host", "--host-memory", "16MiB", "--page-bytes", str(BLOCK_BYTES),
                                  "--pool-capacity", str(POOL_PAGES * BLOCK_BYTES), "--metrics", "127.0.0.1:0"],
                                 "kvtier agent listening")
        metrics_url = next(filter(None, (re.search(r"metrics (http://\S+/metrics)", x) for x in list(agent_log))), None)
        assert metrics_url, agent_log
    except BaseException:
        if agent:
            stop(agent)
        stop(server)
        raise
    yield sock, metrics_url.group(1), agent_log
    assert stop(agent) == 0, agent_log
    assert not sock.exists(), "the agent removes its socket on SIGTERM"
    assert stop(server) == 0, server_log


def wait_metric(url, name, at_least, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        v = metric(url, name)
        if (v is not None and v >= at_least) or time.monotonic() > deadline:
            return v
        time.sleep(0.1)


def test_a_prefix_stored_through_the_agent_spills_and_reloads_layer_by_layer(services, tmp_path):
    sock, metrics_url, log = services
    expected = tmp_path / "saved.npy"
    saved = engine("save", sock, BLOCKS, 4, 7, expected)
    assert saved == {"committed": BLOCKS, "blocks": BLOCKS}
    # Only 8 of 24 blocks fit in G1: at least 16 were spilled into the server, none failed.
    spills = wait_metric(metrics_url, "kvtier_agent_spills_total", BLOCKS - POOL_PAGES)
    assert spills is not None and spills >= BLOCKS - POOL_PAGES, log
    assert metric(metrics_url, "kvtier_agent_spill_errors_total") == 0
    assert metric(metrics_url, "kvtier_agent_pool_pages") == POOL_PAGES

    # A second engine process: every block comes back, the spilled ones from the server (G2).
    got = engine("load", sock, BLOCKS, expected)
    assert got["found"] == BLOCKS, got
    assert got["g2"] >= BLOCKS - POOL_PAGES and got["g1"] + got["g2"] == BLOCKS, got
    assert got["identical_layers"] == [True] * 4, got
    assert got["miss"] == [0, 0, 0], got
    assert wait_metric(metrics_url, "kvtier_agent_load_misses_total", 1) == 1
    # The agent publishes its counters one after another every 250 ms: a scrape between two of
    # them sees the miss before the copy bytes of the same tick. Polled, not read once.
    copied = wait_metric(metrics_url, "kvtier_agent_copy_bytes_total", 2 * BLOCKS * BLOCK_BYTES)
    assert copied is not None and copied >= 2 * BLOCKS * BLOCK_BYTES, copied
    gbps = wait_metric(metrics_url, "kvtier_agent_copy_gbps", 1e-12)
    assert gbps is not None and gbps > 0, gbps


def test_bad_requests_are_refused_and_the_agent_stays_up(services):
    sys.path.insert(0, str(HERE))
    from agent_engine import AgentEngine, AgentError, prefix_keys

    sock, metrics_url, _ = services
    # A layout whose blocks are not the agent's page size.
    with pytest.raises(AgentError, match="G1 pages are"):
        AgentEngine(sock, pages=2, head_dim=32)
    eng = AgentEngine(sock, pages=2)
    # A page past the end of the buffer; a later layer of a key whose layer 0 was never saved.
    with pytest.raises(AgentError, match="past the end"):
        eng.start_load_kv([5], prefix_keys(1))
    eng.save_kv_layer(1, [0], prefix_keys(1))
    with pytest.raises(AgentError, match="layer 0 was not saved"):
        eng.wait_for_save()
    # The connection is still usable after refusals.
    for layer in range(eng.layers):
        eng.save_kv_layer(layer, [0], prefix_keys(1, salt=b"other"))
    assert eng.wait_for_save() == 1
    eng.close()
    assert wait_metric(metrics_url, "kvtier_agent_refused_total", 3) >= 3
