"""Group advantages from sequence rewards (registry kind "advantage")."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from trainer.losses.checks import as_float, check_finite
from trainer.losses.registry import register


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """rewards [G * n] (groups contiguous) or [G, n] -> float [G, n], validated."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r}, expected an integer >= 1")
    if rewards.ndim == 2:
        if rewards.shape[1] != group_size:
            raise ValueError(f"rewards shape {tuple(rewards.shape)} has groups of {rewards.shape[1]}, "
                             f"expected [num_groups, group_size={group_size}]")
    elif rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards shape {tuple(rewards.shape)}, expected [num_groups * group_size] "
                         f"with group_size={group_size} or [num_groups, group_size]")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty, expected at least one group")
    check_finite("rewards", rewards)
    return as_float(rewards).reshape(-1, group_size)  # [G, n]


@register("advantage", "grpo")
def grpo_advantages(rewards: Tensor, group_size: int, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages (DeepSeekMath, arXiv:2402.03300 §4.1.2), one per sequence.

    rewards: [G * n] with each group's n samples contiguous, or [G, n]; returns the same shape.
    A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g when normalize_std is False (Dr. GRPO,
    arXiv:2503.20783, drops the std). std is the *unbiased* (Bessel, n - 1) standard deviation, as
    verl's GRPO (torch.std). A group of one sample or of equal rewards has advantage 0, never NaN
    (verl instead gives a singleton group advantage r_i: mean 0, std 1).
    """
    if not 0 <= eps < math.inf:
        raise ValueError(f"eps={eps!r}, expected a finite value >= 0")
    r = _grouped(rewards, group_size)  # [G, n]
    centred = r - r.mean(dim=1, keepdim=True)  # [G, n]
    if normalize_std and group_size > 1:
        centred = centred / (r.std(dim=1, unbiased=True, keepdim=True) + eps)
    # The mean of equal rewards can be off by an ulp, leaving residue (amplified by 1 / eps, or 0 / 0
    # with eps = 0); a group with nothing to compare has advantage exactly 0.
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)  # [G, 1]; always true for n = 1
    return torch.where(constant, 0.0, centred).reshape(rewards.shape)


@register("advantage", "rloo")
def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740): A_i = r_i - mean_{j != i} r_j.

    rewards: [G * n] or [G, n] as in `grpo_advantages`; returns the same shape. Equals
    n / (n - 1) * (r_i - mean_g); a group of one sample has advantage 0.
    """
    r = _grouped(rewards, group_size)  # [G, n]
    if group_size == 1:
        return torch.zeros_like(r).reshape(rewards.shape)  # no other sample to compare with
    centred = r - r.mean(dim=1, keepdim=True)  # [G, n]
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)  # [G, 1]; see grpo_advantages
    return torch.where(constant, 0.0, centred * (group_size / (group_size - 1))).reshape(rewards.shape)
