"""RL losses: group advantages, per-token policy losses, KL estimators, aggregation, one entry point.

Every algorithm is a pure function registered by name in one of four registries (`register`,
`lookup`); `LossConfig` names the ones `rl_loss` uses, so a new variant is a new registered function,
not a new flag.

Layouts: per-token tensors are either padded, [B, T] (row b is sequence b), or packed, [N] with
`Segments` naming each row's sequence (the trainer's layout: no padding). `rl_loss` and the
aggregations compute on the packed layout; a padded input is flattened into it (views, no copy),
so both give the same loss. The per-token functions (policy losses, KL estimators) are elementwise.

Three log-probability tensors of the sampled tokens, all [B, T] (or [N]), and which is which:
- `behaviour_logp`: recorded by the rollout engine when the token was sampled (rollout/sampling.py's
  convention). With partial rollouts a sequence's tokens may come from several *older* weight
  versions, and the inference kernels differ numerically from the trainer's.
- `old_logp`: recomputed by the trainer with the weights at the start of this training step, before
  any update (PPO's pi_old, the proximal policy). No gradient.
- `logp`: the policy being optimised, recomputed for each minibatch. The only input (with `entropy`)
  gradients flow through.
The PPO ratio is exp(logp - old_logp) (arXiv:1707.06347); the truncated importance-sampling (TIS)
weight min(exp(old_logp - behaviour_logp), tis_cap) corrects for pi_old not being the distribution the
tokens were drawn from (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
RL training"; verl's `tis_imp_ratio_cap`).

Words: a *valid* token is a response token with mask 1; padding and prompt tokens are masked out and
may hold any value, NaN included (they are replaced by 0 before any arithmetic).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

# ---- registries ------------------------------------------------------------------------------------
ADVANTAGES: dict[str, Callable[..., Tensor]] = {}
"""name -> fn(rewards [N] or [G, n], group_size, **options) -> advantages, same shape as rewards."""
POLICY_LOSSES: dict[str, Callable[..., "PolicyLossOutput"]] = {}
"""name -> fn(logp, old_logp, advantages, config) -> PolicyLossOutput; all tensors [B, T]."""
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}
"""name -> fn(logp, ref_logp) -> per-token estimate of KL(pi || ref), all [B, T]."""
AGGREGATIONS: dict[str, Callable[..., Tensor]] = {}
"""name -> fn(values, mask bool, segments=None) -> scalar; values, mask [B, T] (segments None) or
packed [N] with `segments`."""

_REGISTRIES: dict[str, dict[str, Callable]] = {
    "advantage": ADVANTAGES, "policy_loss": POLICY_LOSSES,
    "kl_estimator": KL_ESTIMATORS, "aggregation": AGGREGATIONS,
}


def register(kind: str, name: str) -> Callable[[Callable], Callable]:
    """Decorator adding a function to the `kind` registry under `name` (a name is registered once)."""
    registry = _registry(kind)
    if name in registry:
        raise ValueError(f"{kind} {name!r} is already registered (by {registry[name].__qualname__})")

    def deco(fn: Callable) -> Callable:
        registry[name] = fn
        return fn
    return deco


def lookup(kind: str, name: str) -> Callable:
    """The function registered as `name` in the `kind` registry; ValueError lists the known names."""
    registry = _registry(kind)
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}, expected one of {sorted(registry)}")
    return registry[name]


def _registry(kind: str) -> dict[str, Callable]:
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown registry kind {kind!r}, expected one of {sorted(_REGISTRIES)}")
    return _REGISTRIES[kind]


# ---- advantages --------------------------------------------------------------------------------------
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
    _check_finite("rewards", rewards)
    return _as_float(rewards).reshape(-1, group_size)  # [G, n]


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


# ---- KL estimators (Schulman, http://joschu.net/blog/kl-approx.html) -------------------------------------
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


# ---- layouts -------------------------------------------------------------------------------------------
class Segments(NamedTuple):
    """The packed layout's sequences: row i of an [N] tensor belongs to sequence `ids[i]`."""

    ids: Tensor
    """[N] int64, on the rows' device: each row's sequence, in [0, count)."""
    count: int
    """Number of sequences (some may own no valid row)."""

    @staticmethod
    def of_rows(shape: torch.Size, device: torch.device) -> "Segments":
        """The padded layout [B, T] seen as packed: row-major, row b of the padding is sequence b."""
        return Segments(torch.arange(shape[0], device=device).repeat_interleave(shape[1]), shape[0])


def _packed(values: Tensor, mask: Tensor, segments: Segments | None) -> tuple[Tensor, Tensor, Segments]:
    """(values [N], mask [N], segments) from either layout (a padded one is flattened: a view)."""
    if segments is None:
        segments = Segments.of_rows(values.shape, values.device)
        return values.reshape(-1), mask.reshape(-1), segments
    return values, mask, segments


def _per_sequence(x: Tensor, segments: Segments) -> Tensor:
    """[count]: the sum of each sequence's rows of x [N]."""
    return torch.zeros(segments.count, dtype=x.dtype, device=x.device).index_add_(0, segments.ids, x)


# ---- aggregation (DAPO, arXiv:2503.14476 §3.3, and verl's `loss_agg_mode`) ---------------------------
@register("aggregation", "token-mean")
def token_mean(values: Tensor, mask: Tensor, segments: Segments | None = None) -> Tensor:
    """Sum over valid tokens / number of valid tokens in the batch: every token weighs the same (DAPO's
    token-level loss), so long responses are not down-weighted. Either layout -> scalar.

    The count is this call's; a batch split into micro-batches must rescale by its share of tokens.
    """
    return torch.where(mask, values, 0.0).sum() / mask.sum()


@register("aggregation", "seq-mean-token-mean")
def seq_mean_token_mean(values: Tensor, mask: Tensor, segments: Segments | None = None) -> Tensor:
    """Mean over sequences of each sequence's token mean (the original GRPO objective): every sequence
    weighs the same. Sequences without a valid token are left out of the mean. Either layout -> scalar."""
    values, mask, segments = _packed(values, mask, segments)
    num_tokens = _per_sequence(mask.to(values.dtype), segments)  # [S]
    has_tokens = num_tokens > 0  # [S]
    per_seq = _per_sequence(torch.where(mask, values, 0.0), segments) / num_tokens.clamp_min(1)  # [S]
    return torch.where(has_tokens, per_seq, 0.0).sum() / has_tokens.sum()  # no boolean indexing: no sync


@register("aggregation", "seq-mean-token-sum")
def seq_mean_token_sum(values: Tensor, mask: Tensor, segments: Segments | None = None) -> Tensor:
    """Mean over sequences of each sequence's token sum. Sequences without a valid token are left out
    of the mean. Either layout -> scalar."""
    values, mask, segments = _packed(values, mask, segments)
    has_tokens = _per_sequence(mask.to(values.dtype), segments) > 0  # [S]
    return torch.where(has_tokens, _per_sequence(torch.where(mask, values, 0.0), segments), 0.0).sum() / has_tokens.sum()


# ---- config ------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Which registered pieces `rl_loss` combines, and their coefficients."""

    policy_loss: str = "ppo"
    """Registered policy loss ("ppo": clipped surrogate; "pg": unclipped importance-weighted)."""
    clip_eps_low: float = 0.2
    """PPO lower clip: ratio >= 1 - clip_eps_low, in [0, 1). 0.2 as PPO (arXiv:1707.06347)."""
    clip_eps_high: float = 0.2
    """PPO upper clip: ratio <= 1 + clip_eps_high, > 0. 0.2 = symmetric PPO; DAPO's clip-higher uses 0.28."""
    dual_clip_c: float | None = None
    """Dual-clip bound (arXiv:1912.09729) on the loss of negative-advantage tokens, -A * c, > 1; None = off (verl: 3)."""
    kl_estimator: str = "k3"
    """Registered KL(pi || ref) estimator ("k1", "k2", "k3"); k3 as GRPO."""
    kl_coef: float = 0.0
    """Weight of the KL loss term, >= 0; 0 = no reference model needed (DAPO drops the KL)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss -= entropy_coef * entropy), >= 0; 0 = off."""
    aggregation: str = "token-mean"
    """Registered reduction over valid tokens ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")."""
    tis_cap: float | None = 2.0
    """Truncated IS cap on exp(old_logp - behaviour_logp), >= 1; None = off. 2 as Yao et al. 2025."""

    def __post_init__(self) -> None:
        for kind, name in (("policy_loss", self.policy_loss), ("kl_estimator", self.kl_estimator),
                           ("aggregation", self.aggregation)):
            lookup(kind, name)
        if not 0 <= self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low={self.clip_eps_low!r}, expected a value in [0, 1)")
        if not 0 < self.clip_eps_high < math.inf:
            raise ValueError(f"clip_eps_high={self.clip_eps_high!r}, expected a finite value > 0")
        if self.dual_clip_c is not None and not 1 < self.dual_clip_c < math.inf:
            raise ValueError(f"dual_clip_c={self.dual_clip_c!r}, expected None or a finite value > 1")
        for field_name in ("kl_coef", "entropy_coef"):
            value = getattr(self, field_name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{field_name}={value!r}, expected a finite value >= 0")
        # A cap below 1 would scale down on-policy tokens too (their weight is exactly 1): a hidden
        # learning-rate change, not a truncation.
        if self.tis_cap is not None and not 1 <= self.tis_cap < math.inf:
            raise ValueError(f"tis_cap={self.tis_cap!r}, expected None (off) or a finite value >= 1")


# ---- policy losses -------------------------------------------------------------------------------------
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
_MAX_LOG_RATIO = 20.0


def _ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    return torch.exp((logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B, T]


@register("policy_loss", "ppo")
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, config: LossConfig) -> PolicyLossOutput:
    """PPO clipped surrogate (arXiv:1707.06347 eq. 7) with separate low/high clips (DAPO clip-higher,
    arXiv:2503.14476 §3.1), per token. logp, old_logp, advantages: [B, T].

    loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) = max(-r A, -clip(r) A): the
    pessimistic side. With dual_clip_c, a negative-advantage token's loss is further capped at -A * c.
    """
    ratio = _ratio(logp, old_logp)  # [B, T]
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
    ratio = _ratio(logp, old_logp)  # [B, T]
    never = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyLossOutput(-advantages * ratio, ratio, never, never)


# ---- entry point ---------------------------------------------------------------------------------------
def rl_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, config: LossConfig, *,
            behaviour_logp: Tensor | None = None, ref_logp: Tensor | None = None,
            entropy: Tensor | None = None, segments: Segments | None = None) -> tuple[Tensor, dict[str, float]]:
    """The scalar RL loss of one (micro-)batch and its metrics.

    logp, old_logp, behaviour_logp, ref_logp, entropy, mask: [B, T] (see the module docstring for
    which logp is which); advantages: [B] (one per sequence, broadcast over its tokens) or [B, T];
    mask: bool or 0/1, True for valid (response) tokens. Half-precision inputs are computed in fp32.
    With `segments` every input is packed instead, [N] (advantages too: one per row), and
    `segments` names each row's sequence; the padded layout is computed as its flattening, so both
    layouts of the same tokens give the same loss.

    Per token: pg = policy_loss * tis_weight, tis_weight = min(exp(old_logp - behaviour_logp), tis_cap)
    (detached; 1 when behaviour_logp is None or tis_cap is None; it weights the policy term only, as
    verl); kl = kl_estimator(logp, ref_logp); the loss is
        aggregate(pg) + kl_coef * aggregate(kl) - entropy_coef * aggregate(entropy).
    Gradients flow through logp and entropy only. Nothing is mutated.

    Metrics (floats): loss, pg_loss, num_tokens, clip_frac, dual_clip_frac, ratio_mean, ratio_max;
    kl when ref_logp is given; entropy when entropy is given; tis_weight_mean, tis_capped_frac and
    tis_raw_ratio_max when behaviour_logp is given and tis_cap is set. pg_loss, kl and entropy use the
    configured aggregation (so loss = pg_loss + kl_coef * kl - entropy_coef * entropy); fractions
    and ratio statistics are over valid tokens.

    Raises ValueError on shape mismatch, an empty batch (B = 0, T = 0 or no valid token), a mask value
    other than 0/1, a non-finite input at a valid token, or a nonzero coefficient whose input is missing.
    """
    mask, bad_counts = _check_inputs(logp, old_logp, advantages, mask, segments, behaviour_logp=behaviour_logp,
                                     ref_logp=ref_logp, entropy=entropy)
    shape = tuple(mask.shape)
    if segments is None:  # padded [B, T] -> packed [B * T] (views)
        segments = Segments.of_rows(logp.shape, logp.device)
        if advantages.ndim == 1:
            advantages = advantages[:, None].expand_as(logp)  # [B, T]
        logp, old_logp, advantages, mask, behaviour_logp, ref_logp, entropy = (
            None if x is None else x.reshape(-1)
            for x in (logp, old_logp, advantages, mask, behaviour_logp, ref_logp, entropy))
    _check_coefficients(config, ref_logp, entropy)

    def valid(x: Tensor) -> Tensor:
        # masked-out positions may hold anything (NaN); zero them so they cannot poison sums or grads
        return torch.where(mask, _as_float(x), 0.0)  # [N]

    logp, old_logp, advantages = valid(logp), valid(old_logp).detach(), valid(advantages).detach()
    chosen = lookup("aggregation", config.aggregation)

    def aggregate(values: Tensor, where: Tensor) -> Tensor:
        return chosen(values, where, segments)

    num_tokens = mask.sum()
    item, frac, masked_max = _metric_helpers(mask, num_tokens)

    out = lookup("policy_loss", config.policy_loss)(logp, old_logp, advantages, config)
    pg = out.loss  # [N]
    metrics: dict[str, Tensor] = {}
    if behaviour_logp is not None and config.tis_cap is not None:
        raw = torch.exp(old_logp - valid(behaviour_logp).detach())  # [N]
        tis_weight = raw.clamp(max=config.tis_cap)  # [N]
        pg = pg * tis_weight
        metrics.update(tis_weight_mean=item(token_mean(tis_weight, mask)),
                       tis_capped_frac=frac(raw > config.tis_cap), tis_raw_ratio_max=masked_max(raw))
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
    names = list(metrics)
    values = torch.cat([bad_counts.float(), torch.stack([metrics[n] for n in names]).to(bad_counts.device)]).tolist()
    _raise_on_bad_values(dict(zip(_CHECK_NAMES, values)), shape)
    return loss, dict(zip(names, values[len(_CHECK_NAMES):]))


def _metric_helpers(mask: Tensor, num_tokens: Tensor) -> tuple[Callable, Callable, Callable]:
    """(item, frac, masked_max) over the valid tokens. Metrics stay 0-dim tensors until rl_loss's end,
    where they and the input checks' counts reach the host in one transfer: one host sync per call
    (on CUDA every .item() would be one)."""
    def item(x: Tensor) -> Tensor:
        return x.detach().float()

    def frac(flags: Tensor) -> Tensor:
        return item((flags & mask).sum() / num_tokens)

    def masked_max(x: Tensor) -> Tensor:
        return item(torch.where(mask, x, float("-inf")).max())  # no boolean indexing: no data-dependent shape

    return item, frac, masked_max


# ---- validation ----------------------------------------------------------------------------------------
def _check_coefficients(config: LossConfig, ref_logp: Tensor | None, entropy: Tensor | None) -> None:
    """A nonzero coefficient needs its input."""
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logp, got None")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} needs entropy, got None")


def _as_float(x: Tensor) -> Tensor:
    """fp32 for half/bf16/integer inputs; float32 and float64 are kept (float64 serves gradient checks)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


_CHECK_NAMES = ("mask_not_01", "mask_valid", "logp", "advantages", "old_logp", "behaviour_logp", "ref_logp",
                "entropy")
"""The value checks of rl_loss's inputs, in the order `_check_inputs` counts them."""


def _check_finite(name: str, x: Tensor) -> None:
    num_bad = int((~torch.isfinite(x)).sum()) if x.is_floating_point() else 0
    if num_bad:
        raise ValueError(f"{name} has {num_bad} non-finite value(s) (NaN/inf) among its entries, expected all finite")


def _count_non_finite(x: Tensor | None, where: Tensor) -> Tensor:
    """[] int64: non-finite entries of x at the valid positions (0 for a missing or integer x)."""
    if x is None or not x.is_floating_point():
        return torch.zeros((), dtype=torch.long, device=where.device)
    return (~torch.isfinite(x) & where).sum()


def _raise_on_bad_values(counts: dict[str, float], shape: tuple[int, ...]) -> None:
    """Raise ValueError for the first failed value check (counts from `_check_inputs`, on the host)."""
    if counts["mask_not_01"]:
        raise ValueError(f"mask has {int(counts['mask_not_01'])} value(s) other than 0/1, expected a bool or 0/1 mask")
    if not counts["mask_valid"]:
        raise ValueError(f"empty batch: mask of shape {shape} has no valid token")
    for name in _CHECK_NAMES[2:]:
        if counts[name]:
            raise ValueError(f"{name} has {int(counts[name])} non-finite value(s) (NaN/inf) among its valid tokens, "
                             f"expected all finite")


def _check_inputs(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, segments: Segments | None,
                  **optional: Tensor | None) -> tuple[Tensor, Tensor]:
    """Check rl_loss's input shapes (raises at once) and count its bad values without a host sync.
    Returns (mask as bool, counts [len(_CHECK_NAMES)] int64 on the mask's device: entries of the
    mask other than 0/1, valid tokens, then non-finite values at valid tokens per input), which `_raise_on_bad_values` turns into errors once they are on the host."""
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
               for name in _CHECK_NAMES[4:]]
    return mask, torch.stack(counts)
