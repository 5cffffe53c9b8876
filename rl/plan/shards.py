"""The optimizer states of a trained model as one rank holds them, from shapes alone (rl/plan/model.py
uses these): which parameters expert parallelism splits, the flat vectors the optimizer shards
(trainer/optimizer.py `ShardedHostAdamW.buckets`), the step's all-gather temporaries, the gradient
slots, the spill files, and `TrainedStates`, a second trained model's share (PPO's critic)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from memory.nvme_store import NvmeStoreConfig
from memory.spill_format import spill_layout as spill_plan
from rl.config import RunConfig
from trainer.chunks import ChunkedModel


ROUTED_EXPERTS = re.compile(r"\.mlp\.experts\.w[123]$")
"""Names of the routed experts' stacked parameters [num_experts, ...]: what expert parallelism splits."""


def is_routed(name: str) -> bool:
    return ROUTED_EXPERTS.search(name) is not None


@dataclass(frozen=True)
class RankParams:
    """A model's parameters as one rank of an expert-parallel group holds them: every parameter whole,
    except the routed experts, of which it holds 1/`expert_parallel` (whole experts)."""

    expert_parallel: int

    def numel(self, name: str, p: torch.Tensor) -> int:
        return p.numel() // self.expert_parallel if is_routed(name) else p.numel()

    def nbytes(self, named) -> int:
        return sum(self.numel(n, p) * p.element_size() for n, p in named)


@dataclass(frozen=True)
class ShardGroup:
    """One flat vector of a chunk's parameters sharded over a group of ranks (trainer/optimizer.py `Bucket`)."""

    name: str
    """The bucket's name: "chunk{c}", or "chunk{c}.experts" for its routed experts."""
    numel: int
    """Elements of the flat vector on this rank before padding."""
    ranks: int
    """Ranks it is sharded over (padded to a multiple of them)."""
    largest_param_bytes: int
    """Bytes of its largest parameter in the parameter's own dtype (the step's per-parameter cast)."""
    cast_needed: bool
    """Whether copying the gathered FP32 vector into the parameters makes a temporary: some parameter
    is not FP32, or the vector is on the host and the parameters on a GPU."""

    @property
    def shard(self) -> int:
        return math.ceil(self.numel / self.ranks)

    @property
    def padded(self) -> int:
        return self.shard * self.ranks


def shard_groups(chunked: ChunkedModel, world: int, rank: RankParams, device_is_host: bool) -> list[list[ShardGroup]]:
    """Per VPP chunk, the flat vectors its optimizer shards are cut from (trainer/optimizer.py
    `ShardedHostAdamW.buckets`). parallel.expert=1: one per chunk over the whole world.
    parallel.expert=N > 1: the chunk's replicated parameters over the world, its routed experts (this
    rank's 1/N of them) over the expert-data-parallel group of world / N ranks (the ranks holding the
    same experts)."""
    out = []
    for c in range(len(chunked.specs)):
        named = chunked.chunk_parameters(c)
        routed = [(n, p) for n, p in named if is_routed(n)]
        parts = ([(f"chunk{c}", named, world)] if rank.expert_parallel == 1 or not routed else
                 [(f"chunk{c}", [(n, p) for n, p in named if not is_routed(n)], world),
                  (f"chunk{c}.experts", routed, world // rank.expert_parallel)])
        groups = []
        for name, params, ranks in parts:
            if not params:
                continue
            on_host = ranks == 1  # no gather: the host master is copied into the parameters
            groups.append(ShardGroup(
                name=name, numel=sum(rank.numel(n, p) for n, p in params), ranks=ranks,
                largest_param_bytes=max(rank.numel(n, p) * p.element_size() for n, p in params),
                cast_needed=any(p.dtype != torch.float32 for _, p in params) or (on_host and not device_is_host)))
        out.append(groups)
    return out


def gather_peak_bytes(groups: list[ShardGroup]) -> int:
    """ShardedHostAdamW.step's device temporaries, in its order (chunk after chunk, each vector):
    `mine = master.data.to(device)` (shard), `pieces = [empty_like(mine)] * ranks`, `flat =
    torch.cat(pieces)` (ranks x shard each), all FP32, then one parameter at a time the gathered slice
    cast to its dtype. Each name keeps the previous vector's tensor until it is rebound, so a new
    allocation meets the old one; a vector over one rank is not gathered (`flat` = the host master)."""
    mine = pieces = flat = peak = 0
    for g in groups:
        if g.ranks > 1:
            new_mine, new_pieces = 4 * g.shard, 4 * g.padded
            peak = max(peak, mine + pieces + flat + new_mine)
            mine = new_mine
            peak = max(peak, mine + pieces + flat + new_pieces)
            pieces = new_pieces
            peak = max(peak, mine + pieces + flat + new_pieces)
            flat = new_pieces
        else:
            flat = 0
        peak = max(peak, mine + pieces + flat + (g.largest_param_bytes if g.cast_needed else 0))
    return peak


def steps_bytes(cfg: RunConfig, num_masters: int) -> int:
    # torch's AdamW keeps `step` as a float32 0-dim tensor per master; DeepSpeed's CPU Adam an int.
    return 4 * num_masters if cfg.trainer.optimizer.backend == "torch" else 0


def grad_slot_bytes(groups: list[list[ShardGroup]], num_grad_slots: int) -> int:
    """FP32 gradient slots of the largest VPP chunk, padded to its vectors' ranks."""
    return max(sum(g.padded for g in chunk) for chunk in groups) * 4 * num_grad_slots


def spill_bytes(groups: list[list[ShardGroup]]) -> tuple[int, int, int]:
    """(file bytes of every vector's states, their payload, file bytes of the masters alone) in the
    NVMe store's layout (memory/spill_format.py): one spill group per sharded vector."""
    checksum = NvmeStoreConfig().checksum
    files = payload = master_files = 0
    for g in (g for chunk in groups for g in chunk):
        states = {k: torch.empty(g.shard, dtype=torch.float32, device="meta") for k in ("master", "exp_avg", "exp_avg_sq")}
        manifest = spill_plan(f"train_states.rank0.{g.name}", states, checksum)
        files += manifest.file_bytes
        payload += manifest.payload_bytes
        master_files += spill_plan(f"train_states.rank0.{g.name}", {"master": states["master"]}, checksum).file_bytes
    return files, payload, master_files


@dataclass(frozen=True, kw_only=True)
class TrainedStates:
    """What one trained model holds beside the policy (PPO's critic), bytes of one rank."""
    weights: int
    grad_slots: int
    masters: int
    """FP32 master shards; the host gradients are as many bytes, the moments twice as many."""
    moment_steps: int
    spill_files: int
    spill_master_files: int
