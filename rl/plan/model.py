"""The memory model of a run: bytes of every consumer, per tier, per phase, from the config alone.

Pure functions of (RunConfig, ClusterConfig, PlanOptions); nothing of the model's
size is allocated (the model is built on the meta device). Each figure uses the formula, and where
possible the very helper, of the code that allocates it:

- expert parallelism (parallel.expert = N): the routed experts (`experts.w1/w2/w3` of every MoE
  layer) are split over N ranks, each holding 1/N of them; everything else is whole on every rank
  (`RankParams`). The optimizer shards replicated parameters over the whole world and a rank's
  experts over the world / N ranks holding the same experts (`shard_groups`).
- device weights: this rank's parameters in experiment.dtype (models/precision.py: a few stay
  FP32); the engine runs on the same tensors (rl/run/build.py), so they count once.
- device pool: `CacheLayout.for_model` page bytes (MLA latents in the model's dtype, KDA states in
  engine.kda_state_dtype) times engine.pool_mb // page_bytes pages, as `PagePool.from_bytes`.
- device grad slots: num_grad_slots FP32 slots of the largest VPP chunk, padded to a multiple of
  the ranks each of its vectors is sharded over (`split_chunks` + `ChunkedModel.chunk_parameters`,
  ShardedHostAdamW's padding).
- device activation peak: rl/plan/activation.py `probe_activations`, the trainer's own layers on
  the meta device for this rank's micro-batches, the MoE in the form the planned device runs
  (`moe_grouped_mm`). Under expert parallelism it is the one-rank routed path's: with balanced
  routing a rank runs as many token-expert rows for its peers as it sends them.
- context parallelism (C > 1 ranks share every sequence): rl/plan/context_memory.py says what a
  rank holds (its 2F = L / C tokens of each sequence and the exchange buffers).
- device, train phase, outside the logged keys (`Sizes.train_transient`): the chunk-input stash
  of the chunk-major micro-batches and the optimizer step's all-gather temporaries.
- device reference: a resident reference (memory.reference=resident) is a second copy of this
  rank's weights; a streamed one borrows the grad slots (0 extra).
- host masters / grads / moments: per chunk and vector one FP32 shard of ceil(numel / ranks)
  elements each; AdamW keeps two per shard plus a step counter (a 4-byte tensor with torch's AdamW,
  a python int with DeepSpeed's, which "auto" picks when it builds).
- host pool: engine.host_pool_mb // page_bytes pages; host parked: the KV of paused partial
  rollouts over the train phase, inside the host pool (an upper bound: how many are paused is up to
  the budget and the dispatcher).
- host reference: the streamed reference's host vectors, chunk by chunk, each parameter aligned to
  its element size, a tied head repeated in the last chunk (trainer/ref_stream.py's layout).
- host pinned, host at start-up: `Sizes.host_pinned`, `Sizes.startup_host_peak`.
- disk spilled: the NVMe store's file bytes of every chunk's states (memory/spill_format.py's plan).
- PPO's critic (algo.critic.enable): a second trained model (models/value.py, the policy's layers
  with a [1, D] head), counted as the policy is (`TrainedStates`): its weights, FP32 grad slots, host
  masters / grads / moments and spill files, in the same phases (it spills and restores with the
  policy). It trains after the policy in the train phase, so the activation peak is the larger of
  the two: the policy's (its [V, D] head's logits).
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
from memory.pinned import pinned_bytes_rounded
from models.mlp import Experts, grouped_mm_usable
from models.model import HybridLM
from models.value import ValueModel
from models.precision import cast_parameters, parse_dtype
from rl.config import RunConfig
from rl.plan.cluster import GIB, ClusterConfig, PlanOptions
from rl.plan.context_memory import ContextBuffers, activation_chunks, check_context, local_lens
from rl.plan.shards import (RankParams, TrainedStates, gather_peak_bytes, grad_slot_bytes, is_routed,
                            shard_groups, spill_bytes, steps_bytes)
from rl.run.update import mini_batch_split
from memory.tiers import with_totals
from trainer.chunks import ChunkedModel
from trainer.step import micro_batches


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What each consumer of one rank holds when present (bytes)."""

    weights: int
    """This rank's parameters in the run's dtype: the replicated ones plus its 1/parallel.expert of
    the routed experts."""
    weights_replicated: int
    """The part of `weights` every rank holds whole (everything but the routed experts)."""
    weights_routed: int
    """The part of `weights` that is this rank's share of the routed experts (`experts.w1/w2/w3`)."""
    expert_parallel: int
    """parallel.expert: the ranks each MoE layer's routed experts are split over."""
    pool: int
    pool_pages: int
    grad_slots: int
    activation_peak: int
    chunk_activation_peaks: list[int]
    """Per VPP chunk, its saved-tensor peak (activation_peak is their max)."""
    activation_layer_runs: int
    """Decoder-layer forwards the activation probe ran (rl/plan/activation.py `probe_activations`)."""
    chunk_input_stash: int
    """Device, train phase, forward and backward: the hidden state entering each chunk, kept for every
    micro-batch of the step between the graph-free forward and the backward (trainer/chunks.py
    `forward_backward_batches`): distinct chunk inputs x the step's tokens x hidden_size x the
    hidden states' dtype bytes (a chunk without layers hands its input on: the next chunk's input is
    the same tensor). At its largest when the backward starts; each chunk's share goes as its
    backward ends. Not in it: the gradient entering the chunk, one more [tokens, hidden] per
    micro-batch during the backward walk."""
    optimizer_gather_peak: int
    """Device, train phase, optimizer step: the most bytes of ShardedHostAdamW.step's all-gather
    temporaries alive at once (trainer/optimizer.py): per chunk, the FP32 master shard moved to the
    device, `world` pieces of it, their concatenation (2 x the padded chunk in FP32), and the
    per-parameter cast to the parameter's dtype, while the previous chunk's gathered copy is still
    bound until its name is rebound (`gather_peak_bytes`)."""
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
    grad_staging: int
    """Host, on a CUDA cluster (0 when device_is_host): the optimizer's page-locked FP32 buffer per
    bucket, one gradient shard each, that the reduced shards are copied into without a host sync
    (trainer/optimizer.py `_copy_async`; the critic's optimizer has its own); made at the first step and kept. Not among the logged
    host keys: the host verdict adds it to every phase."""
    host_pinned: int
    """Page-locked host bytes on a CUDA cluster (0 when device_is_host), exact sizes: the host KV pool
    (rollout/engine.py pins it for a CUDA device), the streamed reference's host vectors
    (trainer/ref_stream.py) and `grad_staging`. The reference and the staging buffers are locked at
    their exact size (memory/pinned.py); the host KV pool still goes through torch's pin_memory=True
    caching host allocator, which locks the next power of two (`host_pool_locked`)."""
    startup_host_peak: int
    """Host bytes of one rank at start-up or resume: its weights in their dtype on the host while a
    checkpoint loads (models/checkpoint.py `load_weights` reads the rank's tensors, its experts only,
    before copying them in), plus the optimizer's FP32 master shards (a resume loads the weights with
    the optimizer built; PPO's critic adds its weights and masters). An upper bound for a fresh start, which moves the weights off the host
    before the masters exist."""
    spill_files: int
    spill_payload: int
    spill_master_files: int
    """The spill before the first step (no moments yet): the masters alone (a multiplexed run's first offload)."""
    layout: CacheLayout
    micro_batches: list[list[int]]
    """This rank's trained sequence lengths per micro-batch (what the activation peak was probed on):
    under context parallelism its local tokens of each sequence (2F)."""
    context: int
    """C: ranks sharing every trained sequence (1 = no context parallelism)."""
    chunk_context_transients: list[int]
    """Per VPP chunk, the context-parallel bytes in flight beside its saved tensors (one key block's
    K/V and their gradients when it has an MLA layer; rl/plan/context_memory.py), zeros at C = 1."""
    context_buffers: ContextBuffers
    """The exchange buffers per layer of the largest micro-batch (zeros at C = 1); their saved part is
    inside `chunk_activation_peaks`."""
    critic: TrainedStates | None = None
    """PPO's value model (algo.critic.enable), None without one."""

    @property
    def num_train_tokens(self) -> int:
        return sum(sum(b) for b in self.micro_batches)

    @property
    def host_pool_locked(self) -> int:
        """What torch's caching host allocator locks for the host KV pool's one pinned block on a
        CUDA cluster (memory/pinned.py `pinned_bytes_rounded`; 0 when nothing is pinned)."""
        return pinned_bytes_rounded(self.host_pool) if self.host_pinned else 0

    @property
    def activation_in_flight_peak(self) -> int:
        """The largest chunk's saved tensors with its context-parallel transient on top (=
        activation_peak at C = 1)."""
        return max(p + t for p, t in zip(self.chunk_activation_peaks, self.chunk_context_transients))

    @property
    def train_transient(self) -> int:
        """The train phase's device bytes above weights, slots, reference and pool at its peak: the
        activations (with a context-parallel key block in flight) and the chunk-input stash (forward
        and backward), or the optimizer's all-gather temporaries (the step, after both are gone),
        whichever is larger."""
        return max(self.activation_in_flight_peak + self.chunk_input_stash, self.optimizer_gather_peak)


def run_dtype(cfg: RunConfig) -> torch.dtype:
    return cfg.experiment.torch_dtype


def meta_policy(cfg: RunConfig, value: bool = False) -> HybridLM:
    """The policy's shape on the meta device, parameters in the run's dtype (no storage); `value`:
    PPO's critic instead (models/value.py: untied, a [1, D] head)."""
    with torch.device("meta"):
        model = ValueModel(cfg.model) if value else HybridLM(cfg.model)
    return cast_parameters(model, run_dtype(cfg))


def cache_layout(cfg: RunConfig) -> CacheLayout:
    """The engine's page geometry (rollout/engine.py: MLA cache in the output weight's dtype, block_tokens
    a multiple of the prefix cache's hash block when there is one)."""
    e = cfg.engine
    return CacheLayout.for_model(cfg.model, group_layers=e.group_layers, block_tokens=e.block_tokens,
                                 cache_dtype=meta_policy(cfg).output_weight.dtype,
                                 state_dtype=parse_dtype(e.kda_state_dtype),
                                 hash_block=e.prefix_cache.hash_block if e.prefix_cache else None)


def _reference_host_bytes(model: HybridLM, chunked: ChunkedModel, rank: RankParams) -> int:
    """trainer/ref_stream.py's host layout: per chunk its parameters back to back (this rank's share
    of the routed experts), each aligned to its element size; a tied head's embedding is repeated in
    the last chunk."""
    total = 0
    for c, spec in enumerate(chunked.specs):
        params = chunked.chunk_parameters(c)
        if spec.has_head and model.lm_head is None and not spec.has_embedding:
            params.append(("model.embed_tokens.weight", model.model.embed_tokens.weight))
        offset = 0
        for name, p in params:
            offset = -(-offset // p.element_size()) * p.element_size() + rank.numel(name, p) * p.element_size()
        total += offset
    return total


def step_tokens(cfg: RunConfig, micro_batches: list[list[int]]) -> int:
    """Tokens of the largest optimizer step among this rank's sequences (algo.mini_batches splits
    them into consecutive runs, rl/run/update.py `mini_batch_split`)."""
    lens = [n for b in micro_batches for n in b]
    return max((sum(lens[i] for i in seqs) for seqs in mini_batch_split(len(lens), cfg.algo.mini_batches)), default=0)


def chunk_input_stash_bytes(chunked: ChunkedModel, num_tokens: int) -> int:
    """`Sizes.chunk_input_stash` of a step of `num_tokens` tokens: distinct chunk inputs x tokens x
    hidden_size x the hidden states' (the embedding's) dtype bytes."""
    specs = chunked.specs
    distinct = 1 + sum(1 for c in range(1, len(specs)) if specs[c - 1].layers)
    hidden = chunked.model.model.embed_tokens.weight
    return distinct * num_tokens * hidden.shape[1] * hidden.element_size()


def moe_grouped_mm(model: HybridLM, cluster: ClusterConfig) -> bool:
    """Whether the planned device runs the routed experts through torch._grouped_mm: the cluster's
    GPU says (bf16 only), a device_is_host cluster asks this machine (models/mlp.py `grouped_mm_usable`)."""
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    if experts is None:
        return False
    if cluster.device_is_host:
        return grouped_mm_usable(torch.empty(0, experts.w1.shape[2], dtype=experts.w1.dtype), experts.w1)
    return cluster.grouped_mm_bf16 and experts.w1.dtype == torch.bfloat16


def expert_parallel_size(cfg: RunConfig, cluster: ClusterConfig, context: int = 1) -> int:
    """cfg.parallel.expert, checked against the planned world (the run config checked the expert
    count): ValueError naming the value unless it divides the cluster's ranks and the experts, and
    (context > 1) `context` and the DP x C ranks the expert groups span (`check_context`)."""
    expert = cfg.parallel.expert
    if context != 1:
        check_context(context, cluster.world, expert, cluster.name)
    if expert < 1 or cluster.world % expert or cfg.model.num_experts % expert:
        raise ValueError(f"parallel.expert={expert}: expected a divisor of the world size ({cluster.world} ranks on "
                         f"cluster {cluster.name}) and of the model's expert count ({cfg.model.num_experts})")
    return expert


def train_micro_batches(cfg: RunConfig, cluster: ClusterConfig, options: PlanOptions, context: int = 1
                        ) -> list[list[int]]:
    """Sequence lengths of this rank's micro-batches: the rank with the most groups (ceil of the
    global groups over the data-parallel replicas, world / context) trains group_size trajectories
    per group, each of seq_len - 1 tokens (inputs tokens[:-1]), packed by trainer.micro_batch_tokens
    as the trainer does. Unsplit lengths: `context_memory.local_lens` gives a rank's share."""
    seq_len = options.seq_len if options.seq_len is not None else cfg.engine.max_model_len
    groups = math.ceil(cfg.rollout.groups_per_iteration / (cluster.world // context))
    lens = [seq_len - 1] * (groups * cfg.algo.group_size)
    packed = local_lens(cfg.model, lens, context)  # the rank packs the tokens it holds
    return [[lens[i] for i in mb] for mb in micro_batches(packed, cfg.trainer.micro_batch_tokens)]


def plan_sizes(cfg: RunConfig, cluster: ClusterConfig, options: PlanOptions = PlanOptions(), context: int = 1
               ) -> Sizes:
    """Every consumer's bytes for one rank of `cluster` running `cfg` with `context` ranks sharing
    every trained sequence (see the module docstring). ValueError when cfg.parallel.expert does not
    divide the world size and the expert count, or `context` is bad (`check_context`)."""
    rank = RankParams(expert_parallel_size(cfg, cluster, context))
    model = meta_policy(cfg)
    world, t = cluster.world, cfg.trainer
    chunked = ChunkedModel(model, t.num_chunks, t.chunk_split)
    groups = shard_groups(chunked, world, rank, cluster.device_is_host)
    shards = [sum(g.shard for g in chunk) for chunk in groups]
    named = list(model.named_parameters())
    weights = rank.nbytes(named)
    routed = rank.nbytes([(n, p) for n, p in named if is_routed(n)])
    layout = cache_layout(cfg)
    e = cfg.engine
    pool_pages = e.pool_bytes // layout.page_bytes
    kl = cfg.algo.loss.kl_coef > 0 or cfg.algo.kl_in_reward.coef > 0  # either builds the reference
    reference_host = _reference_host_bytes(model, chunked, rank) if kl and cfg.memory.reference == "stream" else 0
    num_masters = sum(len(chunk) for chunk in groups)
    if e.host_pool_mb == "auto":  # what the ledger has free while the states are on NVMe
        rank_budget = host_budget_bytes(cfg, cluster) // cluster.gpus_per_node
        host_pages = max(0, rank_budget - reference_host - steps_bytes(cfg, num_masters)) // layout.page_bytes
    else:
        host_pages = e.host_pool_bytes // layout.page_bytes
    partial_kv = (cfg.rollout.partial_resume == "kv"
                  and (cfg.rollout.budget_tokens is not None or cfg.rollout.budget_seconds is not None))
    spill_files, spill_payload, spill_master_files = spill_bytes(groups)
    batches = train_micro_batches(cfg, cluster, options, context)
    chunk_peaks, chunk_transients, buffers, layer_runs = activation_chunks(
        cfg, chunked, run_dtype(cfg), moe_grouped_mm(model, cluster), options, batches, context)
    local_batches = [local_lens(cfg.model, b, context) for b in batches]
    host_pool = host_pages * layout.page_bytes
    critic = _critic_states(cfg, cluster, rank) if cfg.algo.critic.enable else None
    critic_masters = critic.masters if critic else 0  # its optimizer stages and loads as the policy's
    grad_staging = 0 if cluster.device_is_host else 4 * sum(shards) + critic_masters
    return Sizes(
        weights=weights, weights_replicated=weights - routed, weights_routed=routed, expert_parallel=rank.expert_parallel,
        pool=pool_pages * layout.page_bytes, pool_pages=pool_pages,
        grad_slots=grad_slot_bytes(groups, t.num_grad_slots),
        activation_peak=max(chunk_peaks), chunk_activation_peaks=chunk_peaks,
        activation_layer_runs=layer_runs,
        chunk_input_stash=chunk_input_stash_bytes(chunked, step_tokens(cfg, local_batches)),
        optimizer_gather_peak=gather_peak_bytes([g for chunk in groups for g in chunk]),
        reference_device=weights if kl and cfg.memory.reference == "resident" else 0,
        masters=4 * sum(shards), moments=8 * sum(shards), moment_steps=steps_bytes(cfg, num_masters),
        grads=4 * sum(shards), host_pool=host_pool,
        parked_bound=min(host_pages, pool_pages) * layout.page_bytes if partial_kv else 0,
        reference_host=reference_host,
        grad_staging=grad_staging, host_pinned=0 if cluster.device_is_host else host_pool + reference_host + grad_staging,
        startup_host_peak=weights + 4 * sum(shards) + (critic.weights + critic_masters if critic else 0),
        spill_files=spill_files if cfg.memory.spill_dir is not None else 0, spill_payload=spill_payload,
        spill_master_files=spill_master_files if cfg.memory.spill_dir is not None else 0,
        layout=layout, micro_batches=local_batches, context=context, chunk_context_transients=chunk_transients,
        context_buffers=buffers, critic=critic)


def _critic_states(cfg: RunConfig, cluster: ClusterConfig, rank: RankParams) -> TrainedStates:
    """PPO's value model counted as the policy is: its own Trainer over the run's chunks (rl/run/build.py
    `build_critic`), with the same optimizer backend."""
    model = meta_policy(cfg, value=True)
    t = cfg.trainer
    groups = shard_groups(ChunkedModel(model, t.num_chunks, t.chunk_split), cluster.world, rank, cluster.device_is_host)
    files, _, master_files = spill_bytes(groups)
    spilled = cfg.memory.spill_dir is not None
    return TrainedStates(weights=rank.nbytes(list(model.named_parameters())),
                         grad_slots=grad_slot_bytes(groups, t.num_grad_slots),
                         masters=4 * sum(g.shard for chunk in groups for g in chunk),
                         moment_steps=steps_bytes(cfg, sum(len(chunk) for chunk in groups)),
                         spill_files=files if spilled else 0, spill_master_files=master_files if spilled else 0)


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
            if sizes.critic is not None:  # the second trained model, in the same states as the policy's
                c = sizes.critic
                memory["device_weights"] += c.weights
                memory["device_grad_slots"] += c.grad_slots
                memory["host_masters"] += 0 if spilled else c.masters
                memory["host_moments"] += ((0 if spilled else 2 * c.masters) + c.moment_steps) if moments else 0
                memory["host_grads"] += c.masters if train else 0
                memory["disk_spilled"] += (c.spill_files if moments else c.spill_master_files) if spilled else 0
            out.append(PhaseMemory(iteration, phase, with_totals(memory)))
    return out
