"""Per-token estimators of KL(pi || ref) (registry kind "kl_estimator"; Schulman,
http://joschu.net/blog/kl-approx.html)."""
from __future__ import annotations

import torch
from torch import Tensor

from trainer.losses.registry import register

@register("kl_estimator", "k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log pi - log ref, [B, T]: unbiased for KL(pi || ref) under tokens drawn from pi, high variance,
    negative on some tokens."""
    return logp - ref_logp


@register("kl_estimator", "k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = (log pi - log ref)^2 / 2, [B, T]: biased, low variance, >= 0."""
    return 0.5 * (logp - ref_logp).square()


@register("kl_estimator", "k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = ref/pi - log(ref/pi) - 1, [B, T]: unbiased for KL(pi || ref) under tokens drawn from pi, >= 0.

    The KL term of GRPO (arXiv:2402.03300 eq. 4; verl's "low_var_kl"). Written expm1(d) - d with
    d = ref_logp - logp: expm1(d) >= d holds exactly and rounding is monotone, so the float result is
    never negative (exp(d) - d - 1 can be, for |d| ~ 1e-7). Not clamped (verl clamps to [-10, 10]):
    the values are returned as computed.
    """
    d = ref_logp - logp
    return torch.expm1(d) - d
