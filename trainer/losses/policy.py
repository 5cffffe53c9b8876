"""Per-token policy losses (registry kind "policy_loss")."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from trainer.losses.aggregation import Segments, packed, per_sequence
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
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, config: LossConfig, *,
                  mask: Tensor | None = None, segments: Segments | None = None) -> PolicyLossOutput:
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
                                config: LossConfig, *, mask: Tensor | None = None,
                                segments: Segments | None = None) -> PolicyLossOutput:
    """Unclipped importance-weighted policy gradient, loss = -r * A per token ([B, T]). At r = 1 its
    gradient is REINFORCE's, -A * grad(logp). Ignores the clip settings."""
    ratio = ratio_of(logp, old_logp)  # [B, T]
    never = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyLossOutput(-advantages * ratio, ratio, never, never)


@register("policy_loss", "gspo")
def gspo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, config: LossConfig, *,
              mask: Tensor | None = None, segments: Segments | None = None) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071 eq. 5 and its token form, eq. 13): one importance
    ratio per sequence, s_i = exp(mean_t (logp - old_logp)) over its valid tokens (the geometric mean of
    the token ratios), clipped to [1 - clip_eps_low, 1 + clip_eps_high] in the PPO way. Per token
    s_i,t = sg(s_i) * pi / sg(pi): its value is s_i, its gradient s_i * grad(logp) (verl's "gspo"
    loss_mode; with the sequence's token mean, GSPO's s_i * mean_t grad(logp)). Inputs [B, T] (a row
    per sequence) or packed [N] with `segments`; mask None = every entry valid. The log ratio is
    clamped at 10 as verl does (e^10: the clip binds long before)."""
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask
    delta, flat_mask, seg = packed(torch.where(mask, logp.detach() - old_logp, 0.0), mask, segments)
    seq_log_ratio = per_sequence(delta, seg) / seg.tokens(flat_mask).clamp_min(1)  # [S]
    per_row = seq_log_ratio[seg.ids].reshape(logp.shape).to(logp.dtype)  # [B, T] or [N]
    ratio = torch.exp((logp - logp.detach() + per_row).clamp(max=10.0))  # value s_i, gradient through logp
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_eps_low, 1 + config.clip_eps_high)
    never = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyLossOutput(torch.maximum(unclipped, clipped), ratio.detach(), clipped > unclipped, never)


@register("policy_loss", "cispo")
def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, config: LossConfig, *,
               mask: Tensor | None = None, segments: Segments | None = None) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585 eq. 4): loss = -sg(clip(r, 1 - clip_eps_low, 1 + clip_eps_high))
    * A * logp per token, r = exp(logp - old_logp). The IS weight is clipped and detached, so every
    token keeps the REINFORCE gradient -w * A * grad(logp), none is dropped by the clip (PPO's clip
    zeroes the gradient of a clipped token). MiniMax-M1 sets no lower bound (clip_eps_low = 1) and tunes
    the upper one. `clipped` marks tokens whose weight was clipped (their gradient is kept)."""
    ratio = ratio_of(logp, old_logp)
    weight = ratio.detach().clamp(1 - config.clip_eps_low, 1 + config.clip_eps_high)
    never = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyLossOutput(-weight * advantages * logp, ratio.detach(), weight != ratio.detach(), never)
