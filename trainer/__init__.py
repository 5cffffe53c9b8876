"""Training engine (see README.md). RL losses live in trainer/losses/."""
from trainer.losses import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossConfig,
    PolicyLossOutput,
    Segments,
    grpo_advantages,
    lookup,
    register,
    rl_loss,
    rloo_advantages,
)

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "LossConfig", "PolicyLossOutput", "Segments",
    "grpo_advantages", "lookup", "register", "rl_loss", "rloo_advantages",
]
