"""Drives vLLM 0.33's real scheduler-side offloading code on a CPU, for test_vllm.py.

vLLM's wheel cannot run a model without a GPU, but its Scheduler, OffloadingConnector (scheduler
role) and TieringOffloadingManager run anywhere. What a GPU worker would do is played here: it
writes bytes into the CPU tier's rows for each store job and reports jobs as completed, the way
the model runner's `KVConnectorOutput` does. The model is a directory holding only a tiny Llama
`config.json` (nothing is downloaded).
"""

import json
import os
import time
import types

import numpy as np
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from servers import HungServer, KvServer  # noqa: F401  (test_vllm uses them as h.KvServer, h.HungServer)

BLOCK = 16  # tokens per vLLM block (one block per offload chunk here)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
END = ScheduleEndContext([], [])


def tier_config(addr, **kw):
    """A `secondary_tiers` entry for the kvtier tier, with short deadlines for tests."""
    return {"type": "KvtierTier", "module_path": "kvtier.vllm", "server": addr, "tenant": "acme",
            "timeout_s": 2.0, "lookup_timeout_s": 0.5, **kw}


# --------------------------------------------------------------------- the tiering manager (T1)


def offloading_spec(model="tiny-llama", dtype="bfloat16", chunk_bytes=4096):
    """The part of an OffloadingSpec a secondary tier reads (`.config`), for one full-attention
    group of 16-token blocks, one block per chunk, TP 1."""
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=tuple(LAYERS), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="t1",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )
    return types.SimpleNamespace(config=cfg)


class _Region:
    """Stands in for vLLM's shared-memory region: the primary tier only asks it for its view."""

    def __init__(self, arr):
        self.arr = arr

    def create_kv_memoryview(self):
        return memoryview(self.arr)

    def cleanup(self):
        pass


def make_manager(addr, *, num_chunks=8, chunk_bytes=4096, spec=None, **tier_kw):
    """A TieringOffloadingManager over a CPU primary tier of `num_chunks` rows, with the kvtier
    tier created by vLLM's own factory from its module path. Returns (manager, tier, rows)."""
    arr = np.zeros((num_chunks, chunk_bytes), np.int8)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=num_chunks, mmap_region=_Region(arr))
    spec = spec or offloading_spec(chunk_bytes=chunk_bytes)
    tier = SecondaryTierFactory.create_secondary_tier(tier_config(addr, **tier_kw), primary.get_kv_memoryview(), spec)
    return TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0), tier, arr.view(np.uint8)


def wait_idle(manager, timeout_s=15.0):
    """Steps the manager until no job is in flight (a step end first submits the promotions that
    this step's lookups started)."""
    deadline = time.monotonic() + timeout_s
    manager.on_schedule_end(END)
    while manager.has_pending_work():
        if time.monotonic() > deadline:
            raise AssertionError("tier jobs still pending")
        manager.on_schedule_end(END)
        time.sleep(0.01)
    manager.on_schedule_end(END)


def store_through(manager, rows, keys, req_id="writer", seed=0):
    """Stores chunks the way vLLM does: the GPU worker fills primary rows (random bytes here),
    complete_store cascades them to the tier. Returns {key: bytes}."""
    rng = np.random.default_rng(seed)
    ctx = ReqContext(req_id)
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    written = {}
    for key, chunk in zip(out.keys_to_store, out.store_spec.block_ids):
        rows[chunk] = rng.integers(0, 256, rows.shape[1], dtype=np.uint8)
        written[key] = rows[chunk].tobytes()
    manager.complete_store(out.keys_to_store, ctx, True)
    manager.on_request_finished(ctx)
    wait_idle(manager)
    return written


def lookup_until(manager, keys, req_id, want, timeout_s=10.0):
    """Looks `keys` up once per step until every answer is in `want` (a set of LookupResults).
    Returns (the per-step answers, the last answers)."""
    ctx = ReqContext(req_id)
    manager.on_new_request(ctx)
    history = []
    deadline = time.monotonic() + timeout_s
    while True:
        answers = [manager.lookup(k, ctx) for k in keys]
        history.append(answers)
        if all(a in want for a in answers):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"lookups never settled: {history[-5:]}")
        manager.on_schedule_end(END)
        time.sleep(0.02)
    return ctx, history, answers


# ------------------------------------------------------------------------- the scheduler (T2)


def write_model_dir(path, name="tiny-llama"):
    """A directory with only a tiny Llama config.json: enough for vLLM's ModelConfig."""
    d = os.path.join(str(path), name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "num_hidden_layers": 2, "head_dim": 16, "vocab_size": 1000,
                   "max_position_embeddings": 2048, "torch_dtype": "float32"}, f)
    return d


class Engine:
    """One vLLM engine's scheduler with the OffloadingConnector, the TieringOffloadingSpec and the
    kvtier tier loaded by module path, plus a stand-in GPU worker."""

    def __init__(self, model_dir, tier, *, engine_id, hash_algo="sha256", request_hash=None, num_blocks=256):
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}
        self.config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=2048),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo),
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                kv_connector_extra_config=extra, engine_id=engine_id),
            device_config=DeviceConfig("cpu"),
        )
        self.config.cache_config.num_gpu_blocks = num_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(LAYERS, FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                                                                         dtype=torch.float32))],
        )
        self.scheduler = Scheduler(self.config, kv_cache_config, StructuredOutputManager(self.config), block_size=BLOCK)
        self.connector = self.scheduler.connector
        self.manager = self.connector.connector_scheduler.manager
        self.tier = self.manager.secondary_tiers[0]
        # As EngineCore does after building the scheduler.
        hash_fn = get_hash_fn_by_name(request_hash or hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self._completed = {}  # job id -> step at which the stand-in worker reports it
        self.step_no = 0
        self.written = {}  # CPU chunk id -> bytes the stand-in worker put there
        self.stored_chunks = []  # CPU chunk ids of store jobs, in order
        self.loaded = {}  # load job id -> bytes of its CPU rows when the worker copied them

    def rows(self):
        return np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)

    def request(self, req_id, tokens, *, max_tokens=1, cache_salt=None):
        r = Request(req_id, list(tokens), SamplingParams(max_tokens=max_tokens), None, cache_salt=cache_salt,
                    block_hasher=self.hasher)
        self.scheduler.add_request(r)
        return r

    def step(self, *, hold_loads=False):
        """One engine step: schedule, play the worker (fill stored rows, finish loads), feed the
        output back. Returns (scheduler_output, metadata)."""
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        rows = self.rows()
        rng = np.random.default_rng(1000 + self.step_no)
        done, recving = dict(self._completed), set()
        self._completed = {}
        for job_id, job in meta.store_jobs.items():
            for chunk in job.dst_spec.block_ids:  # GPU -> CPU copy
                rows[chunk] = rng.integers(0, 256, rows.shape[1], dtype=np.uint8)
                self.written[int(chunk)] = rows[chunk].tobytes()
                self.stored_chunks.append(int(chunk))
            self._completed[job_id] = 1  # reported with the next step's output, as a real worker
        if not hold_loads:
            for job_id, job in meta.load_jobs.items():  # CPU -> GPU copy, done within the step
                self.loaded[job_id] = [rows[c].tobytes() for c in job.src_spec.block_ids]
                done[job_id] = 1
                recving.add(job.req_id)
        del rows
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=recving,
                kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done),
            ),
        )
        self.scheduler.update_from_output(so, out)
        self.step_no += 1
        return so, meta

    def run(self, req, *, max_steps=200, until=None):
        """Steps until `req` is finished (or `until()` holds) and no tier job is in flight.
        Returns the per-step scheduled token counts of `req` and the load jobs seen."""
        scheduled, loads = [], []
        for _ in range(max_steps):
            so, meta = self.step()
            scheduled.append(so.num_scheduled_tokens.get(req.request_id, 0))
            loads.extend(meta.load_jobs.values())
            done = until() if until else req.is_finished()
            if done and not self._completed and not self.manager.has_pending_work():
                return scheduled, loads
            time.sleep(0.01)
        raise AssertionError(f"request {req.request_id} did not finish: {scheduled[-10:]}")

    def shutdown(self):
        # Unlinks /dev/shm/vllm_offload_<engine_id>.mmap.
        self.connector.shutdown()
