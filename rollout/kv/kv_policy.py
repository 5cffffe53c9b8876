"""Token-eviction policies (rollout/kv/kv_eviction.py): registered functions with one interface.

A policy's `select(scores, positions, protected, keep)` returns which candidate tokens stay on the
device; `offload` says what happens to the others (dropped, or sent to the host and eligible to
come back). `heavy_hitters` — protected tokens, then the highest accumulated attention, ties to
the more recent token — serves both registered policies: "h2o" (drop) and "infinigen" (offload).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Select = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class EvictionPolicy:
    name: str
    select: Select
    """(scores [n] f64, positions [n] long, protected [n] bool, keep) -> bool mask [n] of the
    candidates that stay (every protected one, `keep` in all)."""
    offload: bool
    """True: what is not kept goes to the host and may come back; False: dropped."""


_POLICIES: dict[str, EvictionPolicy] = {}


def register_policy(name: str, offload: bool) -> Callable[[Select], Select]:
    def wrap(select: Select) -> Select:
        if name in _POLICIES:
            raise ValueError(f"eviction policy {name!r} is already registered")
        _POLICIES[name] = EvictionPolicy(name, select, offload)
        return select
    return wrap


def lookup_policy(name: str) -> EvictionPolicy:
    if name not in _POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; registered: {sorted(_POLICIES)}")
    return _POLICIES[name]


def heavy_hitters(scores: torch.Tensor, positions: torch.Tensor, protected: torch.Tensor, keep: int) -> torch.Tensor:
    """Keep every protected candidate, then the highest accumulated scores (ties: the more
    recent token) until `keep` stay."""
    stay = protected.clone()
    room = keep - int(protected.sum())
    if room < 0:
        raise ValueError(f"eviction: {int(protected.sum())} protected tokens exceed keep={keep}")
    free = (~protected).nonzero().flatten()
    if room and free.numel():
        # Sort by position descending first, then a stable sort by score: ties go to recency.
        by_recency = free[positions[free].argsort(descending=True, stable=True)]
        order = by_recency[scores[by_recency].argsort(descending=True, stable=True)]
        stay[order[:room]] = True
    return stay


register_policy("h2o", offload=False)(heavy_hitters)
register_policy("infinigen", offload=True)(heavy_hitters)
