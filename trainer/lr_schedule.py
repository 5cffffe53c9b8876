"""Learning-rate schedules: pure functions of the optimizer step, registered by name.

A schedule maps the step's position `step` (0-based: optimizer steps already taken) to a factor of
the configured lr. Every schedule shares the warm-up: a linear ramp from 0, (step + 1) /
(warmup_steps + 1) for step < warmup_steps (torchtitan's `linear_warmup`: the first step is not
wasted at lr 0). After it, "constant" stays at 1; "linear" and "cosine" decay from 1 at
step = warmup_steps to `min_lr_ratio` at step = total_steps (the position after the horizon's last
step; Loshchilov & Hutter, arXiv:1608.03983, for the cosine) and stay at the floor after it.
"""
from __future__ import annotations

import math
from collections.abc import Callable

LR_SCHEDULES: dict[str, Callable[[float, float], float]] = {}
"""name -> fn(progress in [0, 1] through the decay, min_lr_ratio) -> factor of the lr."""


def _register(name: str) -> Callable[[Callable[[float, float], float]], Callable[[float, float], float]]:
    def deco(fn: Callable[[float, float], float]) -> Callable[[float, float], float]:
        LR_SCHEDULES[name] = fn
        return fn
    return deco


@_register("constant")
def constant(progress: float, min_lr_ratio: float) -> float:
    """1 throughout (the floor is not used)."""
    return 1.0


@_register("linear")
def linear(progress: float, min_lr_ratio: float) -> float:
    """From 1 down to min_lr_ratio in a straight line."""
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)


@_register("cosine")
def cosine(progress: float, min_lr_ratio: float) -> float:
    """Half a cosine from 1 down to min_lr_ratio (SGDR without restarts)."""
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_factor(name: str, step: int, *, warmup_steps: int, min_lr_ratio: float, total_steps: int | None) -> float:
    """The factor of the lr for the optimizer step at position `step` (>= 0). `total_steps` may be
    None only for "constant" (nothing decays)."""
    if name not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule={name!r}, expected one of {sorted(LR_SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if name == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"lr_schedule={name!r} decays over total_steps, got None")
    if step >= total_steps:
        return LR_SCHEDULES[name](1.0, min_lr_ratio)
    return LR_SCHEDULES[name]((step - warmup_steps) / (total_steps - warmup_steps), min_lr_ratio)
