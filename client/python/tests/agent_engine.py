"""A same-node engine stand-in for the GPU agent (`kvtier agent`): its KV cache is NumPy "pages"
in a sealed memfd (the host backend's stand-in for an engine's HBM, shared with the agent the way
a CUDA IPC handle shares HBM), and it speaks the agent's engine socket
(`gpu-agent/src/engine/proto.rs`) in the shape of vLLM's connector: `save_kv_layer` /
`wait_for_save`, `start_load_kv` / `wait_for_layer_load`. Pure Python + NumPy.

As a script (what the tests run, one process per engine):
    agent_engine.py save SOCKET BLOCKS CHUNK SEED OUT.npy   store a prefix, chunk by chunk
    agent_engine.py load SOCKET BLOCKS EXPECTED.npy         reload it layer by layer and compare
Both print one JSON line.
"""

import fcntl
import hashlib
import json
import mmap
import os
import socket
import struct
import sys

import numpy as np

HEADER = struct.Struct("<IBBHI")  # body_len, op, status, aux, request_id
OPEN, REGISTER, SAVE, LOAD, LAYER = 1, 2, 3, 4, 5
DTYPES = {"bf16": 1, "fp16": 2, "fp32": 3}

# The test model's layout: 4 layers, 2 KV heads of 64, fp16, 16 tokens per block -> 32 KiB blocks.
LAYOUT = dict(layers=4, kv_heads=2, head_dim=64, dtype="fp16", block_tokens=16)


class AgentError(Exception):
    def __init__(self, status, message):
        super().__init__(f"status {status}: {message}")
        self.status = status


def _string(b):
    return struct.pack("<H", len(b)) + b


class AgentEngine:
    """One engine's connection to the agent and its KV buffer of `pages` pages per layer."""

    def __init__(self, path, pages, *, tenant="acme", model="stand-in-llama", salt=b"tenant-salt", **layout):
        lay = dict(LAYOUT, **layout)
        self.layers = lay["layers"]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(path))
        self.next_id = 0
        body = (_string(tenant.encode()) + _string(model.encode())
                + struct.pack("<HHHBBI", lay["layers"], lay["kv_heads"], lay["head_dim"], DTYPES[lay["dtype"]], 1,
                              lay["block_tokens"]) + _string(salt))
        ans = self._call(OPEN, body)
        self.block_bytes, layers = struct.unpack_from("<QI", ans)
        assert layers == self.layers
        self.layer_bytes = self.block_bytes // self.layers
        self.pages = pages
        size = self.layers * pages * self.layer_bytes
        fd = os.memfd_create("engine-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.mem = mmap.mmap(fd, size)
        # kv[layer, page] is one page of one layer (K and V of `block_tokens` tokens), as fp16.
        self.kv = np.frombuffer(self.mem, dtype=np.float16).reshape(self.layers, pages, self.layer_bytes // 2)
        body = struct.pack("<B3xQI", 0, size, pages) + bytes(64)
        self.buffer = struct.unpack("<I", self._call(REGISTER, body, fds=[fd]))[0]
        os.close(fd)  # the agent holds its own mapping now
        self.pending_saves = []

    # -- framing ---------------------------------------------------------------------------------

    def _send(self, op, body, fds=None):
        self.next_id += 1
        msg = HEADER.pack(len(body), op, 0, 0, self.next_id) + body
        if fds:
            sent = socket.send_fds(self.sock, [msg], fds)
            self.sock.sendall(msg[sent:])
        else:
            self.sock.sendall(msg)
        return self.next_id

    def _recv_exact(self, n):
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the agent closed the connection")
            out += chunk
        return bytes(out)

    def _answer(self, want_id):
        h = HEADER.unpack(self._recv_exact(HEADER.size))
        body_len, op, status, aux, rid = h
        body = self._recv_exact(body_len)
        if rid != want_id:
            raise ConnectionError(f"answer to request {rid}, expected {want_id}")
        if status != 0:
            raise AgentError(status, body.decode(errors="replace"))
        return op, aux, body

    def _call(self, op, body, fds=None):
        return self._answer(self._send(op, body, fds))[2]

    @staticmethod
    def _items(pages, keys):
        assert len(pages) == len(keys)
        return struct.pack("<I", len(keys)) + b"".join(struct.pack("<I", p) + k for p, k in zip(pages, keys))

    # -- the connector's calls -------------------------------------------------------------------

    def save_kv_layer(self, layer, pages, keys):
        """Queues the save of one layer of `pages` under `keys` (answered later, in order)."""
        body = struct.pack("<IHH", self.buffer, layer, 0) + self._items(pages, keys)
        self.pending_saves.append(self._send(SAVE, body))

    def wait_for_save(self):
        """Waits for every queued layer; the number of blocks committed to G1. Every answer is read
        before the first refusal is raised, so the connection stays in step."""
        committed, failed = 0, None
        pending, self.pending_saves = self.pending_saves, []
        for rid in pending:
            try:
                _, _, body = self._answer(rid)
                committed += struct.unpack("<II", body)[1]
            except AgentError as e:
                failed = failed or e
        if failed:
            raise failed
        return committed

    def start_load_kv(self, pages, keys):
        """Starts loading `keys` into `pages`; (found, from G1, from G2). The first `found` keys
        will land, layer by layer."""
        self._load_id = self._send(LOAD, struct.pack("<I", self.buffer) + self._items(pages, keys))
        _, _, body = self._answer(self._load_id)
        self._next_layer = 0
        return struct.unpack("<III", body)

    def wait_for_layer_load(self, layer):
        """Blocks until `layer` has landed (layers complete in order)."""
        while self._next_layer <= layer:
            op, aux, _ = self._answer(self._load_id)
            assert op == LAYER and aux == self._next_layer, (op, aux)
            self._next_layer += 1

    def close(self):
        self.sock.close()


def prefix_keys(n, salt=b"prefix"):
    """Chained 32-byte keys of an n-block prefix (the engine's own block hashes)."""
    keys, prev = [], salt
    for i in range(n):
        prev = hashlib.sha256(prev + struct.pack("<I", i)).digest()
        keys.append(prev)
    return keys


def main(argv):
    cmd, path = argv[1], argv[2]
    if cmd == "save":
        blocks, chunk, seed, out = int(argv[3]), int(argv[4]), int(argv[5]), argv[6]
        eng = AgentEngine(path, pages=chunk)
        keys = prefix_keys(blocks)
        rng = np.random.default_rng(seed)
        saved = np.empty((blocks, eng.layers, eng.kv.shape[2]), dtype=np.float16)
        committed = 0
        # One "forward pass" per chunk: each layer's pages are written and saved as it is computed.
        for start in range(0, blocks, chunk):
            ks = keys[start:start + chunk]
            pages = list(range(len(ks)))
            for layer in range(eng.layers):
                eng.kv[layer, :len(ks)] = rng.standard_normal((len(ks), eng.kv.shape[2])).astype(np.float16)
                saved[start:start + len(ks), layer] = eng.kv[layer, :len(ks)]
                eng.save_kv_layer(layer, pages, ks)
            committed += eng.wait_for_save()
        np.save(out, saved)
        print(json.dumps({"committed": committed, "blocks": blocks}))
    elif cmd == "load":
        blocks, expected = int(argv[3]), np.load(argv[4])
        eng = AgentEngine(path, pages=blocks)
        keys = prefix_keys(blocks)
        # Into pages in reverse order, so a wrong offset cannot pass.
        pages = list(reversed(range(blocks)))
        found, g1, g2 = eng.start_load_kv(pages, keys)
        identical = []
        for layer in range(eng.layers):
            eng.wait_for_layer_load(layer)
            got = eng.kv[layer, pages[:found]]
            identical.append(bool(np.array_equal(got.view(np.uint16), expected[:found, layer].view(np.uint16))))
        # A key no one stored: a miss, its page untouched.
        miss = eng.start_load_kv([0], [hashlib.sha256(b"never stored").digest()])
        for layer in range(eng.layers):
            eng.wait_for_layer_load(layer)
        print(json.dumps({"found": found, "g1": g1, "g2": g2, "identical_layers": identical, "miss": list(miss)}))
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv)
