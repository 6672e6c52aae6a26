"""kvtier as SGLang's HiCache L3 storage (SGLang 0.5.23, `--hicache-storage-backend dynamic`).

SGLang's hierarchical cache keeps KV pages in GPU memory (L1) and a host pool (L2); an L3 backend
stores host pages under SGLang's own page keys and fetches them back into the host pool. One
launch line, no SGLang patch:

    python -m sglang.launch_server --model-path M --page-size 64 --enable-hierarchical-cache \\
      --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name":"kvtier","module_path":"kvtier.sglang",
        "class_name":"KvtierHiCacheStorage","interface_v1":1,"server":"127.0.0.1:7070","tenant":"acme",
        "allocator":"shm"}'

`interface_v1: 1` selects the zero-copy page functions (`batch_get_v1`/`batch_set_v1`): a page's
segments in the host pool (2 per page for `page_first*`, 2 per layer for `layer_first`) are sent
from and received into where they are, with no staging copy. Without it SGLang uses the copying
"generic" functions (`batch_get`/`batch_set` over flat page tensors).

Same node: add `"allocator": "shm"` (SGLang's own option) and SGLang allocates its host pool in
shared memory (a memfd, still pinned with `cudaHostRegister` on a GPU). The backend registers that
memory with the client (`Client.register_region`), and when the kvtier server runs on this host
the zero-copy functions move pages over its same-node socket: the server copies each page's
segments straight into (or out of) the host pool, one copy, no payload on a socket. A pool in
ordinary memory goes over TCP as before (logged once at attach).

Extra-config keys besides SGLang's own (`backend_name`, `module_path`, `class_name`, `interface_v1`):

    server           kvtier address host:port (required; or $KVTIER_ADDR)
    tenant           kvtier tenant (default "default")
    salt             per-tenant secret mixed into every key (at most 64 bytes)
    model            model id in the namespace (default: SGLang's model name)
    timeout_s        deadline of one get/set batch (default 10 s)
    exists_timeout_s deadline of one existence query (default 2 s; past it: 0 hits)
    connections      client connections (default 4)
    auth_token       kvtier bearer token
    allocator        "shm": SGLang's host pool in shared memory, for the same-node path (SGLang reads
                     this key itself)

Keys are SGLang's page hashes (a SHA-256 chain over the page tokens, salted by `extra_key` /
`cache_salt`), stored as opaque kvtier keys. What those hashes do not cover is in the kvtier
namespace, so two deployments share pages only when the bytes are interchangeable: model, host
pool class, page byte order (from `--hicache-mem-layout` and the generic/zero-copy path: both
paths give the same bytes for `page_first` and `page_first_direct`, not for `layer_first`), dtype,
layers, heads, head dims, page size, TP rank/size (MLA pages are the same on every rank: one
namespace, written by SGLang's one storage writer), PP stage, attention-CP rank/size.

Never breaks the engine: SGLang's TP ranks agree on hit counts with an `all_reduce`, and a rank
that raises or answers a different number of times deadlocks the group. So no method raises;
every call answers once, within its deadline; a dead, slow or restarting server gives 0 hits,
failed gets (the prefix loaded so far) and failed sets (SGLang stops backing up that request).
A page whose stored size differs from this pool's page (another geometry) lives in another
namespace: a miss, and the host pool is not written.

Not supported (answered as misses, never raised): hybrid models' side pools (`batch_*_v2`: Mamba,
SWA, DSA pools) and `clear()` (kvtier keeps pages until eviction).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, List, Optional

import torch

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolTransfer,
        PoolTransferResult,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"kvtier.sglang needs SGLang 0.5.23 (sglang.srt.mem_cache.hicache_storage): {e}") from e

import kvtier

logger = logging.getLogger("sglang.kvtier")

__all__ = ["KvtierHiCacheStorage", "page_byte_order"]

HASH_ALGO = "sglang-page-sha256"

# The byte order of one page of SGLang's MHA host pool (`MHATokenToKVPoolHost`), read from its
# `get_data_page` (flat, the generic path) and `get_page_buffer_meta` (segments in order, the
# zero-copy path). Equal strings mean equal bytes, so such pages are shared.
_MHA_ORDER = {
    ("layer_first", "flat"): "kv.layer.tok.head.dim",
    ("layer_first", "segments"): "layer.kv.tok.head.dim",
    ("page_first", "flat"): "kv.tok.layer.head.dim",
    ("page_first", "segments"): "kv.tok.layer.head.dim",
    ("page_first_direct", "flat"): "kv.layer.tok.head.dim",
    ("page_first_direct", "segments"): "kv.layer.tok.head.dim",
    ("page_head", "flat"): "kv.head.tok.layer.dim",
    ("page_head", "segments"): "kv.head.tok.layer.dim",
}


def page_byte_order(host_pool: Any, path: str) -> str:
    """What one page's bytes are, as laid out by `host_pool` on `path` ("flat": the generic
    functions' flat page tensors; "segments": the zero-copy functions' page segments)."""
    cls = type(host_pool).__name__
    layout = str(getattr(host_pool, "layout", "?"))
    order = _MHA_ORDER.get((layout, path)) if cls == "MHATokenToKVPoolHost" else None
    if order is None:
        # Any other pool (MLA, ...): its layout and path name the order; no sharing across paths.
        order = f"{layout}.{path}"
    dims = []
    for attr, tag in (("layer_num", "L"), ("head_num", "H"), ("head_dim", "D"), ("v_head_dim", "V"),
                      ("kv_lora_rank", "R"), ("qk_rope_head_dim", "Q")):
        v = getattr(host_pool, attr, None)
        if isinstance(v, int):
            dims.append(f"{tag}{v}")
    fmt = getattr(host_pool, "storage_format_tag", None)
    parts = ["sglang", cls, order, *dims]
    if fmt:
        parts.append(str(fmt))
    return ":".join(p.replace(";", ",").replace("=", "-") for p in parts)


def _engine_key(key: Any) -> bytes:
    """SGLang's page key (64 hex digits of SHA-256) as bytes; any other string as UTF-8."""
    if isinstance(key, bytes):
        return key
    s = str(key)
    if len(s) == 64:
        try:
            return bytes.fromhex(s)
        except ValueError:
            pass
    return s.encode("utf-8")


def _byte_view(t: Any, *, writable: bool) -> Any:
    """A CPU tensor's bytes as a NumPy uint8 array over the same memory, or None."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        return None
    if writable and t.requires_grad:
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 storage backed by a kvtier server (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        server = extra.get("server") or os.environ.get("KVTIER_ADDR")
        if not server:
            raise ValueError("kvtier HiCache backend: set \"server\" (host:port) in the extra config")
        self.storage_config = storage_config
        self.server = str(server)
        self.tenant = str(extra.get("tenant", "default"))
        salt = extra.get("salt", b"")
        self.salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        self.model = str(extra.get("model") or storage_config.model_name or "unknown-model")
        self.timeout_s = float(extra.get("timeout_s", 10.0))
        self.exists_timeout_s = float(extra.get("exists_timeout_s", min(2.0, self.timeout_s)))
        self.zero_copy = bool(int(extra.get("interface_v1", 0) or 0))
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.client = kvtier.Client(self.server, never_raise=True, timeout_s=self.timeout_s,
                                    connections=int(extra.get("connections", 4)),
                                    auth_token=extra.get("auth_token"))
        self.mem_pool_host = None
        self.ns_flat = None  # the generic functions' namespace
        self.ns_segments = None  # the zero-copy functions' namespace
        self.segments_per_page = 0
        self._regions = []  # the host pool's memory registered for the same-node path
        self._warned_at = 0.0
        self._lock = threading.Lock()
        self.stats = {"exists": 0, "hits": 0, "gets": 0, "got": 0, "sets": 0, "stored": 0, "errors": 0}

    # ------------------------------------------------------------------------------ setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        try:
            self._make_namespaces(mem_pool_host)
        except Exception as e:  # noqa: BLE001 - an unusable pool: every call is a miss
            logger.error("kvtier HiCache backend: cannot use host pool %s (%s); L3 disabled",
                         type(mem_pool_host).__name__, e)
            self.ns_flat = self.ns_segments = None
        self._register_host_pool(mem_pool_host)

    def _register_host_pool(self, pool: Any) -> None:
        """Registers the host pool's memory with the client when it is a shared mapping (SGLang's
        `"allocator": "shm"`), so the zero-copy functions move pages over the same-node socket
        when the server is on this host. Anything else (ordinary memory, a pool of several
        buffers whose pages span them) goes over TCP."""
        # A pool registered before is done with: its address range must not be taken for this one.
        self._regions = []
        bufs = pool.kv_buffer if isinstance(getattr(pool, "kv_buffer", None), list) else [getattr(pool, "kv_buffer", None)]
        regions = []
        try:
            for t in bufs:
                view = _byte_view(t, writable=True) if isinstance(t, torch.Tensor) else None
                if view is None:
                    raise ValueError("the host pool holds no CPU tensor")
                regions.append(self.client.register_region(view))
        except Exception as e:  # noqa: BLE001 - the TCP path serves every call
            logger.info("kvtier HiCache backend: the host pool is not in shared memory (%s); pages go over TCP "
                        "(\"allocator\": \"shm\" in the extra config puts it there)", e)
            return
        self._regions = regions
        logger.info("kvtier HiCache backend: the host pool (%d bytes) is registered for the same-node path",
                    sum(len(r) for r in regions))

    def _namespace(self, pool: Any, path: str, block_bytes: int):
        cfg = self.storage_config
        if self.is_mla:
            # MLA pages are the same on every TP rank (one writer); DCP ranks hold shards.
            tp_rank, tp_world = int(getattr(cfg, "dcp_rank", 0)), int(getattr(cfg, "dcp_size", 1))
        else:
            tp_rank, tp_world = int(cfg.tp_rank), int(cfg.tp_size)
        layout = page_byte_order(pool, path)
        cp_size = int(getattr(cfg, "attn_cp_size", 1) or 1)
        if cp_size > 1:
            layout += f":cp{int(cfg.attn_cp_rank)}of{cp_size}"
        return kvtier.Namespace.opaque(
            self.tenant, self.model, block_bytes=int(block_bytes), engine="sglang",
            engine_layout=layout, kv_dtype=str(pool.dtype).removeprefix("torch."),
            page_tokens=int(pool.page_size), tp_rank=tp_rank, tp_world=tp_world,
            pp_rank=int(cfg.pp_rank), pp_world=int(cfg.pp_size), hash_algo=HASH_ALGO, salt=self.salt)

    def _make_namespaces(self, pool: Any) -> None:
        dummy = pool.get_dummy_flat_data_page()
        flat_bytes = dummy.numel() * dummy.element_size()
        self.ns_flat = self._namespace(pool, "flat", flat_bytes)
        page = int(getattr(pool, "logical_page_size", pool.page_size))
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        self.segments_per_page = len(ptrs)
        self.ns_segments = self._namespace(pool, "segments", sum(int(s) for s in sizes))
        logger.info("kvtier HiCache backend: server %s, namespaces flat %s / segments %s (%d segments a page)",
                    self.server, self.ns_flat, self.ns_segments, self.segments_per_page)

    def _read_ns(self):
        """The namespace `batch_exists` answers for: the one SGLang's get functions read."""
        return self.ns_segments if self.zero_copy else self.ns_flat

    # ------------------------------------------------------------------------------ helpers

    def _warn(self, what: str, err: Any = None) -> None:
        now = time.monotonic()
        with self._lock:
            self.stats["errors"] += 1
            if now - self._warned_at < 30.0:
                return
            self._warned_at = now
        miss = self.client.last_miss
        logger.warning("kvtier HiCache backend: %s failed (%s); counted as a miss (misses so far: %s)",
                       what, err if err is not None else miss, self.client.misses)

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self.stats[name] += n

    def _segments(self, keys: List[str], host_indices: torch.Tensor):
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        n = len(keys)
        if n == 0 or len(ptrs) != n * self.segments_per_page:
            raise ValueError(f"{len(ptrs)} segments for {n} pages of {self.segments_per_page}")
        k = self.segments_per_page
        return [[(int(ptrs[i * k + j]), int(sizes[i * k + j])) for j in range(k)] for i in range(n)]

    # ------------------------------------------------------------------------------ existence

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many of `keys`, from the first, the server holds (0 on any failure)."""
        try:
            ns = self._read_ns()
            if ns is None or not keys:
                return 0
            found = self.client.exists_keys(ns, [_engine_key(k) for k in keys], timeout_s=self.exists_timeout_s)
            hits = 0
            for f in found:
                if not f:
                    break
                hits += 1
            self._count("exists", len(keys))
            self._count("hits", hits)
            return hits
        except Exception as e:  # noqa: BLE001 - never raise into SGLang
            self._warn("batch_exists", e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------------------ zero-copy

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Loads pages straight into the host pool's page segments; per key True where it landed
        and verified (SGLang uses the leading run)."""
        n = len(keys)
        try:
            if self.ns_segments is None or n == 0:
                return [False] * n
            segs = self._segments(keys, host_indices)
            got = self.client.load_keys_into_segments(self.ns_segments, [_engine_key(k) for k in keys], segs,
                                                      timeout_s=self.timeout_s)
            got = [bool(g) for g in got][:n] + [False] * max(0, n - len(got))
            self._count("gets", n)
            self._count("got", sum(got))
            if not all(got) and self.client.last_miss is not None:
                logger.debug("kvtier HiCache get: %d of %d pages (%s)", sum(got), n, self.client.last_miss)
            return got
        except Exception as e:  # noqa: BLE001
            self._warn("batch_get_v1", e)
            return [False] * n

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Stores pages from the host pool's page segments (pages the server holds already are not
        sent again); per key True where the server holds the page now."""
        n = len(keys)
        try:
            if self.ns_segments is None or n == 0:
                return [False] * n
            if not self.is_writer:
                return [True] * n  # MLA: another rank writes the same pages
            return self._store(self.ns_segments, keys, self._segments(keys, host_indices), segments=True)
        except Exception as e:  # noqa: BLE001
            self._warn("batch_set_v1", e)
            return [False] * n

    def _store(self, ns, keys: List[str], blocks, *, segments: bool) -> List[bool]:
        n = len(keys)
        ekeys = [_engine_key(k) for k in keys]
        held = self.client.exists_keys(ns, ekeys, timeout_s=self.exists_timeout_s)
        todo = [i for i in range(n) if not held[i]]
        out = [bool(h) for h in held]
        if todo:
            sub_keys = [ekeys[i] for i in todo]
            sub_blocks = [blocks[i] for i in todo]
            if segments:
                ok = self.client.store_keys_segments(ns, sub_keys, sub_blocks, timeout_s=self.timeout_s)
            else:
                ok = self.client.store_keys(ns, sub_keys, sub_blocks, timeout_s=self.timeout_s)
            for i, o in zip(todo, ok):
                out[i] = bool(o)
            if not all(ok):
                self._warn("set")
        self._count("sets", n)
        self._count("stored", len(todo))
        return out

    # ------------------------------------------------------------------------------ generic

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Loads pages into `target_locations` (flat page tensors; fresh ones when None): per key
        the tensor, or None (a miss, a failed check, a target of the wrong size)."""
        n = len(keys)
        try:
            ns = self.ns_flat
            if ns is None or n == 0:
                return [None] * n
            if target_locations is None:
                target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
            targets = list(target_locations)
            if len(targets) != n:
                return [None] * n
            bb = ns.block_bytes
            idx, ekeys, views = [], [], []
            for i, t in enumerate(targets):
                v = _byte_view(t, writable=True)
                if v is None or v.nbytes != bb:
                    continue  # a target that cannot hold this page: a miss, never written
                idx.append(i)
                ekeys.append(_engine_key(keys[i]))
                views.append(v)
            out: List[Optional[torch.Tensor]] = [None] * n
            if views:
                got = self.client.load_keys_into(ns, ekeys, views, timeout_s=self.timeout_s)
                for i, g in zip(idx, got):
                    if g:
                        out[i] = targets[i]
            self._count("gets", n)
            self._count("got", sum(o is not None for o in out))
            return out
        except Exception as e:  # noqa: BLE001
            self._warn("batch_get", e)
            return [None] * n

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Stores flat page tensors; True when the server holds every page now. A value of the
        wrong size is not stored (False)."""
        try:
            ns = self.ns_flat
            if ns is None or values is None or len(values) != len(keys):
                return False
            if not keys:
                return True
            if not self.is_writer:
                return True
            bb = ns.block_bytes
            views = []
            for v in values:
                if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    v = v.detach().contiguous()
                b = _byte_view(v, writable=False)
                if b is None or b.nbytes != bb:
                    self._warn("batch_set", f"a page of {getattr(b, 'nbytes', '?')} bytes; a page is {bb}")
                    return False
                views.append(b)
            return all(self._store(ns, keys, views, segments=False))
        except Exception as e:  # noqa: BLE001
            self._warn("batch_set", e)
            return False

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # ------------------------------------------------------------------------------ the rest

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """KV pages only: with side pools (hybrid models) nothing is a hit, the same on every rank."""
        try:
            if pool_transfers:
                return PoolTransferResult(0, {str(t.name): 0 for t in pool_transfers})
            return PoolTransferResult(self.batch_exists(keys, extra_info), {})
        except Exception as e:  # noqa: BLE001
            self._warn("batch_exists_v2", e)
            return PoolTransferResult(0, {})

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        return {t.name: [False] * len(t.keys or []) for t in transfers or []}

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        return {t.name: [False] * len(t.keys or []) for t in transfers or []}

    def clear(self) -> None:
        logger.info("kvtier HiCache backend: clear() keeps the server's pages (they age out by eviction)")

    def get_stats(self):
        return None

    def close(self) -> None:
        # The pool's registration: an address range taken for that memory must not outlive it.
        self._regions = []
