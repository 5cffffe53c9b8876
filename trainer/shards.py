"""The flat vectors the host optimizer shards (`Bucket`), and loading saved shards into another
sharding (`reshard`: another expert-parallel size, the same world).

A saved shard carries its layout: per bucket its (rank, world, shard size) and the (key, numel)
pieces of its flat vector in order, one per parameter, or one per expert of a stacked expert
tensor keyed by its global index. `reshard` finds every element of this rank's buckets in the
saved ranks' shards by key and offset, so masters and Adam moments are the saved ones exactly.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from models.mlp import Experts
from models.model import HybridLM


class Bucket:
    """Parameters sharded as one flat FP32 vector (model order, padded to a multiple of the
    group's size) over `group`: this rank owns elements [rank * shard_numel, (rank + 1) * shard_numel)."""

    def __init__(self, chunk: int, name: str, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        self.chunk, self.name, self.params, self.group = chunk, name, params, group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = math.ceil(self.numel / self.world)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world




def expert_parameters(model: HybridLM) -> dict[int, tuple[nn.Parameter, int]]:
    """id -> (parameter, first global expert) of every stacked routed-expert tensor of `model`."""
    return {id(p): (p, module.first) for module in model.modules() if isinstance(module, Experts)
            for p in (module.w1, module.w2, module.w3)}


def pieces_of(name: str, param: torch.Tensor, first: int | None) -> list[tuple[str, int]]:
    """A parameter's (key, numel) pieces in flat order: one per expert of a stacked expert tensor
    (keyed by its global index, so any expert-parallel size finds it), else the parameter itself."""
    if first is None:
        return [(name, param.numel())]
    return [(f"{name}.{first + e}", param[0].numel()) for e in range(param.shape[0])]


KINDS = ("master", "exp_avg", "exp_avg_sq")


def _gather(states: list[dict], wanted: dict[str, int]) -> dict[str, dict[str, torch.Tensor]]:
    """key -> kind -> the whole piece (FP32), assembled from every saved shard that holds part of it."""
    full: dict[str, dict[str, torch.Tensor]] = {}
    seen: dict[str, int] = {}
    for st in states:
        adam_state = st["adam"]["state"]
        for b, meta in enumerate(st["layout"]):
            vectors = {"master": st["masters"][b], **{k: v for k, v in adam_state.get(b, {}).items() if k in KINDS}}
            lo, hi = meta["rank"] * meta["shard"], (meta["rank"] + 1) * meta["shard"]
            offset = 0
            for key, numel in meta["pieces"]:
                start, end = max(offset, lo), min(offset + numel, hi)
                if key in wanted and start < end:
                    slots = full.setdefault(key, {})
                    for kind, vec in vectors.items():
                        slots.setdefault(kind, torch.zeros(numel))[start - offset:end - offset] = vec[start - lo:end - lo]
                    seen[key] = seen.get(key, 0) + end - start
                offset += numel
    short = [key for key, numel in wanted.items() if seen.get(key, 0) != numel]
    if short:
        raise ValueError(f"optimizer states of {len(states)} ranks do not cover {len(short)} pieces of this "
                         f"rank's parameters, e.g. {short[:3]}")
    return full


def reshard(states: list[dict], buckets: list[Bucket], pieces: dict[int, list[tuple[str, int]]]
            ) -> tuple[list[torch.Tensor], dict[int, dict], int]:
    """(this rank's master shard per bucket, Adam's per-bucket state, the schedule position) from
    every saved rank's `state_dict` (each with a "layout")."""
    wanted = {key: numel for b in buckets for p in b.params for key, numel in pieces[id(p)]}
    full = _gather(states, wanted)
    steps = {int(v["step"]) for st in states for v in st["adam"]["state"].values()}
    if len(steps) > 1:
        raise ValueError(f"optimizer states disagree on the step count: {sorted(steps)}")
    step = next((v["step"] for st in states for v in st["adam"]["state"].values()), None)
    masters, adam_state = [], {}
    for b, bucket in enumerate(buckets):
        lo, hi = bucket.rank * bucket.shard_numel, (bucket.rank + 1) * bucket.shard_numel

        def mine(kind: str) -> torch.Tensor:
            flat = torch.cat([full[key][kind] for p in bucket.params for key, _ in pieces[id(p)]])
            return torch.cat([flat, flat.new_zeros(bucket.padded_numel - flat.numel())])[lo:hi].clone()

        masters.append(mine("master"))
        if step is not None:
            adam_state[b] = {"step": step.clone() if torch.is_tensor(step) else step, "exp_avg": mine("exp_avg"),
                             "exp_avg_sq": mine("exp_avg_sq")}
    return masters, adam_state, int(states[0].get("schedule_step", max(steps, default=0)))
