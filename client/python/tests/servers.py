"""Server stand-ins the engine tests share: a `kvtier serve` that can be killed (SIGKILL) and
restarted at the same address, and a listener that accepts connections and never answers."""

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request

from kvtier.server import find_binary


class KvServer:
    """`kvtier serve` on loopback, killed and restarted at the same address (the tier's client
    keeps its address): the first start takes the ports the kernel picks (port 0, read back from
    the ready line, so no other socket can take them first); restarts ask for those again."""

    def __init__(self, data_dir, *, dram="256MiB", disk=None, config=None):
        self.data_dir = str(data_dir)
        self.dram, self.disk, self.config = dram, disk, config
        self.port = self.data_port = 0
        self.addr = None
        self.proc = None
        self.metrics_addr = None

    def start(self, timeout_s=30.0):
        cmd = [find_binary(), "serve", "--listen", f"127.0.0.1:{self.port}",
               "--data-listen", f"127.0.0.1:{self.data_port}",
               "--metrics", "127.0.0.1:0", "--data-dir", self.data_dir, "--dram-capacity", self.dram]
        if self.disk:
            cmd += ["--disk-capacity", self.disk]
        if self.config:
            cmd += ["--config", str(self.config)]
        env = dict(os.environ)
        env.pop("KVTIER_CONFIG", None)
        env.setdefault("KVTIER_LOG", "warn")
        deadline = time.monotonic() + timeout_s
        while True:  # the ports of a killed server can take a moment to free up
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            seen = []
            for line in self.proc.stdout:
                seen.append(line.rstrip())
                if "listening" in line:
                    fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
                    self.metrics_addr = fields.get("metrics")
                    self.addr = fields["grpc"]
                    self.port = int(self.addr.rsplit(":", 1)[1])
                    self.data_port = int(fields["data"].rsplit(":", 1)[1])
                    threading.Thread(target=lambda p=self.proc: [None for _ in p.stdout], daemon=True).start()
                    return self
            self.proc.wait()
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvtier serve did not start: {seen}")
            time.sleep(0.2)

    def metrics(self):
        """This server's Prometheus text."""
        url = self.metrics_addr if self.metrics_addr.startswith("http") else f"http://{self.metrics_addr}"
        return urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()

    def served(self, op):
        """Requests of `op` this server answered since it started (its Prometheus counter)."""
        return sum(float(line.rsplit(" ", 1)[1]) for line in self.metrics().splitlines()
                   if line.startswith("kvtier_requests_total{") and f'op="{op}"' in line)

    def until_demoted(self, timeout_s=30.0):
        """Waits until nothing is queued for the disk tier (`kvtier_disk_queue_depth` is 0): what
        DRAM evicted is on disk, so a kill now loses none of it."""
        deadline = time.monotonic() + timeout_s
        while True:
            depth = [float(line.rsplit(" ", 1)[1]) for line in self.metrics().splitlines()
                     if line.startswith("kvtier_disk_queue_depth")]
            if not depth or depth[0] == 0.0:  # absent: nothing was ever queued
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the demotion queue did not drain: depth {depth}")
            time.sleep(0.02)

    def kill(self):
        """SIGKILL: no goodbye to clients, as a crash or an OOM kill."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class HungServer:
    """A TCP listener that accepts connections and never answers: a hung or overloaded server."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.conns = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop:
            try:
                c, _ = self.sock.accept()
                self.conns.append(c)
            except OSError:
                return

    def close(self):
        self._stop = True
        for c in self.conns:
            c.close()
        self.sock.close()
