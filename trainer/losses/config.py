"""`LossConfig`: which registered pieces `rl_loss` combines, and their coefficients."""
from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.losses.registry import lookup


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
