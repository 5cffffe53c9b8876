"""The critic's loss (PPO with a value model): clipped value regression to the GAE returns."""
from __future__ import annotations

import torch
from torch import Tensor

from trainer.losses.aggregation import Segments, token_mean


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None,
               segments: Segments | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 * max((V - R)^2, (V_clipped - R)^2) per valid token, token-mean (PPO2's value clipping, as
    verl's compute_value_loss; V_clipped = old_V + clamp(V - old_V, -clip, clip)); clip None = the plain
    squared error. values [N] carry the gradient; old_values, returns [N] are detached. With
    `segments.whole_tokens` (a context-parallel share) the mean divides by the whole sequences' tokens.
    Returns (loss, metrics: vf_loss, vf_clip_frac, vpred_mean as 0-dim tensors)."""
    values = torch.where(mask, values.float(), 0.0)
    old_values, returns = (torch.where(mask, x.detach().float(), 0.0) for x in (old_values, returns))
    plain = (values - returns).square()
    if clip is None:
        per_token, clipped = plain, torch.zeros_like(mask)
    else:
        bounded = old_values + (values - old_values).clamp(-clip, clip)
        other = (bounded - returns).square()
        per_token, clipped = torch.maximum(plain, other), other > plain
    loss = 0.5 * token_mean(per_token, mask, segments)
    num = mask.sum().clamp_min(1)
    return loss, {"vf_loss": loss.detach(), "vf_clip_frac": ((clipped & mask).sum() / num).detach().float(),
                  "vpred_mean": (values.detach().sum() / num).float()}
