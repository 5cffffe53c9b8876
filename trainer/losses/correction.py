"""Rollout correction: importance weights for the gap between the engine that sampled the tokens
(behaviour logprobs) and the trainer's policy at the update's start (old logprobs): stale partial
rollouts and the two sides' numerics (KDA by recurrence in the engine, by chunks in the trainer).

ratio = exp(old_logp - behaviour_logp), per token or, at the sequence level, one per sequence (the
product of its tokens' ratios). Modes (verl's rollout_is_mode): "truncate" weights by min(ratio, cap)
(TIS, Yao et al. 2025); "mask" keeps the ratio inside [lower, cap] and gives 0 outside it (masked IS:
a token, or a whole sequence, the engine and the trainer disagree on too much is not trained on).
Weights are detached and multiply the policy term only."""
from __future__ import annotations

import torch
from torch import Tensor

from trainer.losses.aggregation import Segments, per_sequence
from trainer.losses.config import LossConfig
from trainer.losses.policy import MAX_LOG_RATIO


def rollout_weights(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, segments: Segments,
                    config: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """(weight [N], metrics as 0-dim tensors) on the packed rows; `config.tis_cap` must be set.
    Metrics: tis_weight_mean (over valid tokens), tis_capped_frac (valid tokens whose weight is not
    their ratio: truncated or masked), tis_raw_ratio_max, and in the masked mode rollout_is_masked_frac."""
    log_ratio = torch.where(mask, old_logp - behaviour_logp, 0.0)  # [N]
    if config.rollout_is_level == "sequence":
        per_seq = per_sequence(log_ratio, segments).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [S]: log of the product
        raw = torch.exp(per_seq)[segments.ids]  # [N]
    else:
        raw = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    cap = float(config.tis_cap)
    if config.rollout_is_mode == "mask":
        lower, upper = config.rollout_is_bounds
        outside = (raw < lower) | (raw > upper)
        weight = torch.where(outside, 0.0, raw)
    else:
        outside = raw > cap
        weight = raw.clamp(max=cap)
    num = mask.sum().clamp_min(1)
    metrics = {"tis_weight_mean": torch.where(mask, weight, 0.0).sum() / num,
               "tis_capped_frac": (outside & mask).sum() / num,
               "tis_raw_ratio_max": torch.where(mask, raw, float("-inf")).max()}
    if config.rollout_is_mode == "mask":
        metrics["rollout_is_masked_frac"] = metrics["tis_capped_frac"]
    return weight.detach(), {k: v.detach().float() for k, v in metrics.items()}
