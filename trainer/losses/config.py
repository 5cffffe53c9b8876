"""`LossConfig`: which registered pieces `rl_loss` combines, and their coefficients."""
from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.losses.registry import lookup


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Which registered pieces `rl_loss` combines, and their coefficients."""

    policy_loss: str = "ppo"
    """Registered policy loss: "ppo" (clipped surrogate), "pg" (unclipped importance-weighted), "gspo"
    (sequence-level ratio, arXiv:2507.18071), "cispo" (clipped stop-gradient IS weight, arXiv:2506.13585)."""
    clip_eps_low: float = 0.2
    """Lower clip: ratio >= 1 - clip_eps_low, in [0, 1] (1 = no lower bound: CISPO's choice). 0.2 as PPO
    (arXiv:1707.06347); GSPO clips its sequence ratio at 3e-4."""
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
    """Registered reduction over valid tokens ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
    "seq-mean-token-sum-norm": token sums over sequences x `agg_norm_tokens`, Dr. GRPO's constant)."""
    agg_norm_tokens: int | None = None
    """The constant normaliser of "seq-mean-token-sum-norm" (Dr. GRPO, arXiv:2503.20783: the generation
    budget; verl's loss_scale_factor), >= 1; the RL run fills null with its policy tokens' budget
    (rollout.max_new_tokens x the task's turns). Other aggregations ignore it."""
    tis_cap: float | None = 2.0
    """Rollout correction's upper bound on the engine/trainer ratio exp(old_logp - behaviour_logp), >= 1;
    None = off. 2 as Yao et al. 2025 (verl's rollout_is_threshold)."""
    rollout_is_mode: str = "truncate"
    """What a ratio above `tis_cap` (or below `rollout_is_threshold_lower`) gets: "truncate" (weight
    min(ratio, cap): TIS) or "mask" (weight 0: masked IS; ratios inside the bounds keep their value)."""
    rollout_is_level: str = "token"
    """"token" (each token's ratio) or "sequence" (one ratio per sequence, the product of its tokens',
    every token weighted by it; whole sequences masked)."""
    rollout_is_threshold_lower: float | None = None
    """Lower bound of the masked mode, in (0, 1]; None = 1 / tis_cap. Truncation has no lower bound."""

    def __post_init__(self) -> None:
        for kind, name in (("policy_loss", self.policy_loss), ("kl_estimator", self.kl_estimator),
                           ("aggregation", self.aggregation)):
            lookup(kind, name)
        if not 0 <= self.clip_eps_low <= 1:
            raise ValueError(f"clip_eps_low={self.clip_eps_low!r}, expected a value in [0, 1]")
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
        self._check_sequence_level()
        self._check_rollout_is()

    def _check_sequence_level(self) -> None:
        # GSPO's ratio is a geometric mean over a sequence: it stays within ~1e-3 of 1, so PPO's token-level
        # range (0.2) would never bind and the loss would be unclipped in effect.
        if self.policy_loss == "gspo" and max(self.clip_eps_low, self.clip_eps_high) > GSPO_MAX_CLIP:
            raise ValueError(f"policy_loss='gspo' with clip_eps_low={self.clip_eps_low}, clip_eps_high="
                             f"{self.clip_eps_high}: a token-level clip range on a sequence-level ratio never binds; "
                             f"expected both <= {GSPO_MAX_CLIP} (GSPO: 3e-4 and 4e-4; configs/algo/gspo.yaml)")
        if self.aggregation == "seq-mean-token-sum-norm" and self.agg_norm_tokens is not None \
                and self.agg_norm_tokens < 1:
            raise ValueError(f"agg_norm_tokens={self.agg_norm_tokens}, expected an integer >= 1 (or null: the run's "
                             f"policy-token budget)")

    def _check_rollout_is(self) -> None:
        if self.rollout_is_mode not in ("truncate", "mask"):
            raise ValueError(f"rollout_is_mode={self.rollout_is_mode!r}, expected 'truncate' or 'mask'")
        if self.rollout_is_level not in ("token", "sequence"):
            raise ValueError(f"rollout_is_level={self.rollout_is_level!r}, expected 'token' or 'sequence'")
        low = self.rollout_is_threshold_lower
        if low is not None and not 0 < low <= 1:
            raise ValueError(f"rollout_is_threshold_lower={low!r}, expected None (1 / tis_cap) or a value in (0, 1]")
        if low is not None and self.rollout_is_mode != "mask":
            raise ValueError(f"rollout_is_threshold_lower={low} with rollout_is_mode={self.rollout_is_mode!r}: only the "
                             f"masked mode has a lower bound; expected rollout_is_mode='mask' or no lower bound")

    @property
    def rollout_is_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the masked mode's kept ratios."""
        upper = float(self.tis_cap)
        return (1 / upper if self.rollout_is_threshold_lower is None else self.rollout_is_threshold_lower), upper


GSPO_MAX_CLIP = 0.01
"""The widest clip range a sequence-level ratio accepts (GSPO's are 3e-4 and 4e-4)."""
