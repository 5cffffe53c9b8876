"""Per-token policy losses (registry kind "policy_loss")."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from trainer.losses.config import LossConfig
from trainer.losses.registry import register


class PolicyLossOutput(NamedTuple):
    """Per-token results of a registered policy loss; all [B, T]."""

    loss: Tensor
    """Per-token policy-gradient loss (before TIS weighting and aggregation)."""
    ratio: Tensor
    """exp(logp - old_logp)."""
    clipped: Tensor
    """bool: the clip was binding (the token's gradient is zero)."""
    dual_clipped: Tensor
    """bool: the dual-clip bound was binding."""


# verl clamps the log ratio to +-20 before exp (core_algos.compute_policy_loss): a ratio of e^20 ~ 5e8
# is meaningless anyway, and it keeps exp finite, so a zero advantage never meets inf (0 * inf = NaN).
MAX_LOG_RATIO = 20.0


def ratio_of(logp: Tensor, old_logp: Tensor) -> Tensor:
    return torch.exp((logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B, T]


@register("policy_loss", "ppo")
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, config: LossConfig) -> PolicyLossOutput:
    """PPO clipped surrogate (arXiv:1707.06347 eq. 7) with separate low/high clips (DAPO clip-higher,
    arXiv:2503.14476 §3.1), per token. logp, old_logp, advantages: [B, T].

    loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) = max(-r A, -clip(r) A): the
    pessimistic side. With dual_clip_c, a negative-advantage token's loss is further capped at -A * c.
    """
    ratio = ratio_of(logp, old_logp)  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1 - config.clip_eps_low, 1 + config.clip_eps_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if config.dual_clip_c is not None:
        bound = -advantages * config.dual_clip_c  # [B, T]
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return PolicyLossOutput(loss, ratio, clipped > unclipped, dual_clipped)


@register("policy_loss", "pg")
def importance_weighted_pg_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor,
                                config: LossConfig) -> PolicyLossOutput:
    """Unclipped importance-weighted policy gradient, loss = -r * A per token ([B, T]). At r = 1 its
    gradient is REINFORCE's, -A * grad(logp). Ignores the clip settings."""
    ratio = ratio_of(logp, old_logp)  # [B, T]
    never = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyLossOutput(-advantages * ratio, ratio, never, never)
