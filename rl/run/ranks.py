"""The run's data-parallel ranks: process-group set-up under torchrun, and the few collectives the
RL loop needs at its phase boundaries.

One process (no torchrun, or WORLD_SIZE=1) gets `Ranks()` — rank 0 of 1, no process group, every
collective a plain local call — so the default path stays single-process (`breakpoint()` works).
Under `torchrun --nproc_per_node N` (WORLD_SIZE > 1 in the environment) `init_ranks` starts
torch.distributed (NCCL when the run's device is CUDA, gloo on CPU) and megatron-core's
parallel_state with TP = PP = 1, whose data-parallel group the trainer reduces over.
`Ranks.device` is the run's resolved device (experiment.device): where this rank's models,
batches and collective tensors live (NCCL takes only tensors on the rank's current GPU).

Words: a rank *owns* the global group indices g with g % world == rank (its share of the prompts;
groups are never split across ranks, so group advantages see whole groups). The *writer* is rank 0:
the only rank that writes metrics, plots, wandb and the console.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.context_parallel import ContextParallel
from models.expert_parallel import ExpertParallel

CHECKSUM_BITS = 52
"""Weight checksums are kept below 2**52 so that a JSON reader or wandb (float64) keeps every bit."""


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    """Rank within this node (picks the GPU)."""
    local_world: int = 1
    """Ranks on this node (they share its host DRAM)."""
    group: dist.ProcessGroup | None = None
    """The data-parallel group (megatron-core parallel_state); None in one process."""
    device: torch.device = torch.device("cpu")
    """This rank's device: its models, batches and collective tensors (the GPU of LOCAL_RANK, set as
    the current CUDA device, with NCCL between ranks; the CPU with gloo)."""
    expert_parallel: ExpertParallel | None = None
    """This rank's expert-parallel group (parallel.expert > 1; megatron-core's expert model-parallel
    group): the ranks that split the routed experts between them. None: every rank holds every expert."""
    expert_data_group: dist.ProcessGroup | None = None
    """The ranks holding the same experts (megatron-core's expert-data-parallel group): the experts'
    gradients are reduced over it. None without expert parallelism."""
    context_parallel: ContextParallel | None = None
    """This rank's context-parallel group (parallel.context > 1; megatron-core's context-parallel
    group): the ranks that share every training sequence, each holding its zig-zag share. `group`
    then spans data x context ranks (gradients are reduced over both). None: whole sequences here."""

    @property
    def expert_rank(self) -> int:
        """This rank's place in its expert-parallel group (0 without expert parallelism)."""
        return self.expert_parallel.rank if self.expert_parallel is not None else 0

    @property
    def writes_experts(self) -> bool:
        """Whether this rank writes its experts into a checkpoint: the first of the ranks holding them."""
        return self.expert_parallel is None or dist.get_rank(self.expert_data_group) == 0

    @property
    def context_rank(self) -> int:
        """This rank's place in its context-parallel group (0 without context parallelism)."""
        return self.context_parallel.rank if self.context_parallel is not None else 0

    @property
    def context_size(self) -> int:
        return self.context_parallel.size if self.context_parallel is not None else 1

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def owns(self, group_index: int) -> bool:
        """Whether global prompt group `group_index` is generated (and trained) on this rank."""
        return group_index % self.world == self.rank

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def all_gather(self, obj: object) -> list:
        """Every rank's `obj` (picklable), in rank order; [obj] in one process."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sum over ranks (float64 on the collective device)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.cpu().tolist()

    def check_same(self, what: str, value: object) -> object:
        """All-gather `value` and raise if any rank holds another one (naming the ranks); returns it."""
        return require_same(what, self.all_gather(value))


def require_same(what: str, per_rank: list) -> object:
    """`per_rank[0]` when every rank agrees; otherwise RuntimeError naming the ranks that differ from rank 0."""
    differ = [r for r, v in enumerate(per_rank) if v != per_rank[0]]
    if differ:
        raise RuntimeError(f"ranks disagree on {what}: rank 0 has {per_rank[0]!r}, "
                           + ", ".join(f"rank {r} has {per_rank[r]!r}" for r in differ))
    return per_rank[0]


def init_ranks(device_type: str = "cpu", timeout_s: float = 600.0, expert: int = 1, context: int = 1) -> Ranks:
    """Ranks from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR/PORT); one process (`Ranks(device=...)`, no process group) when WORLD_SIZE is unset or
    1. device_type "cuda": this rank's device is GPU LOCAL_RANK, made the current CUDA device (a node
    needs a GPU per rank: ValueError otherwise, before any process group starts); "cpu": the CPU.
    With several ranks, starts torch.distributed (nccl for "cuda", else gloo) and megatron-core's
    parallel_state (TP = PP = 1: every rank is one data-parallel replica). Undo with `shutdown`.
    `timeout_s` (experiment.collective_timeout_s): a collective waiting longer for a peer fails
    instead of hanging (a dead rank's peers usually fail at once: its connections close).
    `expert` (parallel.expert): megatron-core's expert_model_parallel_size; its expert model- and
    expert-data-parallel groups become `expert_parallel` and `expert_data_group`. `context`
    (parallel.context): megatron-core's context_parallel_size; its group becomes `context_parallel`
    and `group` the data-parallel group with the context ranks in it (world = DP x context; the
    expert groups span DP x context ranks, which megatron-core folds into expert data parallelism)."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type={device_type!r}, expected 'cpu' or 'cuda'")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    device, backend = torch.device("cpu"), "gloo"
    if device_type == "cuda":
        visible = torch.cuda.device_count()
        if local_world > visible or local_rank >= visible:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ValueError(f"experiment.device=cuda: {local_world} rank(s) on this node need one GPU each, but "
                             f"{visible} are visible (CUDA_VISIBLE_DEVICES={shown!r}); launch at most {visible} "
                             f"per node (torchrun --nproc_per_node) or use experiment.device=cpu")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    check_layout(world, expert, context)
    if world == 1:
        return Ranks(device=device)
    rank = int(os.environ["RANK"])
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    from megatron.core import parallel_state

    ep, edp, cp = model_parallel_groups(expert, context)
    return Ranks(rank=rank, world=world, local_rank=local_rank, local_world=local_world,
                 group=parallel_state.get_data_parallel_group(with_context_parallel=True), device=device,
                 expert_parallel=ep, expert_data_group=edp, context_parallel=cp)


def check_layout(world: int, expert: int, context: int) -> None:
    """Refuse (ValueError naming the values) a layout whose product does not fit `world` ranks:
    context must divide world (world = DP x context) and expert must divide world (the expert groups
    span DP x context ranks)."""
    if context < 1 or world % context:
        raise ValueError(f"parallel.context={context} does not divide the {world} rank(s); expected a divisor "
                         f"(world = data-parallel ranks x context)")
    if expert < 1 or world % expert:
        raise ValueError(f"parallel.expert={expert} does not divide the {world} rank(s); expected a divisor "
                         f"(the expert groups span data-parallel x context ranks)")


def model_parallel_groups(expert: int, context: int = 1
                          ) -> tuple[ExpertParallel | None, dist.ProcessGroup | None, ContextParallel | None]:
    """Start megatron-core's parallel_state on the running process group (TP = PP = 1,
    expert_model_parallel_size=`expert`, context_parallel_size=`context`); returns (this rank's
    expert-parallel group, its expert-data-parallel group, its context-parallel group), each None
    when its size is 1. Undo with destroy_model_parallel."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=expert, context_parallel_size=context)
    cp = (ContextParallel(parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank(),
                          context) if context > 1 else None)
    if expert == 1:
        return None, None, cp
    return (ExpertParallel(parallel_state.get_expert_model_parallel_group(),
                           parallel_state.get_expert_model_parallel_rank(), expert),
            parallel_state.get_expert_data_parallel_group(), cp)


def expert_groups(expert: int) -> tuple[ExpertParallel | None, dist.ProcessGroup | None]:
    """`model_parallel_groups` without context parallelism: (expert-parallel, expert-data-parallel)."""
    ep, edp, _ = model_parallel_groups(expert)
    return ep, edp


def shutdown(ranks: Ranks) -> None:
    """Destroy what `init_ranks` started (no-op in one process)."""
    if ranks.world == 1:
        return
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@torch.no_grad()
def weights_checksum(state: dict[str, torch.Tensor], slice_numel: int = 1 << 24) -> int:
    """A position-sensitive checksum of the tensors' bits (names in sorted order), computed where the
    tensors live (no host copy of a GPU model) in slices of `slice_numel` elements. Equal weights
    give equal checksums on every rank; one flipped bit or two swapped elements change it."""
    mask = (1 << CHECKSUM_BITS) - 1
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    h = 0
    for name in sorted(state):
        flat = state[name].detach().contiguous().reshape(-1)
        bits = flat.view(ints[flat.element_size()])  # [numel], the raw bits
        total = 0
        for start in range(0, bits.numel(), slice_numel):
            part = bits[start:start + slice_numel].to(torch.int64)
            # element i weighs (i % 65521) + 1, so that moved elements change the sum; int64 sums wrap
            # modulo 2**64, so the slices' sums add up to the whole tensor's (mod 2**64)
            pos = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 65521 + 1
            total += int((part * pos).sum())
        h = (h * 1_000_003 + total % (1 << 64) + flat.numel()) & mask
    return h


# How each per-rank metric of an iteration becomes the global one (merge_metrics).
SUMMED = frozenset({"rollout_tokens", "trajectories_finished", "trajectories_carried", "env_errors", "loss",
                    "rollout_dropped_too_long", "trajectories_dropped", "dropped/too_long", "dropped/env_error",
                    "dropped/timeout", "dropped/tokenizer", "dropped/bad_reward",
                    "train_tokens", "train_sequences", "loss/num_tokens",
                    "prefix_hit_tokens", "prefix_stale_hit_tokens", "kv_computed_tokens", "host_pages_written_back",
                    "host_pages_prefetched", "host_pages_prefetched_ahead", "host_hit_tokens", "reprefilled_tokens",
                    "admissions_deferred", "host_copy_load_s", "host_copy_wait_s", "host_pool_bytes", "ref_stream_bytes",
                    "val/num_prompts", "val/num_samples", "val/reward_sum", "val/num_correct", "val/num_pass",
                    "val/mean_sum", "val/tokens", "val/errors", "env_calls", "env_retries", "env_timeouts",
                    "env_failures_scored", "env_busy_seconds", "engine_step_seconds", "env_wait_seconds",
                    "env_stuck_calls", "spec_proposed", "spec_accepted", "spec_verifications",
                    "spec_gated_steps", "tool_calls_delayed", "tool_wait_seconds"})
"""Counts (an evaluation's raw sums included), and the trainer's loss (each rank's share of the
globally normalised loss)."""
MAXED = frozenset({"rollout_seconds", "micro_batches", "grad_slots_high_water", "skipped", "train_skipped",
                   "grad_norm", "grad_clip_coef", "nonfinite_grad", "ref_stream_s", "ref_stream_wait_s",
                   "lr", "optimizer_steps", "val/seconds"})
"""The slowest / largest rank (also every `seconds/<phase>` and `*_max`)."""
TOKEN_WEIGHTED_PREFIXES = ("loss/", "stale_token_frac", "clip_frac", "approx_kl", "mismatch/", "critic/", "advantage/",
                           "kl_in_reward/", "truncated_masked_frac")
"""Per-token statistics: the mean over ranks weighted by each rank's `train_tokens`."""
ROLLOUT_TOKEN_WEIGHTED = frozenset({"entropy"})
"""Per sampled token: the mean over ranks weighted by each rank's `rollout_tokens`."""
TRAJECTORY_WEIGHTED_PREFIXES = ("reward/",)
"""Per-trajectory means (reward components): weighted by each rank's `trajectories_finished`; a rank
without the metric had none of that component (0), as within a rank."""
VAL_RATIOS = {"val/reward_mean": ("val/reward_sum", "val/num_samples"),
              "val/correct_frac": ("val/num_correct", "val/num_samples"),
              "val/pass@": ("val/num_pass", "val/num_prompts"), "val/mean@": ("val/mean_sum", "val/num_prompts")}
"""An evaluation's ratios (rl/episodes/validation.py; `val/pass@k`, `val/mean@k` by prefix): recomputed from
the summed numerator and denominator, so N ranks sharing the prompts report what one rank would."""


def _val_ratio(key: str) -> tuple[str, str] | None:
    """The (numerator, denominator) counts of evaluation ratio `key`, or None."""
    if key in VAL_RATIOS:
        return VAL_RATIOS[key]
    prefix = key[:key.find("@") + 1] if "@" in key else None
    return VAL_RATIOS.get(prefix) if prefix else None


def merge_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One iteration's metrics over all ranks (rank order) by the rules above; `rollout_tok_s` is
    the global tokens over the slowest rank's seconds. A metric no rule covers raises KeyError, so
    a new metric is never averaged by accident."""
    keys = list(dict.fromkeys(k for m in per_rank for k in m))
    out: dict[str, float] = {}
    for key in keys:
        have = [m for m in per_rank if key in m]
        values = [m[key] for m in have]
        if key == "rollout_tok_s":
            seconds = max(m["rollout_seconds"] for m in per_rank)
            out[key] = sum(m["rollout_tokens"] for m in per_rank) / max(seconds, 1e-9)
        elif key == "prefix_hit_frac":  # hit / (hit + computed) tokens of KV, over every rank's engine
            hits = sum(m["prefix_hit_tokens"] for m in have)
            out[key] = hits / max(1.0, hits + sum(m["kv_computed_tokens"] for m in have))
        elif key == "prefetch_hidden_fraction":  # over every rank's prefetch copies
            load = sum(m["host_copy_load_s"] for m in have)
            out[key] = min(1.0, max(0.0, 1.0 - sum(m["host_copy_wait_s"] for m in have) / load)) if load > 0 else 1.0
        elif key == "spec_acceptance":  # kept / proposed tokens, over every rank's engine
            out[key] = sum(m["spec_accepted"] for m in have) / max(1.0, sum(m["spec_proposed"] for m in have))
        elif _val_ratio(key) is not None:
            num, den = _val_ratio(key)
            total = sum(m[den] for m in have)
            out[key] = sum(m[num] for m in have) / total if total else float("nan")
        elif key in SUMMED:
            out[key] = sum(values)
        # dynamic sampling's figures are global already (summed at its round boundaries): any rank's is the max
        elif key in MAXED or key.startswith(("seconds/", "dynamic_sampling/")) or key.endswith("_max"):
            out[key] = max(values)
        elif key.startswith(TOKEN_WEIGHTED_PREFIXES):
            weights = [m.get("train_tokens", 0.0) for m in have]
            total = sum(weights)
            # (w / total) * v: a single rank with tokens passes its value through unchanged; a rank
            # without tokens (a context-parallel share of prompts) weighs nothing, whatever its value
            out[key] = sum(w / total * v for w, v in zip(weights, values) if w) if total else float("nan")
        elif key in ROLLOUT_TOKEN_WEIGHTED:
            weights = [m["rollout_tokens"] for m in have]
            total = sum(weights)
            out[key] = sum(w / total * v for w, v in zip(weights, values)) if total else float("nan")
        elif key.startswith(TRAJECTORY_WEIGHTED_PREFIXES):
            weights = [m.get("trajectories_finished", 0.0) for m in per_rank]
            total = sum(weights)
            out[key] = sum(w / total * m.get(key, 0.0) for w, m in zip(weights, per_rank)) if total else float("nan")
        else:
            raise KeyError(f"no rule merges metric {key!r} over ranks (rl/run/ranks.py: SUMMED, MAXED, "
                           f"TOKEN_WEIGHTED_PREFIXES, TRAJECTORY_WEIGHTED_PREFIXES)")
    return out


class RankLost(RuntimeError):
    """A collective failed because a peer rank died or timed out (the run resumes from its checkpoint)."""


def collective_failure(err: BaseException) -> bool:
    """Whether `err` (or what it was raised from) is torch.distributed's report of a lost peer."""
    while err is not None:
        text = str(err)
        if isinstance(err, torch.distributed.DistError) or any(
                s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out",
                                    "timed out", "gloo", "NCCL", "Broken pipe")):
            return True
        err = err.__cause__ or err.__context__
    return False
