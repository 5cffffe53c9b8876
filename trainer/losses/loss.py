"""`rl_loss`: the one entry point combining a policy loss, truncated IS, a KL term and an entropy bonus."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from trainer.losses.aggregation import Segments, token_mean
from trainer.losses.checks import CHECK_NAMES, as_float, check_coefficients, check_inputs, raise_on_bad_values
from trainer.losses.config import LossConfig
from trainer.losses.correction import rollout_weights
from trainer.losses.registry import lookup


def rl_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, config: LossConfig, *,
            behaviour_logp: Tensor | None = None, ref_logp: Tensor | None = None,
            entropy: Tensor | None = None, segments: Segments | None = None) -> tuple[Tensor, dict[str, float]]:
    """The scalar RL loss of one (micro-)batch and its metrics.

    logp, old_logp, behaviour_logp, ref_logp, entropy, mask: [B, T] (see the module docstring for
    which logp is which); advantages: [B] (one per sequence, broadcast over its tokens) or [B, T];
    mask: bool or 0/1, True for valid (response) tokens. Half-precision inputs are computed in fp32.
    With `segments` every input is packed instead, [N] (advantages too: one per row), and
    `segments` names each row's sequence; the padded layout is computed as its flattening, so both
    layouts of the same tokens give the same loss. With `segments.whole_tokens` (context
    parallelism: the rows are this rank's part of whole sequences) the aggregations divide by the
    whole sequences' counts, so the ranks' losses sum to the unsplit loss.

    Per token: pg = policy_loss * tis_weight, tis_weight the rollout correction's weight of
    exp(old_logp - behaviour_logp) (trainer/losses/correction.py: truncated or masked, per token or per
    sequence; detached; 1 when behaviour_logp is None or tis_cap is None; it weights the policy term
    only, as verl); kl = kl_estimator(logp, ref_logp); the loss is
        aggregate(pg) + kl_coef * aggregate(kl) - entropy_coef * aggregate(entropy).
    Gradients flow through logp and entropy only. Nothing is mutated.

    Metrics (floats): loss, pg_loss, num_tokens, clip_frac, dual_clip_frac, ratio_mean, ratio_max;
    kl when ref_logp is given; entropy when entropy is given; tis_weight_mean, tis_capped_frac and
    tis_raw_ratio_max when behaviour_logp is given and tis_cap is set. pg_loss, kl and entropy use the
    configured aggregation (so loss = pg_loss + kl_coef * kl - entropy_coef * entropy); fractions
    and ratio statistics are over valid tokens.

    Raises ValueError on shape mismatch, an empty batch (B = 0, T = 0 or no valid token, unless the rows
    are a context-parallel share), a mask value other than 0/1, a non-finite input at a valid token,
    or a nonzero coefficient whose input is missing.
    """
    mask, bad_counts = check_inputs(logp, old_logp, advantages, mask, segments, behaviour_logp=behaviour_logp,
                                     ref_logp=ref_logp, entropy=entropy)
    shape = tuple(mask.shape)
    if segments is None:  # padded [B, T] -> packed [B * T] (views)
        segments = Segments.of_rows(logp.shape, logp.device)
        if advantages.ndim == 1:
            advantages = advantages[:, None].expand_as(logp)  # [B, T]
        logp, old_logp, advantages, mask, behaviour_logp, ref_logp, entropy = (None if x is None else x.reshape(-1)
            for x in (logp, old_logp, advantages, mask, behaviour_logp, ref_logp, entropy))
    check_coefficients(config, ref_logp, entropy)

    def valid(x: Tensor) -> Tensor:  # masked-out positions may hold anything (NaN): zeroed for sums and grads
        return torch.where(mask, as_float(x), 0.0)  # [N]

    logp, old_logp, advantages = valid(logp), valid(old_logp).detach(), valid(advantages).detach()
    chosen = lookup("aggregation", config.aggregation)
    if config.aggregation == "seq-mean-token-sum-norm":
        chosen = functools.partial(chosen, norm_tokens=config.agg_norm_tokens)

    def aggregate(values: Tensor, where: Tensor) -> Tensor:
        return chosen(values, where, segments)

    num_tokens = mask.sum()
    item, frac, masked_max = _metric_helpers(mask, num_tokens)

    out, pg, metrics = _policy_term(logp, old_logp, advantages, mask, segments, config,
                                    None if behaviour_logp is None else valid(behaviour_logp).detach())
    pg_loss = aggregate(pg, mask)
    loss = pg_loss
    if ref_logp is not None:
        kl = aggregate(lookup("kl_estimator", config.kl_estimator)(logp, valid(ref_logp).detach()), mask)
        loss = loss + config.kl_coef * kl
        metrics["kl"] = item(kl)
    if entropy is not None:
        ent = aggregate(valid(entropy), mask)
        loss = loss - config.entropy_coef * ent
        metrics["entropy"] = item(ent)
    metrics.update(loss=item(loss), pg_loss=item(pg_loss), num_tokens=item(num_tokens.float()),
                   clip_frac=frac(out.clipped), dual_clip_frac=frac(out.dual_clipped),
                   ratio_mean=item(token_mean(out.ratio, mask)), ratio_max=masked_max(out.ratio))
    _spread_shares(metrics, segments, num_tokens)
    names = list(metrics)
    values = torch.cat([bad_counts.float(), torch.stack([metrics[n] for n in names]).to(bad_counts.device)]).tolist()
    raise_on_bad_values(dict(zip(CHECK_NAMES, values)), shape, partial=segments.whole_tokens is not None)
    return loss, dict(zip(names, values[len(CHECK_NAMES):]))


def _policy_term(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, segments: Segments,
                 config: LossConfig, behaviour_logp: Tensor | None) -> tuple:
    """(the policy loss's output, its per-token term weighted by the rollout correction [N], the
    correction's metrics)."""
    out = lookup("policy_loss", config.policy_loss)(logp, old_logp, advantages, config, mask=mask, segments=segments)
    pg, metrics = out.loss, {}
    if behaviour_logp is not None and config.tis_cap is not None:
        weight, metrics = rollout_weights(old_logp, behaviour_logp, mask, segments, config)
        pg = pg * weight
    return out, pg, metrics


def _spread_shares(metrics: dict[str, Tensor], segments: Segments, num_tokens: Tensor) -> None:
    """Without `segments.whole_tokens`, nothing. With it the rows are part of whole sequences
    (context parallelism) and the aggregates this call's share of the whole ones: loss, pg_loss, kl
    and entropy are reported times (whole tokens / own tokens), so the ranks' values merged weighted
    by their own tokens (as micro-batches and ranks are) sum the shares back. In place."""
    if segments.whole_tokens is None:
        return
    spread = segments.whole_tokens.sum().float() / num_tokens.clamp_min(1)
    for name in ("loss", "pg_loss", "kl", "entropy"):
        if name in metrics:
            metrics[name] = metrics[name] * spread


def _metric_helpers(mask: Tensor, num_tokens: Tensor) -> tuple[Callable, Callable, Callable]:
    """(item, frac, masked_max) over the valid tokens. Metrics stay 0-dim tensors until rl_loss's end,
    where they and the input checks' counts reach the host in one transfer: one host sync per call
    (on CUDA every .item() would be one)."""
    def item(x: Tensor) -> Tensor:
        return x.detach().float()

    def frac(flags: Tensor) -> Tensor:
        return item((flags & mask).sum() / num_tokens.clamp_min(1))  # (0 without valid tokens: a CP share)

    def masked_max(x: Tensor) -> Tensor:
        return item(torch.where(mask, x, float("-inf")).max())  # no boolean indexing: no data-dependent shape

    return item, frac, masked_max
