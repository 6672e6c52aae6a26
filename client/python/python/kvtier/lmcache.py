"""kvtier as an LMCache remote storage plugin (LMCache 0.5.6, e.g. under vLLM's `LMCacheConnectorV1`).

LMCache keeps KV chunks in local CPU memory and hands them to a remote connector; this plugin
stores them on a kvtier server. Registration (the LMCACHE_CONFIG_FILE yaml; `extra_config` keys
are flat dotted strings):

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_serde: naive
    remote_storage_plugins: ["kvtier"]
    extra_config:
      remote_storage_plugin.kvtier.module_path: kvtier.lmcache
      remote_storage_plugin.kvtier.class_name: KvtierConnectorAdapter
      remote_storage_plugin.kvtier.url: "kvtier://127.0.0.1:7070?tenant=acme"

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'

LMCache's `RemoteBackend` dials the virtual URL `plugin://kvtier` (`plugin://kvtier.<instance>` for
a second instance: its url is `remote_storage_plugin.kvtier.<instance>.url`); the adapter also
takes `remote_url: kvtier://host:port` (deprecated in LMCache). Options, as URL query parameters
or `remote_storage_plugin.<name>.<option>` extra-config keys:

    tenant            kvtier tenant (default "default")
    salt              per-tenant secret mixed into every key (at most 64 bytes)
    model             model id in the namespace (default: LMCache's model name)
    timeout_s         deadline of one get/put (default 5 s, and below LMCache's
                      `blocking_timeout_secs`: at most 80% of it)
    lookup_timeout_s  deadline of an existence check (default 1 s; past it: not there)
    connections       client connections (default 4)
    io_threads        threads doing the I/O beside LMCache's event loop (default 4)
    auth_token        kvtier bearer token

Keys: LMCache's `CacheEngineKey` string (`model@world@worker@chunk_hash@dtype[@tags]`) as an
opaque kvtier key. The namespace adds what the key lacks: the memory format and full chunk
shape, KV dtype, chunk size, TP rank/size (MLA chunks are the same on every rank: one namespace)
and LMCache's pre-caching hash algorithm. Note that LMCache's default `builtin` hash needs the
same PYTHONHASHSEED in every process for keys to match across processes.

Blocks: a kvtier opaque block is a fixed size, and LMCache's last chunk of a request may be
partial (`save_unfull_chunk`). So every chunk is stored as a 64-byte header (magic, format,
dtype, shape, byte length) followed by the chunk's bytes, zero-padded to the full chunk size:
one namespace for all chunks of a deployment, a get knows the real length before it looks at the
bytes, and a partial chunk comes back with its own shape (LMCache's `reshape_partial_chunk`).
The padding costs at most one chunk's bytes per request; the alternative (a namespace per
length) would need up to `chunk_size` lookups per get. Puts send from the chunk's own memory
(header, chunk, shared zero padding as segments) and gets receive into a chunk allocated from
LMCache's local CPU backend: no staging copy either way.

Never breaks the engine: no method raises into LMCache, every wait is bounded (LMCache's own
`contains` waits on the connector with no timeout), a dead or slow server gives misses. Reference
counts: `put` never releases the chunk (LMCache's wrapper does); a chunk this connector allocated
and does not hand back is released, also when LMCache gives up waiting for a get.

Not supported: `list()` (kvtier does not list keys: empty) and `remove_sync` (False).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import struct
import threading
import time
from typing import Any, List, Optional
from urllib.parse import parse_qs, urlparse

import numpy as np

try:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat, MemoryObj
    from lmcache.v1.protocol import DTYPE_TO_INT
    from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"kvtier.lmcache needs LMCache 0.5.6 (lmcache.v1.storage_backend.connector): {e}") from e

import kvtier

logger = logging.getLogger("lmcache.kvtier")

__all__ = ["KvtierConnectorAdapter", "KvtierRemoteConnector", "HEADER_BYTES"]

SCHEME = "kvtier"
HEADER_BYTES = 64
_MAGIC = b"KVL1"
_VERSION = 1
# magic, version, memory format, dtype code (LMCache's DTYPE_TO_INT), ndim, byte length, shape[4]
_HEADER = struct.Struct("<4sHHHHQ4Q")
assert _HEADER.size <= HEADER_BYTES


def _plugin_type(name: str) -> str:
    return name.split(".", 1)[0]


class KvtierConnectorAdapter(ConnectorAdapter):
    """LMCache `ConnectorAdapter` for `kvtier://host:port[?options]` and `plugin://kvtier[.instance]`."""

    def __init__(self) -> None:
        super().__init__(f"{SCHEME}://")

    def can_parse(self, url: str) -> bool:
        if url.startswith(f"{SCHEME}://"):
            return True
        return url.startswith("plugin://") and _plugin_type(url[len("plugin://"):]) == SCHEME

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        url = context.url
        extra = dict(getattr(context.config, "extra_config", None) or {})
        options: dict = {}
        if url.startswith("plugin://"):
            name = context.plugin_name or url[len("plugin://"):]
            real = extra.get(f"remote_storage_plugin.{name}.url") or extra.get(f"remote_storage_plugin.{SCHEME}.url")
            if not real:
                raise ValueError(f"kvtier LMCache plugin {name!r}: set extra_config "
                                 f"remote_storage_plugin.{name}.url to kvtier://host:port")
            for prefix in (f"remote_storage_plugin.{SCHEME}.", f"remote_storage_plugin.{name}."):
                for k, v in extra.items():
                    if k.startswith(prefix) and "." not in k[len(prefix):]:
                        options[k[len(prefix):]] = v
            url = str(real)
        if not url.startswith(f"{SCHEME}://"):
            raise ValueError(f"kvtier LMCache plugin: {url!r} is not a kvtier://host:port URL")
        parsed = urlparse(url)
        if not parsed.hostname or not parsed.port:
            raise ValueError(f"kvtier LMCache plugin: {url!r} lacks host:port")
        for k, v in parse_qs(parsed.query).items():
            options[k] = v[-1]
        host = parsed.hostname if ":" not in parsed.hostname else f"[{parsed.hostname}]"
        return KvtierRemoteConnector(f"{host}:{parsed.port}", context.loop, context.local_cpu_backend,
                                     context.config, context.metadata, options)


def _option(opts: dict, name: str, default: Any, kind: type) -> Any:
    """Option `name` as a `kind`; a value that isn't one is an error naming the option (it was
    Python's bare "could not convert string to float: 'soon'", and LMCache then ran with no
    connector at all)."""
    value = opts.get(name, default)
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"kvtier LMCache connector: option {name}={value!r} is not a {kind.__name__}") from None


class KvtierRemoteConnector(RemoteConnector):
    """The connector `KvtierConnectorAdapter` creates (see the module docstring)."""

    def __init__(self, addr: str, loop: Optional[asyncio.AbstractEventLoop], local_cpu_backend: Any,
                 config: Any, metadata: Any, options: Optional[dict] = None):
        super().__init__(config, metadata)
        opts = dict(options or {})
        self.addr = addr
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.config = config
        self.metadata = metadata
        blocking = float(getattr(config, "blocking_timeout_secs", 10) or 10)
        self.timeout_s = min(_option(opts, "timeout_s", 5.0, float), 0.8 * blocking)
        self.lookup_timeout_s = min(_option(opts, "lookup_timeout_s", 1.0, float), self.timeout_s)
        self.tenant = str(opts.get("tenant", "default"))
        salt = opts.get("salt", b"")
        salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        self.client = kvtier.Client(addr, never_raise=True, timeout_s=self.timeout_s,
                                    connections=_option(opts, "connections", 4, int), auth_token=opts.get("auth_token"))
        self.full_bytes = int(self.full_chunk_size_bytes)
        self.block_bytes = HEADER_BYTES + self.full_bytes
        self.dtype_code = DTYPE_TO_INT.get(self.meta_dtypes[0])
        self.ns = kvtier.Namespace.opaque(
            self.tenant, str(opts.get("model") or metadata.model_name), block_bytes=self.block_bytes,
            engine="lmcache", engine_layout=self._layout(), kv_dtype=str(metadata.kv_dtype).removeprefix("torch."),
            page_tokens=int(metadata.chunk_size),
            tp_rank=0 if metadata.use_mla else int(metadata.worker_id),
            tp_world=1 if metadata.use_mla else int(metadata.world_size),
            hash_algo=_clean(str(getattr(config, "pre_caching_hash_algorithm", "builtin"))), salt=salt)
        self._zeros = np.zeros(self.full_bytes, np.uint8)  # the padding of partial chunks (read only)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=_option(opts, "io_threads", 4, int),
                                                           thread_name_prefix="kvtier-lmcache")
        # Lookups on threads of their own: queued behind puts (each up to `timeout_s`) they took
        # far past `lookup_timeout_s` on a node that stopped answering.
        self._lookup_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                                  thread_name_prefix="kvtier-lmcache-lookup")
        self._lock = threading.Lock()
        self._warned_at = 0.0
        self._closed = False
        self.stats = {"exists": 0, "hits": 0, "puts": 0, "stored": 0, "gets": 0, "got": 0, "errors": 0}
        logger.info("kvtier LMCache connector: server %s, namespace %s, %d-byte blocks (timeout %.1fs)",
                    addr, self.ns, self.block_bytes, self.timeout_s)

    def _layout(self) -> str:
        groups = "+".join("x".join(str(int(d)) for d in s) + "/" + str(t).removeprefix("torch.")
                          for s, t in zip(self.meta_shapes, self.meta_dtypes))
        return _clean(f"{self.meta_fmt.name}:{groups}:hdr{HEADER_BYTES}v{_VERSION}")

    def __repr__(self) -> str:
        return f"<KvtierRemoteConnector {self.addr}>"

    # ------------------------------------------------------------------------------ helpers

    def _warn(self, what: str, err: Any = None) -> None:
        now = time.monotonic()
        with self._lock:
            self.stats["errors"] += 1
            if now - self._warned_at < 30.0:
                return
            self._warned_at = now
        logger.warning("kvtier LMCache connector: %s failed (%s); counted as a miss (misses so far: %s)",
                       what, err if err is not None else self.client.last_miss, self.client.misses)

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.stats[k] += v

    @staticmethod
    def _key(key: CacheEngineKey) -> bytes:
        return key.to_string().encode("utf-8")

    async def _offload(self, fn, *args, orphan=None, pool=None):
        """Runs `fn` on the I/O threads (`pool`, by default the puts' and gets'). If LMCache
        stops waiting (its timeout cancels this coroutine), `orphan` gets the result when it
        comes (to release what it allocated)."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(pool or self._pool, fn, time.monotonic(), *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if orphan is not None:
                def done(f):
                    if not f.cancelled() and f.exception() is None:
                        orphan(f.result())
                fut.add_done_callback(done)
            raise

    def _late(self, submitted: float) -> bool:
        """A job that waited for a thread past the deadline fails without I/O."""
        return time.monotonic() - submitted > self.timeout_s

    # ------------------------------------------------------------------------------ existence

    def _exists_many(self, submitted: float, keys: List[CacheEngineKey]) -> List[bool]:
        n = len(keys)
        try:
            # One that waited for a thread past the lookup's deadline is "not there", at once.
            if n == 0 or self._closed or time.monotonic() - submitted > self.lookup_timeout_s:
                return [False] * n
            found = self.client.exists_keys(self.ns, [self._key(k) for k in keys], timeout_s=self.lookup_timeout_s)
            found = [bool(f) for f in found]
            self._count(exists=n, hits=sum(found))
            return found
        except Exception as e:  # noqa: BLE001 - never raise into LMCache
            self._warn("exists", e)
            return [False] * n

    @staticmethod
    def _leading(found: List[bool]) -> int:
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    async def exists(self, key: CacheEngineKey) -> bool:
        try:
            return (await self._offload(self._exists_many, [key], pool=self._lookup_pool))[0]
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._warn("exists", e)
            return False

    def exists_sync(self, key: CacheEngineKey) -> bool:
        """Synchronous (LMCache's `use_exists_sync`): answers on the caller's thread."""
        return self._exists_many(time.monotonic(), [key])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        return self._leading(self._exists_many(time.monotonic(), list(keys)))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        try:
            return self._leading(await self._offload(self._exists_many, list(keys), pool=self._lookup_pool))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._warn("batched_async_contains", e)
            return 0

    # ------------------------------------------------------------------------------ put

    def _header(self, obj: MemoryObj, nbytes: int) -> Optional[bytes]:
        shape = [int(d) for d in obj.get_shape()]
        dtype = DTYPE_TO_INT.get(obj.get_dtype())
        if dtype is None or len(shape) > 4 or not shape:
            return None
        fmt = obj.get_memory_format()
        return _HEADER.pack(_MAGIC, _VERSION, int(fmt.value), dtype, len(shape), nbytes,
                            *(shape + [0] * (4 - len(shape)))).ljust(HEADER_BYTES, b"\0")

    def _put_many(self, submitted: float, keys: List[CacheEngineKey], objs: List[MemoryObj]) -> List[bool]:
        n = len(keys)
        try:
            if n == 0 or self._closed or self._late(submitted):
                return [False] * n
            headers = np.zeros((n, HEADER_BYTES), np.uint8)
            idx, ekeys, segs = [], [], []
            for i, (key, obj) in enumerate(zip(keys, objs)):
                raw = getattr(obj, "raw_data", None)
                nbytes = int(obj.get_size())
                hdr = self._header(obj, nbytes)
                if (hdr is None or raw is None or getattr(raw, "device", None) is None or raw.device.type != "cpu"
                        or not 0 < nbytes <= self.full_bytes or nbytes % self.single_token_size
                        or obj.get_memory_format() != self.meta_fmt):
                    continue  # not a chunk of this deployment: not stored
                headers[i] = np.frombuffer(hdr, np.uint8)
                seg = [(headers[i].ctypes.data, HEADER_BYTES), (int(obj.data_ptr), nbytes)]
                if nbytes < self.full_bytes:
                    seg.append((self._zeros.ctypes.data, self.full_bytes - nbytes))
                idx.append(i)
                ekeys.append(self._key(key))
                segs.append(seg)
            out = [False] * n
            if segs:
                ok = self.client.store_keys_segments(self.ns, ekeys, segs, timeout_s=self.timeout_s)
                for i, o in zip(idx, ok):
                    out[i] = bool(o)
            self._count(puts=n, stored=sum(out))
            if not all(out):
                self._warn("put")
            return out
        except Exception as e:  # noqa: BLE001
            self._warn("put", e)
            return [False] * n

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Stores one chunk. The chunk's reference is LMCache's wrapper's to release, not ours."""
        try:
            await self._offload(self._put_many, [key], [memory_obj])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._warn("put", e)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        try:
            await self._offload(self._put_many, list(keys), list(memory_objs))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._warn("batched_put", e)

    # ------------------------------------------------------------------------------ get

    def _get_many(self, submitted: float, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """Chunks of `keys`, allocated from LMCache's local CPU backend (None for a miss: nothing
        of ours is left allocated for it)."""
        n = len(keys)
        objs: List[Optional[MemoryObj]] = [None] * n
        try:
            if n == 0 or self._closed or self._late(submitted):
                return objs
            for i in range(n):
                # No busy loop: a chunk that does not fit now is a miss, not a wait.
                obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt,
                                                      busy_loop=False)
                if obj is None:
                    break
                objs[i] = obj
                if int(obj.get_size()) != self.full_bytes or obj.raw_data.device.type != "cpu":
                    raise RuntimeError(f"LMCache allocated {obj.get_size()} bytes; a chunk is {self.full_bytes}")
            m = sum(o is not None for o in objs)
            if m == 0:
                return objs
            headers = np.zeros((m, HEADER_BYTES), np.uint8)
            segs = [[(headers[i].ctypes.data, HEADER_BYTES), (int(objs[i].data_ptr), self.full_bytes)]
                    for i in range(m)]
            got = self.client.load_keys_into_segments(self.ns, [self._key(k) for k in keys[:m]], segs,
                                                      timeout_s=self.timeout_s)
            for i in range(m):
                if not (got[i] and self._accept(objs, i, headers[i].tobytes())):
                    objs[i].ref_count_down()
                    objs[i] = None
            self._count(gets=n, got=sum(o is not None for o in objs))
            return objs
        except Exception as e:  # noqa: BLE001
            self._warn("get", e)
            self._release(objs)
            return [None] * n

    def _accept(self, objs: List[Optional[MemoryObj]], i: int, header: bytes) -> bool:
        """Checks a loaded chunk's header; a partial chunk takes its own shape."""
        magic, version, fmt, dtype, ndim, nbytes, *shape = _HEADER.unpack_from(header)
        if magic != _MAGIC or version != _VERSION or fmt != self.meta_fmt.value or dtype != self.dtype_code:
            return False
        if not 0 < ndim <= 4 or not 0 < nbytes <= self.full_bytes or nbytes % self.single_token_size:
            return False
        shape = tuple(shape[:ndim])
        if nbytes < self.full_bytes:
            if len(self.meta_shapes) != 1:
                return False
            objs[i] = self.reshape_partial_chunk(objs[i], nbytes)
        return tuple(int(d) for d in objs[i].get_shape()) == shape

    @staticmethod
    def _release(objs) -> None:
        for o in objs or []:
            if o is not None:
                try:
                    o.ref_count_down()
                except Exception:  # noqa: BLE001
                    pass

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        try:
            return (await self._offload(self._get_many, [key], orphan=self._release))[0]
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._warn("get", e)
            return None

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        try:
            return await self._offload(self._get_many, list(keys), orphan=self._release)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._warn("batched_get", e)
            return [None] * len(keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The leading chunks found; the ones after the first miss are released."""
        try:
            objs = await self._offload(self._get_many, list(keys), orphan=self._release)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._warn("batched_get_non_blocking", e)
            return []
        lead = self._leading([o is not None for o in objs])
        self._release(objs[lead:])
        return list(objs[:lead])

    # ------------------------------------------------------------------------------ the rest

    async def list(self) -> List[str]:
        return []

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return False

    def support_ping(self) -> bool:
        return False

    async def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False)
        self._lookup_pool.shutdown(wait=False)


def _clean(s: str) -> str:
    return s.replace(";", ",").replace("=", "-")
