"""kvtier as a secondary tier of vLLM's KV offloading (vLLM 0.33, `OffloadingConnector` with
`TieringOffloadingSpec`).

vLLM's own CPU tier copies KV between the GPU and a shared-memory region of fixed-size chunks;
this tier moves whole chunks between that region and a kvtier server, in the scheduler process,
on a small pool of worker threads. One `--kv-transfer-config` line, no vLLM patch:

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":34359738368,
      "secondary_tiers":[{"type":"KvtierTier","module_path":"kvtier.vllm","server":"127.0.0.1:7070",
      "tenant":"acme"}]}}'

Tier options (the keys of its `secondary_tiers` entry besides `type` and `module_path`):

    server        kvtier address host:port (required)
    tenant        kvtier tenant (default "default")
    salt          per-tenant secret mixed into every key (str or bytes, at most 64 bytes)
    timeout_s     deadline of one store/load job's I/O (default 5 s; vLLM itself waits forever)
    queue_timeout_s  a job still queued this long after submission fails without I/O (default 10 s)
    lookup_timeout_s deadline of an existence lookup; past it the chunk is a MISS (default 1 s)
    connections   client connections (default 4)
    io_threads    worker threads moving chunks (default 4)
    auth_token    kvtier bearer token
    codec         "raw" (the only codec for an engine's opaque chunks; others make an always-empty tier)
    model, revision, hash_algo   override what is read from vLLM's config (see below)
    locality      "REMOTE" (default) or "LOCAL"

Keys are vLLM's own `OffloadKey`s (the chained block hash of a chunk's last block, which already
covers the token ids, LoRA, multimodal inputs and `cache_salt`, plus the KV-cache group index),
stored as opaque kvtier keys. What those hashes do not cover goes into the kvtier namespace, so two
deployments only share chunks when their bytes are interchangeable: model id and revision, KV
dtype, tokens per block, blocks per chunk, chunk bytes, KV-cache layout and groups, the canonical
or replicated host layout, TP/PP/PCP/DCP sizes (unless vLLM says the chunk bytes are
parallelism-agnostic), and the block-hash algorithm.

Same node: when vLLM's CPU-tier region is a shared mapping of its `/dev/shm/vllm_offload_<engine_id>.mmap`
(as vLLM makes it), the tier registers that memory with the client (`Client.register_region`), so
when the kvtier server runs on this host each chunk moves between kvtier and vLLM's own rows over
the server's same-node socket: the server copies it straight into (or out of) the file with
`pread`/`pwrite`, one copy, no staging buffer, no payload on a socket. Otherwise (another host, no
socket) jobs go over TCP as before; `client.samenode_stats()` says which and why.

Never breaks the engine: no method raises into vLLM (an exception in connector code kills vLLM's
EngineCore); a dead, slow or restarting server gives misses and failed jobs, every submitted job
is reported once by `get_finished_jobs`, and a lookup is a MISS once `lookup_timeout_s` passed.
xxhash block hashing (`--prefix-caching-hash-algo xxhash*`) is refused unless PYTHONHASHSEED is
set: vLLM then seeds it per process, and no other process would ever hit (the tier logs an error
and behaves as an always-empty tier).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np

try:
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingHistogramMetadata,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"kvtier.vllm needs vLLM 0.33 (vllm.v1.kv_offload.tiering): {e}") from e

import kvtier

logger = logging.getLogger("vllm.kvtier")

__all__ = ["KvtierTier", "namespace_fields"]

# Block-hash length (bytes) of each vLLM hash algorithm; an OffloadKey adds a 4-byte group index.
_HASH_BYTES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}
_GROUP_IDX_BYTES = 4

# kvtier's names for vLLM's KV dtypes; any other dtype still goes into the namespace verbatim.
_KV_DTYPES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp16": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "fp32": "fp32",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
}

_MAX_MODEL_LEN = 256
_MAX_ENGINE_LEN = 1024

# Metric names (declared in build_metric_definitions, reported by get_stats).
M_LOOKUP_KEYS = "vllm:kv_offload_kvtier_lookup_keys"
M_LOOKUP_HITS = "vllm:kv_offload_kvtier_lookup_hits"
M_LOOKUP_TIMEOUTS = "vllm:kv_offload_kvtier_lookup_timeouts"
M_LOOKUP_ERRORS = "vllm:kv_offload_kvtier_lookup_errors"
M_LOOKUP_SECONDS = "vllm:kv_offload_kvtier_lookup_seconds"
M_STORE_JOBS = "vllm:kv_offload_kvtier_store_jobs"
M_STORE_FAILED = "vllm:kv_offload_kvtier_store_jobs_failed"
M_STORE_BYTES = "vllm:kv_offload_kvtier_store_bytes"
M_LOAD_JOBS = "vllm:kv_offload_kvtier_load_jobs"
M_LOAD_FAILED = "vllm:kv_offload_kvtier_load_jobs_failed"
M_LOAD_BYTES = "vllm:kv_offload_kvtier_load_bytes"
M_JOB_SECONDS = "vllm:kv_offload_kvtier_job_seconds"


def _short(s: str, limit: int) -> str:
    """`s`, or a prefix of it plus a digest of the whole when it is longer than `limit`."""
    if len(s.encode()) <= limit:
        return s
    digest = hashlib.sha256(s.encode()).hexdigest()[:16]
    return s.encode()[: limit - 17].decode(errors="ignore") + "#" + digest


def _clean(s: str) -> str:
    """`s` without the separators of kvtier's identity string."""
    return str(s).replace(";", ",").replace("=", ":")


def _find_vllm_config(max_depth: int = 40):
    """The `VllmConfig` being built into an engine, found in the callers' frames (the
    OffloadingConnector's constructor holds it); None when not found. The tier only receives the
    offloading spec, which lacks the hash algorithm and the model revision."""
    try:
        from vllm.config import VllmConfig
    except Exception:
        return None
    try:
        frame = sys._getframe(2)
    except Exception:
        return None
    try:
        depth = 0
        while frame is not None and depth < max_depth:
            for name in ("vllm_config", "config"):
                value = frame.f_locals.get(name)
                if isinstance(value, VllmConfig):
                    return value
            frame = frame.f_back
            depth += 1
        return None
    finally:
        del frame


def namespace_fields(offloading_spec, chunk_bytes: int, *, model=None, revision=None, hash_algo=None,
                     vllm_config=None) -> dict:
    """What identifies a chunk's bytes beside vLLM's block hash, as keyword arguments of
    `kvtier.Namespace.opaque` (without tenant, salt and codec). Pure: no I/O, may raise."""
    cfg = offloading_spec.config
    if vllm_config is not None:
        mc = getattr(vllm_config, "model_config", None)
        if revision is None and mc is not None:
            revision = getattr(mc, "revision", None)
        if hash_algo is None:
            cc = getattr(vllm_config, "cache_config", None)
            hash_algo = getattr(cc, "prefix_caching_hash_algo", None)
    hash_algo = str(hash_algo or "sha256")
    model_id = str(model or cfg.model.name)
    if revision:
        model_id = f"{model_id}@{revision}"
    par = cfg.parallel
    agnostic = bool(par.is_parallelism_agnostic or cfg.replicated_layout)
    groups = "+".join(f"{g.group_id}x{g.tokens_per_block}x{len(g.layer_names)}" for g in cfg.groups)
    layer_digest = hashlib.sha256(
        "|".join(",".join(g.layer_names) for g in cfg.groups).encode()
    ).hexdigest()[:12]
    canonical = "0"
    if cfg.canonical_layout:
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
                canonical_format_id,
            )

            canonical = canonical_format_id(cfg.kv_cache_layout)
        except Exception:
            canonical = f"1-{cfg.kv_cache_layout}"
    dtype = str(cfg.model.dtype).removeprefix("torch.")
    tokens_per_block = cfg.groups[0].tokens_per_block if cfg.groups else cfg.cache.tokens_per_hash
    # kvtier keeps ';' and '=' for its own identity string: fields are `name:value`, '|'-separated.
    engine_layout = "|".join(
        f"{k}:{v}"
        for k, v in (
            ("tiering", "v1"),
            ("layout", cfg.kv_cache_layout),
            ("canonical", canonical),
            ("replicated", int(bool(cfg.replicated_layout))),
            ("agnostic", int(agnostic)),
            ("dtype", dtype),
            ("tokens_per_block", tokens_per_block),
            ("tokens_per_hash", cfg.cache.tokens_per_hash),
            ("blocks_per_chunk", cfg.cache.blocks_per_chunk),
            ("chunk_bytes", chunk_bytes),
            ("worker_kv_bytes_per_block", cfg.worker_kv_bytes_per_block),
            ("world", 1 if agnostic else par.world_size),
            ("pcp", 1 if agnostic else par.pcp_size),
            ("dcp", 1 if agnostic else par.dcp_size),
            ("groups", groups),
            ("layers", layer_digest),
        )
    )
    return dict(
        model=_short(model_id, _MAX_MODEL_LEN),
        block_bytes=int(chunk_bytes),
        engine="vllm",
        engine_layout=_clean(_short(engine_layout, _MAX_ENGINE_LEN - 96)),
        kv_dtype=_clean(_KV_DTYPES.get(dtype.lower(), dtype)),
        page_tokens=int(tokens_per_block * cfg.cache.blocks_per_chunk),
        tp_rank=0,  # a chunk holds every TP rank's pages (the scheduler is rank 0)
        tp_world=1 if agnostic else int(par.tp_size),
        pp_rank=0,
        pp_world=1 if agnostic else int(par.pp_size),
        hash_algo=_clean(hash_algo),
    )


class _Counters:
    """Thread-safe metric observations, taken (and reset) by get_stats."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counters: dict[str, float] = {}
        self._hist: dict[str, list[float]] = {}

    def add(self, name, value=1):
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + value

    def observe(self, name, value):
        with self._lock:
            self._hist.setdefault(name, []).append(value)

    def take(self):
        with self._lock:
            c, h = self._counters, self._hist
            self._counters, self._hist = {}, {}
        return c, h


class _KvtierLookup(AsyncLookupManager):
    """vLLM's async lookup helper: one `exists_keys` call per request per step, on its thread."""

    def __init__(self, tier: "KvtierTier", tier_type: str):
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._batch_lookup(keys)


class KvtierTier(SecondaryTierManager):
    """A vLLM secondary tier backed by a kvtier server (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector=None,
        server: str | None = None,
        tenant: str = "default",
        salt: str | bytes = b"",
        timeout_s: float = 5.0,
        queue_timeout_s: float = 10.0,
        lookup_timeout_s: float = 1.0,
        connections: int = 4,
        io_threads: int = 4,
        auth_token: str | None = None,
        codec: str = "raw",
        model: str | None = None,
        revision: str | None = None,
        hash_algo: str | None = None,
        locality: str | None = "REMOTE",
        **unknown: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # State every method relies on, set before anything that can fail.
        self._disabled: str | None = None
        self._closed = False
        self._client = None
        self._ns = None
        self._lookup = None
        self._pool = None
        self._rows = None
        self._regions: list = []
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs_lock = threading.Lock()
        self._outstanding: dict[int, concurrent.futures.Future | None] = {}
        self._load_keys: dict[int, list] = {}
        self._cancel_queued = threading.Event()
        self._pending_since: dict[bytes, float] = {}
        self._counters = _Counters()
        self._logged: set[str] = set()
        self.hash_algo: str | None = None
        self._hash_bytes: int | None = None
        self.namespace_fields: dict = {}
        self.timeout_s, self.queue_timeout_s, self.lookup_timeout_s = 5.0, 10.0, 1.0
        self.server = server
        self.tenant = tenant
        self.locality = Locality.REMOTE
        try:
            self.locality = Locality(str(locality).upper()) if locality else None
            self.timeout_s = float(timeout_s)
            self.queue_timeout_s = float(queue_timeout_s)
            self.lookup_timeout_s = float(lookup_timeout_s)
            if min(self.timeout_s, self.queue_timeout_s, self.lookup_timeout_s) <= 0:
                raise ValueError("timeouts must be positive")
            self._setup(offloading_spec, primary_kv_view, server, tenant, salt, connections, io_threads,
                        auth_token, codec, model, revision, hash_algo, unknown)
        except Exception as e:  # never raise into vLLM: an always-miss tier instead
            self._disable(f"setup failed: {e!r}")
            logger.exception("kvtier tier: setup failed; the tier answers MISS and fails every job")

    # ------------------------------------------------------------------ setup

    def _setup(self, spec, view, server, tenant, salt, connections, io_threads, auth_token, codec,
               model, revision, hash_algo, unknown):
        if unknown:
            logger.warning("kvtier tier: ignoring unknown options %s", sorted(unknown))
        if not server:
            self._disable("no `server` in the tier config")
            logger.error('kvtier tier: the tier config needs "server": "host:port"; the tier stays empty')
            return
        # The primary region as rows of bytes (a 2-D memoryview cannot be row-sliced itself).
        arr = np.asarray(view)
        if arr.ndim != 2:
            raise ValueError(f"primary view has {arr.ndim} dimensions, expected 2")
        rows = arr.view(np.uint8).reshape(arr.shape[0], -1)
        if rows.strides[0] != self.block_size_bytes or rows.shape[1] != self.block_size_bytes:
            raise ValueError(f"primary rows are {rows.shape[1]} bytes apart by {rows.strides[0]}, "
                             f"chunk bytes {self.block_size_bytes}")
        self._rows = rows
        vllm_config = _find_vllm_config()
        fields = namespace_fields(spec, self.block_size_bytes, model=model, revision=revision,
                                  hash_algo=hash_algo, vllm_config=vllm_config)
        self.hash_algo = fields["hash_algo"]
        self._hash_bytes = _HASH_BYTES.get(self.hash_algo)
        if self.hash_algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
            self._disable("xxhash without PYTHONHASHSEED")
            logger.error(
                "kvtier tier: vLLM hashes blocks with %s, seeded per process unless PYTHONHASHSEED "
                "is set, so no other process could ever hit. Set PYTHONHASHSEED to one value on every "
                "vLLM instance, or use --prefix-caching-hash-algo sha256. The tier stays empty.",
                self.hash_algo,
            )
            return
        if isinstance(salt, str):
            salt = salt.encode()
        self.namespace_fields = dict(fields, tenant=tenant, salt=bytes(salt), codec=codec)
        model_id = fields.pop("model")
        self._ns = kvtier.Namespace.opaque(tenant, model_id, salt=bytes(salt), codec=codec, **fields)
        self._client = kvtier.Client(server, never_raise=True, timeout_s=self.timeout_s,
                                     connections=int(connections), auth_token=auth_token)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, int(io_threads)),
                                                           thread_name_prefix="kvtier-vllm-io")
        self._lookup = _KvtierLookup(self, self.tier_type)
        self._register_region(rows)
        ns_id = getattr(self._ns, "id", "?")
        logger.info("kvtier tier: server %s, tenant %s, namespace %s (%s)", server, tenant,
                    ns_id() if callable(ns_id) else ns_id, self.namespace_fields)

    def _register_region(self, rows) -> None:
        """Registers vLLM's own CPU-tier memory (its shared `/dev/shm/vllm_offload_<engine_id>.mmap`)
        with the client, so jobs move chunks between kvtier and those rows over the server's
        same-node socket when it runs on this host: the server copies each chunk straight into
        (or out of) the file, one copy, no staging buffer. Memory that is not such a mapping (a
        test's plain array) just goes over TCP.

        A large region is several files back to back (vLLM's segments, 1 GiB or more each): each
        run of rows backed by one file is registered on its own, and a job whose chunks span two
        of them goes over TCP."""
        n, start = rows.shape[0], 0
        try:
            while start < n:
                end = self._longest_registrable(rows, start)
                if end == start:
                    break
                self._regions.append(self._client.register_region(rows[start:end]))
                start = end
        except Exception as e:
            self._log_once("region", "kvtier tier: registering the CPU tier's region failed: %r", e)
        if self._regions:
            logger.info("kvtier tier: the CPU tier's region (%d bytes, %d file(s)) is registered for the "
                        "same-node path", rows[:start].nbytes, len(self._regions))
        else:
            logger.debug("kvtier tier: the CPU tier's region is not a shared file mapping; jobs go over TCP")

    def _longest_registrable(self, rows, start: int) -> int:
        """The largest `end` such that rows[start:end] lie in one shared file mapping (`start` when
        not even one row does)."""
        def ok(end):
            try:
                self._client.register_region(rows[start:end])
                return True
            except ValueError:
                return False
        n = rows.shape[0]
        if ok(n):
            return n
        lo, hi = start, n  # rows[start:lo] registrable (or lo == start), rows[start:hi] not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _disable(self, why: str) -> None:
        if self._disabled is None:
            self._disabled = why

    @property
    def disabled(self) -> str | None:
        """Why the tier is always empty (a config problem), or None when it works."""
        return self._disabled

    def _log_once(self, tag, msg, *args, level=logging.WARNING):
        if tag not in self._logged:
            self._logged.add(tag)
            logger.log(level, msg, *args)

    def _key_ok(self, key) -> bool:
        """A key this tier can serve: vLLM's OffloadKey of the expected hash length."""
        if self._hash_bytes is None:
            return isinstance(key, (bytes, bytearray))
        if isinstance(key, (bytes, bytearray)) and len(key) == self._hash_bytes + _GROUP_IDX_BYTES:
            return True
        n = len(key) - _GROUP_IDX_BYTES if isinstance(key, (bytes, bytearray)) else None
        if n == 16 and os.environ.get("PYTHONHASHSEED") is None:
            self._disable("xxhash block hashes without PYTHONHASHSEED")
        self._log_once(
            "keylen", "kvtier tier: a block hash of %s bytes, not the %d bytes of %s: set hash_algo in "
            "the tier config to vLLM's --prefix-caching-hash-algo (and PYTHONHASHSEED for xxhash). "
            "Such chunks are misses.", n, self._hash_bytes, self.hash_algo, level=logging.ERROR)
        return False

    # ------------------------------------------------------------------ lookups

    def _batch_lookup(self, keys: list) -> list[bool]:
        """On the lookup thread: which keys the server holds; all False on any failure."""
        n = len(keys)
        try:
            if self._disabled or self._client is None or self._closed:
                return [False] * n
            now = time.monotonic()
            # A batch whose every key waited past the deadline is already a MISS for vLLM.
            since = [self._pending_since.get(k) for k in keys]
            if since and all(t is not None and now - t > self.lookup_timeout_s for t in since):
                self._counters.add(M_LOOKUP_TIMEOUTS, n)
                return [False] * n
            ask = [i for i, k in enumerate(keys) if self._key_ok(k)]
            out = [False] * n
            if ask:
                misses = self._miss_count()
                t0 = time.monotonic()
                got = self._client.exists_keys(self._ns, [bytes(keys[i]) for i in ask],
                                               timeout_s=self.lookup_timeout_s)
                self._counters.observe(M_LOOKUP_SECONDS, time.monotonic() - t0)
                got = list(got)
                if len(got) != len(ask):
                    raise RuntimeError(f"exists_keys answered {len(got)} of {len(ask)} keys")
                for i, hit in zip(ask, got):
                    out[i] = bool(hit)
                if not any(got) and self._miss_count() > misses:
                    self._counters.add(M_LOOKUP_ERRORS)
                    self._log_once("lookup-miss", "kvtier tier: lookups fail (%s); answering MISS",
                                   self._last_miss())
            self._counters.add(M_LOOKUP_KEYS, n)
            self._counters.add(M_LOOKUP_HITS, sum(out))
            return out
        except Exception as e:
            self._counters.add(M_LOOKUP_ERRORS)
            self._log_once("lookup-exc", "kvtier tier: lookup failed (%r); answering MISS", e)
            return [False] * n

    def _miss_count(self) -> int:
        try:
            return sum(self._client.misses.values())
        except Exception:
            return 0

    def _last_miss(self):
        try:
            return self._client.last_miss
        except Exception:
            return None

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            if self._disabled or self._lookup is None or self._closed or not self._key_ok(key):
                return LookupResult.MISS
            found = self._lookup.lookup(key, req_context)
            if found is None:
                now = time.monotonic()
                first = self._pending_since.setdefault(key, now)
                if now - first > self.lookup_timeout_s:
                    # Bounded: never RETRY past the deadline (vLLM would re-ask every step).
                    self._counters.add(M_LOOKUP_TIMEOUTS)
                    self._log_once("lookup-timeout", "kvtier tier: lookups past %.3f s; answering MISS",
                                   self.lookup_timeout_s)
                    return LookupResult.MISS
                return LookupResult.RETRY
            self._pending_since.pop(key, None)
            return LookupResult.HIT if found else LookupResult.MISS
        except Exception as e:
            self._log_once("lookup-api-exc", "kvtier tier: lookup raised %r; answering MISS", e)
            return LookupResult.MISS

    # ------------------------------------------------------------------ jobs

    def _report(self, job_id, success, successful_keys=None, transfer_time=None, transfer_bytes=None):
        self._results.put(JobResult(job_id=job_id, success=bool(success), successful_keys=successful_keys,
                                    transfer_time=transfer_time, transfer_bytes=transfer_bytes))

    def _submit(self, job: TransferJob, load: bool) -> None:
        job_id = getattr(job, "job_id", None)
        try:
            keys = list(job.keys)
            chunk_ids = [int(c) for c in np.asarray(job.chunk_ids).reshape(-1)]
            with self._jobs_lock:
                if job_id in self._outstanding:
                    self._log_once("dup-job", "kvtier tier: job %s submitted twice", job_id)
                    return
                self._outstanding[job_id] = None
                if load:
                    self._load_keys[job_id] = keys
            self._counters.add(M_LOAD_JOBS if load else M_STORE_JOBS)
            ok = (
                not self._disabled
                and not self._closed
                and self._pool is not None
                and len(keys) == len(chunk_ids)
                and all(0 <= c < self._rows.shape[0] for c in chunk_ids)
            )
            if not ok:
                if len(keys) != len(chunk_ids):
                    self._log_once("shape", "kvtier tier: job with %d keys and %d chunks", len(keys),
                                   len(chunk_ids), level=logging.ERROR)
                self._report(job_id, False)
                return
            submitted = getattr(job, "submit_time", None) or time.monotonic()
            fut = self._pool.submit(self._run, job_id, keys, chunk_ids, load, submitted)
            with self._jobs_lock:
                if job_id in self._outstanding:
                    self._outstanding[job_id] = fut
        except Exception as e:
            self._log_once("submit-exc", "kvtier tier: submitting job %s failed: %r", job_id, e)
            try:
                with self._jobs_lock:
                    self._outstanding.setdefault(job_id, None)
                self._report(job_id, False)
            except Exception:
                pass

    def _run(self, job_id, keys, chunk_ids, load, submitted):
        """On a worker thread: one job's I/O; always reports the job exactly once."""
        success, good, nbytes, t0 = False, None, 0, time.monotonic()
        try:
            if self._cancel_queued.is_set() or self._closed:
                return
            if t0 - submitted > self.queue_timeout_s:
                self._log_once("queue-timeout", "kvtier tier: a job waited %.1f s in the queue; failing "
                               "it without I/O", t0 - submitted)
                return
            ids = [i for i, k in enumerate(keys) if self._key_ok(k)]
            if len(ids) != len(keys):
                if not load or not ids:
                    return
            bufs = [self._rows[chunk_ids[i]] for i in ids]
            wire_keys = [bytes(keys[i]) for i in ids]
            if load:
                got = list(self._client.load_keys_into(self._ns, wire_keys, bufs, timeout_s=self.timeout_s))
            else:
                got = list(self._client.store_keys(self._ns, wire_keys, bufs, timeout_s=self.timeout_s))
            if len(got) != len(ids):
                raise RuntimeError(f"the client answered {len(got)} of {len(ids)} keys")
            done = [keys[i] for i, ok in zip(ids, got) if ok]
            nbytes = len(done) * self.block_size_bytes
            success = len(done) == len(keys)
            if load and not success and done:
                good = done
            if not load and not success:
                # Said once (every failure is counted in the store-failure metric): a writer whose
                # stores are all refused (a read-only grant, a full node) logged nothing before.
                self._log_once("store-failed", "kvtier tier: a store of %d chunks kept %d (last miss: %s); "
                               "later store failures are only counted", len(keys), len(done),
                               self._client.last_miss)
        except Exception as e:
            success = False
            self._log_once("job-exc", "kvtier tier: a %s job failed: %r", "load" if load else "store", e)
        finally:
            dt = time.monotonic() - t0
            try:
                self._counters.observe(M_JOB_SECONDS, dt)
                if success or good:
                    self._counters.add(M_LOAD_BYTES if load else M_STORE_BYTES, nbytes)
                if not success:
                    self._counters.add(M_LOAD_FAILED if load else M_STORE_FAILED)
            finally:
                self._report(job_id, success, good, dt if nbytes else None, nbytes or None)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        try:
            while True:
                try:
                    r = self._results.get_nowait()
                except queue.Empty:
                    break
                with self._jobs_lock:
                    if r.job_id not in self._outstanding:
                        self._log_once("dup-result", "kvtier tier: dropping a second result of job %s",
                                       r.job_id, level=logging.ERROR)
                        continue
                    del self._outstanding[r.job_id]
                    load_keys = self._load_keys.pop(r.job_id, None)
                out.append(r)
                if load_keys is not None and not r.success and self._lookup is not None:
                    # A failed promotion must not be looked up as a HIT again (vLLM's livelock #49176).
                    ok = set(r.successful_keys or ())
                    try:
                        self._lookup.mark_miss([k for k in load_keys if k not in ok])
                    except Exception:
                        pass
        except Exception as e:
            self._log_once("finished-exc", "kvtier tier: collecting finished jobs failed: %r", e)
        return out

    def has_pending_work(self) -> bool:
        try:
            with self._jobs_lock:
                return bool(self._outstanding)
        except Exception:
            return False

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (queued ones fail without I/O; a running
        one is never cut short: each is bounded by `timeout_s`)."""
        try:
            self._cancel_queued.set()
            self._wait_all()
        except Exception as e:
            self._log_once("drain-exc", "kvtier tier: drain_jobs: %r", e)
        finally:
            if not self._closed:
                self._cancel_queued.clear()

    def _wait_all(self):
        start = time.monotonic()
        warned = False
        while True:
            with self._jobs_lock:
                futs = [f for f in self._outstanding.values() if f is not None and not f.done()]
            if not futs:
                return
            concurrent.futures.wait(futs, timeout=1.0)
            if not warned and time.monotonic() - start > self.timeout_s + 5:
                warned = True
                logger.warning("kvtier tier: drain_jobs still waiting on %d jobs", len(futs))

    # ------------------------------------------------------------------ lifecycle

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        try:
            if self._lookup is not None:
                keys = self._lookup._req_keys.get(req_context.req_id, ())
                for k in keys:
                    self._pending_since.pop(k, None)
                self._lookup.cleanup(req_context.req_id)
        except Exception as e:
            self._log_once("finish-exc", "kvtier tier: on_request_finished: %r", e)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            if self._lookup is not None:
                self._lookup.flush()
        except Exception as e:
            self._log_once("flush-exc", "kvtier tier: on_schedule_end: %r", e)

    def shutdown(self) -> None:
        try:
            if self._closed:
                return
            self._closed = True
            self._cancel_queued.set()
            if self._lookup is not None:
                self._lookup.shutdown()
            self._wait_all()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            # Drop our export of the primary region, and our own mapping of its file, so vLLM can
            # unmap and unlink it and its pages are freed.
            self._rows = None
            self._regions = []
        except Exception as e:
            logger.warning("kvtier tier: shutdown: %r", e)

    # ------------------------------------------------------------------ metrics

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]):
        c, h = OffloadingCounterMetadata, OffloadingHistogramMetadata
        secs = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        return {
            M_LOOKUP_KEYS: c(documentation="Chunks kvtier was asked about."),
            M_LOOKUP_HITS: c(documentation="Chunks kvtier held when asked."),
            M_LOOKUP_TIMEOUTS: c(documentation="kvtier lookups answered MISS at the lookup deadline."),
            M_LOOKUP_ERRORS: c(documentation="kvtier lookup batches that failed (server down, timeout)."),
            M_LOOKUP_SECONDS: h(documentation="Time of one kvtier lookup batch, in seconds.", buckets=secs),
            M_STORE_JOBS: c(documentation="Store jobs submitted to kvtier."),
            M_STORE_FAILED: c(documentation="Store jobs that failed in part or whole."),
            M_STORE_BYTES: c(documentation="Bytes stored to kvtier."),
            M_LOAD_JOBS: c(documentation="Load (promotion) jobs submitted to kvtier."),
            M_LOAD_FAILED: c(documentation="Load jobs that failed in part or whole."),
            M_LOAD_BYTES: c(documentation="Bytes loaded from kvtier."),
            M_JOB_SECONDS: h(documentation="Time of one kvtier store or load job, in seconds.", buckets=secs),
        }

    def get_stats(self):
        try:
            counters, hists = self._counters.take()
            if not counters and not hists:
                return None
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
                OffloadingConnectorStats,
            )

            stats = OffloadingConnectorStats()
            for name, v in counters.items():
                stats.increase_counter(name, v)
            for name, vs in hists.items():
                for v in vs:
                    stats.observe_histogram(name, v)
            return stats
        except Exception as e:
            self._log_once("stats-exc", "kvtier tier: get_stats: %r", e)
            return None

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvtier_server", "kvtier_tenant")

    def config_info(self):
        return {"kvtier_server": str(self.server or ""), "kvtier_tenant": str(self.tenant)}
