"""The memory model of a run: bytes of every consumer, per tier, per phase, from the config alone.

Pure functions of (RunConfig, ClusterConfig, PlanOptions); nothing of the model's size is
allocated (the model is built on the meta device). Each figure uses the formula, and where possible
the very helper, of the code that allocates it:

- device weights: the policy's parameters in experiment.dtype (models/precision.py: a few stay
  FP32); the engine runs on the same tensors (rl/train.py `build`), so they count once.
- device pool: `CacheLayout.for_model` page bytes (MLA latents in the model's dtype, KDA states in
  engine.kda_state_dtype) times engine.pool_mb // page_bytes pages, as `PagePool.from_bytes`.
- device grad slots: num_grad_slots FP32 slots of the largest VPP chunk, padded to a multiple of
  the world (`split_chunks` + `ChunkedModel.chunk_parameters`, ShardedHostAdamW's padding).
- device activation peak: `rl/plan_activation.chunk_activation_peaks`, the trainer's own chunk
  forward/backward on the meta device for this rank's micro-batches, the MoE in the form the
  planned device runs (`moe_grouped_mm`).
- device reference: a resident reference (memory.reference=resident) is a second model in the
  run's dtype; a streamed one borrows the grad slots (0 extra).
- host masters / grads / moments: per chunk one FP32 shard of ceil(numel / world) elements each;
  AdamW keeps two per chunk plus a step counter (a 4-byte tensor with torch's AdamW, a python int
  with DeepSpeed's, which "auto" picks when it builds).
- host pool: engine.host_pool_mb // page_bytes pages; host parked: the KV of paused partial
  rollouts over the train phase, inside the host pool (an upper bound: how many are paused is up to
  the budget and the dispatcher).
- host reference: the streamed reference's host vectors, chunk by chunk, each parameter aligned to
  its element size, a tied head repeated in the last chunk (trainer/ref_stream.py's layout).
- disk spilled: the NVMe store's file bytes of every chunk's states (memory/spill_format.py's plan).
- time-multiplexing (memory.spill_dir and a host pool): the host pool is leased from "host_in" to
  "host_out" only; with engine.host_pool_mb=auto it is the rank's share of the host budget less what
  stays resident meanwhile (the streamed reference, the step counters). disk_kv_pool: its kept
  contents on NVMe between rollouts (the parked bound; payload bytes).

Phases follow rl/run/loop.py's loop; iteration 0 differs from the steady state (no moments
before the first step, nothing spilled yet, the pool not yet released). The keys of each phase's
dict are those `Phases.memory()` logs to phases.jsonl.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memory.layout import CacheLayout
from memory.nvme_store import NvmeStoreConfig
from memory.spill_format import spill_layout as spill_plan
from models.mlp import Experts, grouped_mm_usable
from models.model import HybridLM
from models.precision import cast_parameters, parse_dtype
from rl.config import RunConfig
from rl.plan.activation import chunk_activation_peaks
from rl.plan.cluster import GIB, ClusterConfig, PlanOptions
from memory.tiers import with_totals
from trainer.chunks import ChunkedModel
from trainer.step import micro_batches



@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What each consumer of one rank holds when present (bytes)."""

    weights: int
    pool: int
    pool_pages: int
    grad_slots: int
    activation_peak: int
    chunk_activation_peaks: list[int]
    """Per VPP chunk, its saved-tensor peak (activation_peak is their max)."""
    reference_device: int
    masters: int
    moments: int
    """exp_avg + exp_avg_sq of every chunk (without the step counters)."""
    moment_steps: int
    """The step counters (they stay resident when the states are spilled)."""
    grads: int
    host_pool: int
    parked_bound: int
    reference_host: int
    spill_files: int
    spill_payload: int
    spill_master_files: int
    """The spill before the first step (no moments yet): the masters alone (a multiplexed run's first offload)."""
    layout: CacheLayout
    micro_batches: list[list[int]]
    """This rank's trained sequence lengths per micro-batch (what the activation peak was probed on)."""

    @property
    def num_train_tokens(self) -> int:
        return sum(sum(b) for b in self.micro_batches)


def run_dtype(cfg: RunConfig) -> torch.dtype:
    return cfg.experiment.torch_dtype


def meta_policy(cfg: RunConfig) -> HybridLM:
    """The policy's shape on the meta device, parameters in the run's dtype (no storage)."""
    with torch.device("meta"):
        model = HybridLM(cfg.model)
    return cast_parameters(model, run_dtype(cfg))


def cache_layout(cfg: RunConfig) -> CacheLayout:
    """The engine's page geometry (rollout/engine.py: MLA cache in the output weight's dtype, block_tokens
    a multiple of the prefix cache's hash block when there is one)."""
    e = cfg.engine
    return CacheLayout.for_model(cfg.model, group_layers=e.group_layers, block_tokens=e.block_tokens,
                                 cache_dtype=meta_policy(cfg).output_weight.dtype,
                                 state_dtype=parse_dtype(e.kda_state_dtype),
                                 hash_block=e.prefix_cache.hash_block if e.prefix_cache else None)


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _reference_host_bytes(model: HybridLM, chunked: ChunkedModel) -> int:
    """trainer/ref_stream.py's host layout: per chunk its parameters back to back, each aligned to its
    element size; a tied head's embedding is repeated in the last chunk."""
    total = 0
    for c, spec in enumerate(chunked.specs):
        params = [p for _, p in chunked.chunk_parameters(c)]
        if spec.has_head and model.lm_head is None and not spec.has_embedding:
            params.append(model.model.embed_tokens.weight)
        offset = 0
        for p in params:
            offset = -(-offset // p.element_size()) * p.element_size() + p.numel() * p.element_size()
        total += offset
    return total


def _steps_bytes(cfg: RunConfig, num_chunks: int) -> int:
    # torch's AdamW keeps `step` as a float32 0-dim tensor per master; DeepSpeed's CPU Adam an int.
    return 4 * num_chunks if cfg.trainer.optimizer.backend == "torch" else 0


def moe_grouped_mm(model: HybridLM, cluster: ClusterConfig) -> bool:
    """Whether the planned device runs the routed experts through torch._grouped_mm: the cluster's
    GPU says (bf16 only), a device_is_host cluster asks this machine (models/mlp.py `grouped_mm_usable`)."""
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    if experts is None:
        return False
    if cluster.device_is_host:
        return grouped_mm_usable(torch.empty(0, experts.w1.shape[2], dtype=experts.w1.dtype), experts.w1)
    return cluster.grouped_mm_bf16 and experts.w1.dtype == torch.bfloat16


def train_micro_batches(cfg: RunConfig, cluster: ClusterConfig, options: PlanOptions) -> list[list[int]]:
    """Sequence lengths of this rank's micro-batches: the rank with the most groups (ceil of the
    global groups over the world) trains group_size trajectories per group, each of seq_len - 1
    tokens (inputs tokens[:-1]), packed by trainer.micro_batch_tokens as the trainer does."""
    seq_len = options.seq_len if options.seq_len is not None else cfg.engine.max_model_len
    groups = math.ceil(cfg.rollout.groups_per_iteration / cluster.world)
    lens = [seq_len - 1] * (groups * cfg.algo.group_size)
    return [[lens[i] for i in mb] for mb in micro_batches(lens, cfg.trainer.micro_batch_tokens)]


def plan_sizes(cfg: RunConfig, cluster: ClusterConfig, options: PlanOptions = PlanOptions()) -> Sizes:
    """Every consumer's bytes for one rank of `cluster` running `cfg` (see the module docstring)."""
    model = meta_policy(cfg)
    world, t = cluster.world, cfg.trainer
    chunked = ChunkedModel(model, t.num_chunks, t.chunk_split)
    numels = [sum(p.numel() for _, p in chunked.chunk_parameters(c)) for c in range(t.num_chunks)]
    shards = [math.ceil(n / world) for n in numels]
    weights = _param_bytes(model.parameters())
    layout = cache_layout(cfg)
    e = cfg.engine
    pool_pages = e.pool_bytes // layout.page_bytes
    kl = cfg.algo.loss.kl_coef > 0
    reference_host = _reference_host_bytes(model, chunked) if kl and cfg.memory.reference == "stream" else 0
    if e.host_pool_mb == "auto":  # what the ledger has free while the states are on NVMe
        rank_budget = host_budget_bytes(cfg, cluster) // cluster.gpus_per_node
        host_pages = max(0, rank_budget - reference_host - _steps_bytes(cfg, t.num_chunks)) // layout.page_bytes
    else:
        host_pages = e.host_pool_bytes // layout.page_bytes
    partial_kv = (cfg.rollout.partial_resume == "kv"
                  and (cfg.rollout.budget_tokens is not None or cfg.rollout.budget_seconds is not None))
    checksum = NvmeStoreConfig().checksum
    spill_files = spill_payload = spill_master_files = 0
    for c, shard in enumerate(shards):
        states = {k: torch.empty(shard, dtype=torch.float32, device="meta") for k in ("master", "exp_avg", "exp_avg_sq")}
        manifest = spill_plan(f"train_states.rank0.chunk{c}", states, checksum)
        spill_files += manifest.file_bytes
        spill_payload += manifest.payload_bytes
        spill_master_files += spill_plan(f"train_states.rank0.chunk{c}", {"master": states["master"]}, checksum).file_bytes
    batches = train_micro_batches(cfg, cluster, options)
    chunk_peaks = chunk_activation_peaks(cfg.model, batches, t.num_chunks, run_dtype(cfg),
                                         grouped_mm=moe_grouped_mm(model, cluster), split=t.chunk_split)
    return Sizes(
        weights=weights, pool=pool_pages * layout.page_bytes, pool_pages=pool_pages,
        grad_slots=max(s * world for s in shards) * 4 * t.num_grad_slots,
        activation_peak=max(chunk_peaks), chunk_activation_peaks=chunk_peaks,
        reference_device=weights if kl and cfg.memory.reference == "resident" else 0,
        masters=4 * sum(shards), moments=8 * sum(shards), moment_steps=_steps_bytes(cfg, t.num_chunks),
        grads=4 * sum(shards), host_pool=host_pages * layout.page_bytes,
        parked_bound=min(host_pages, pool_pages) * layout.page_bytes if partial_kv else 0,
        reference_host=reference_host,
        spill_files=spill_files if cfg.memory.spill_dir is not None else 0, spill_payload=spill_payload,
        spill_master_files=spill_master_files if cfg.memory.spill_dir is not None else 0,
        layout=layout, micro_batches=batches)


@dataclass(frozen=True)
class PhaseMemory:
    iteration: int
    """0 (the first iteration) or 1 (every later one: the steady state)."""
    phase: str
    memory: dict[str, int]
    """Bytes per consumer of one rank, the keys of phases.jsonl (`Phases.memory()`)."""


def multiplexed(cfg: RunConfig) -> bool:
    """Host DRAM time-multiplexed between the training states and the KV pool (rl/run/loop.py):
    the run spills and the engine has a host pool."""
    return cfg.memory.spill_dir is not None and cfg.has_host_pool


def host_budget_bytes(cfg: RunConfig, cluster: ClusterConfig) -> int:
    """One node's host budget: memory.host_budget_mb, else its DRAM less the ledger's 10% reserve."""
    if cfg.memory.host_budget_mb is not None:
        return cfg.memory.host_budget_mb << 20
    return int(cluster.host_dram_gib * GIB * 0.9)


def phase_names(cfg: RunConfig, world: int, iteration: int) -> list[str]:
    """The loop's phases of an iteration, in order (rl/run/loop.py `run_loop`)."""
    release, spill, mux = cfg.memory.release_pool_in_train, cfg.memory.spill_dir is not None, multiplexed(cfg)
    return ((["offload"] if mux and iteration == 0 else []) + (["host_in"] if mux else [])
            + (["wake"] if release and iteration > 0 else []) + ["load_weights", "rollout"]
            + (["sleep"] if release else []) + (["host_out"] if mux else []) + (["gather"] if world > 1 else [])
            + (["restore"] if spill and (iteration > 0 or mux) else []) + ["train", "checkpoint", "offload"])


def plan_phases(cfg: RunConfig, sizes: Sizes, world: int) -> list[PhaseMemory]:
    """Each phase's consumer bytes (one rank) for iteration 0 and the steady state."""
    spill, mux = cfg.memory.spill_dir is not None, multiplexed(cfg)
    out = []
    for iteration in (0, 1):
        release = cfg.memory.release_pool_in_train
        asleep = release and iteration > 0  # since the previous iteration's sleep, until wake
        pool_live, parked, spilled = not asleep, asleep, spill and iteration > 0
        host_live, kv_on_disk = not mux, mux and iteration > 0  # the host pool leased; its contents on NVMe
        moments = iteration > 0  # AdamW creates its moments at the first step
        for phase in phase_names(cfg, world, iteration):
            if phase == "wake":
                pool_live, parked = True, False
            elif phase == "host_in":
                host_live, kv_on_disk = True, False
            elif phase == "host_out":
                host_live, kv_on_disk = False, True
            elif phase == "sleep":
                pool_live, parked = False, True
            elif phase == "restore":
                spilled = False
            elif phase == "train":
                moments = True
            elif phase == "offload" and spill:
                spilled = True
            train = phase == "train"
            moment_bytes = (0 if spilled else sizes.moments) + sizes.moment_steps if moments else 0
            memory = {"device_weights": sizes.weights, "device_pool": sizes.pool if pool_live else 0,
                      "device_grad_slots": sizes.grad_slots,
                      "device_activation_peak": sizes.activation_peak if train else 0,
                      "device_reference": sizes.reference_device,
                      "host_masters": 0 if spilled else sizes.masters, "host_moments": moment_bytes,
                      "host_grads": sizes.grads if train else 0, "host_pool": sizes.host_pool if host_live else 0,
                      "host_parked": sizes.parked_bound if parked and host_live else 0,
                      "host_reference": sizes.reference_host,
                      "disk_spilled": (sizes.spill_files if moments else sizes.spill_master_files) if spilled else 0,
                      "disk_kv_pool": sizes.parked_bound if parked and kv_on_disk else 0}
            out.append(PhaseMemory(iteration, phase, with_totals(memory)))
    return out
