"""Validation of rl_loss's inputs: shapes at once, bad values counted on the device and raised after the
one host sync."""
from __future__ import annotations

import torch
from torch import Tensor

from trainer.losses.aggregation import Segments
from trainer.losses.config import LossConfig


def check_coefficients(config: LossConfig, ref_logp: Tensor | None, entropy: Tensor | None) -> None:
    """A nonzero coefficient needs its input."""
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logp, got None")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} needs entropy, got None")


def as_float(x: Tensor) -> Tensor:
    """fp32 for half/bf16/integer inputs; float32 and float64 are kept (float64 serves gradient checks)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


CHECK_NAMES = ("mask_not_01", "mask_valid", "logp", "advantages", "old_logp", "behaviour_logp", "ref_logp",
                "entropy")
"""The value checks of rl_loss's inputs, in the order `check_inputs` counts them."""


def check_finite(name: str, x: Tensor) -> None:
    num_bad = int((~torch.isfinite(x)).sum()) if x.is_floating_point() else 0
    if num_bad:
        raise ValueError(f"{name} has {num_bad} non-finite value(s) (NaN/inf) among its entries, expected all finite")


def _count_non_finite(x: Tensor | None, where: Tensor) -> Tensor:
    """[] int64: non-finite entries of x at the valid positions (0 for a missing or integer x)."""
    if x is None or not x.is_floating_point():
        return torch.zeros((), dtype=torch.long, device=where.device)
    return (~torch.isfinite(x) & where).sum()


def raise_on_bad_values(counts: dict[str, float], shape: tuple[int, ...], partial: bool = False) -> None:
    """Raise ValueError for the first failed value check (counts from `check_inputs`, on the host).
    partial: the rows are one rank's part of whole sequences (context parallelism), which may hold no
    valid token (a prompt's fragment) and must still take part in the step."""
    if counts["mask_not_01"]:
        raise ValueError(f"mask has {int(counts['mask_not_01'])} value(s) other than 0/1, expected a bool or 0/1 mask")
    if not counts["mask_valid"] and not partial:
        raise ValueError(f"empty batch: mask of shape {shape} has no valid token")
    for name in CHECK_NAMES[2:]:
        if counts[name]:
            raise ValueError(f"{name} has {int(counts[name])} non-finite value(s) (NaN/inf) among its valid tokens, "
                             f"expected all finite")


def check_inputs(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, segments: Segments | None,
                  **optional: Tensor | None) -> tuple[Tensor, Tensor]:
    """Check rl_loss's input shapes (raises at once) and count its bad values without a host sync.
    Returns (mask as bool, counts [len(CHECK_NAMES)] int64 on the mask's device: entries of the
    mask other than 0/1, valid tokens, then non-finite values at valid tokens per input), which `raise_on_bad_values` turns into errors once they are on the host."""
    if segments is not None:
        if logp.ndim != 1 or segments.ids.shape != logp.shape:
            raise ValueError(f"packed layout: logp shape {tuple(logp.shape)} and segments.ids shape "
                             f"{tuple(segments.ids.shape)}, expected both [N]")
        if advantages.shape != logp.shape:
            raise ValueError(f"packed layout: advantages shape {tuple(advantages.shape)}, expected one per row "
                             f"[N]={tuple(logp.shape)}")
        if logp.numel() == 0:
            raise ValueError("empty batch: logp has no row, expected N >= 1")
    elif logp.ndim != 2:
        raise ValueError(f"logp shape {tuple(logp.shape)}, expected [B, T] (or [N] with segments)")
    elif logp.shape[0] == 0 or logp.shape[1] == 0:
        raise ValueError(f"empty batch: logp shape {tuple(logp.shape)}, expected B >= 1 and T >= 1")
    if not logp.is_floating_point():
        raise ValueError(f"logp dtype {logp.dtype}, expected a floating dtype")
    named = {"old_logp": old_logp, "mask": mask, **{k: v for k, v in optional.items() if v is not None}}
    for name, x in named.items():
        if x.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} does not match logp shape {tuple(logp.shape)}")
    if segments is None and advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match logp shape "
                         f"{tuple(logp.shape)}, expected [B]={tuple(logp.shape[:1])} or [B, T]={tuple(logp.shape)}")
    not_01 = ((mask != 0) & (mask != 1)).sum() if mask.dtype != torch.bool else torch.zeros((), dtype=torch.long,
                                                                                             device=mask.device)
    mask = mask if mask.dtype == torch.bool else mask == 1
    adv = advantages[:, None].expand_as(mask) if advantages.shape != mask.shape else advantages
    counts = [not_01, mask.sum(), _count_non_finite(logp, mask), _count_non_finite(adv, mask)]
    counts += [_count_non_finite(optional.get(name) if name != "old_logp" else old_logp, mask)
               for name in CHECK_NAMES[4:]]
    return mask, torch.stack(counts)
