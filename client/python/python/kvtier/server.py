"""Starting a local `kvtier serve` process (for tests, tools and notebooks).

    with kvtier.server.LocalServer(dram_capacity="2GiB") as srv:
        client = kvtier.Client(srv.addr)

The binary is `$KVTIER_BIN`, else `kvtier` on `PATH`, else the repository's
`target/release/kvtier` or `target/debug/kvtier` when the package runs from a checkout.
"""

import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time


def find_binary():
    """Path of the `kvtier` server binary, or raise FileNotFoundError saying how to build it."""
    env = os.environ.get("KVTIER_BIN")
    if env:
        return env
    on_path = shutil.which("kvtier")
    if on_path:
        return on_path
    here = pathlib.Path(__file__).resolve()
    for parent in here.parents:
        for profile in ("release", "debug"):
            cand = parent / "target" / profile / "kvtier"
            if cand.exists():
                return str(cand)
    raise FileNotFoundError(
        "kvtier binary not found: set KVTIER_BIN, put `kvtier` on PATH, or run `cargo build --release --bin kvtier`"
    )


class LocalServer:
    """A `kvtier serve` child process on ephemeral loopback ports, stopped (by its pid) on exit."""

    def __init__(self, *, dram_capacity="1GiB", extra_args=(), binary=None, data_dir=None, startup_timeout_s=30.0):
        self._tmp = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-")
            data_dir = self._tmp.name
        self.data_dir = data_dir
        cmd = [
            binary or find_binary(),
            "serve",
            "--listen", "127.0.0.1:0",
            "--data-listen", "127.0.0.1:0",
            "--metrics", "127.0.0.1:0",
            "--data-dir", str(data_dir),
            "--dram-capacity", str(dram_capacity),
            *extra_args,
        ]
        env = dict(os.environ)
        env.pop("KVTIER_CONFIG", None)
        env.setdefault("KVTIER_LOG", "warn")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        self.addr = self.data_addr = self.metrics_addr = None
        deadline = time.monotonic() + startup_timeout_s
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            seen.append(line.rstrip())
            if "listening" in line:
                fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
                self.addr = fields["grpc"].removeprefix("http://")
                self.data_addr = fields.get("data")
                self.metrics_addr = fields.get("metrics")
                break
        if self.addr is None:
            self.stop()
            raise RuntimeError(f"kvtier serve did not report its addresses; output: {seen}")
        # Keep draining stdout so the server never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
