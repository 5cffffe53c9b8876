"""`AlgoConfig`, the `algo` group: the advantage estimator, the loss (trainer/losses `LossConfig`), the
update's passes, and what shapes the batch before it (KL in the reward, DAPO's dynamic sampling and
overlong shaping, truncated completions masked, the critic of PPO with GAE). Names follow verl's
where verl has them (adv_estimator -> advantage, use_kl_in_reward -> kl_in_reward.coef > 0,
filter_groups, overlong_buffer, cliprange_value -> critic.value_clip)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainer.host_adam import OptimizerConfig
from trainer.losses import LossConfig

OUTCOME_ESTIMATORS = ("grpo", "rloo")
"""One advantage per sequence from the group's rewards (trainer/losses/advantages.py)."""


@dataclass(frozen=True, kw_only=True)
class KLInRewardConfig:
    """A per-token KL penalty in the reward, r_t -= coef * kl_t (InstructGPT, arXiv:2203.02155 eq. 2; verl's
    use_kl_in_reward), kl_t of the behaviour logprobs against the reference's. With an outcome estimator
    (grpo, rloo) a sequence's reward is its return, r - coef * sum_t kl_t."""
    coef: float = 0.0
    """Initial penalty coefficient beta, >= 0; 0 = off."""
    estimator: str = "k1"
    """Registered KL estimator of the per-token penalty ("k1" as verl's kl_penalty="kl")."""
    controller: str = "fixed"
    """"fixed" or "adaptive" (Ziegler et al. 2019, arXiv:1909.08593 §2.2: beta *= 1 + clip(KL / target_kl - 1,
    -0.2, 0.2) * sequences / horizon after each update)."""
    target_kl: float = 0.1
    """The adaptive controller's target per-token KL (mean over sequences of their token mean), > 0."""
    horizon: int = 10000
    """The adaptive controller's horizon in sequences, >= 1 (verl's default)."""

    def __post_init__(self) -> None:
        from trainer.losses import lookup

        lookup("kl_estimator", self.estimator)
        if not 0 <= self.coef < math.inf:
            raise ValueError(f"kl_in_reward.coef={self.coef!r}, expected a finite value >= 0 (0 = off)")
        if self.controller not in ("fixed", "adaptive"):
            raise ValueError(f"kl_in_reward.controller={self.controller!r}, expected 'fixed' or 'adaptive'")
        if not 0 < self.target_kl < math.inf or self.horizon < 1:
            raise ValueError(f"kl_in_reward.target_kl={self.target_kl}, horizon={self.horizon}, expected > 0 and >= 1")


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (arXiv:2503.14476 §3.2; verl's algorithm.filter_groups): groups whose rewards
    are all equal carry no gradient under a group baseline, so they are dropped and more prompts are
    sampled until rollout.groups_per_iteration groups with a spread are kept (the surplus is dropped
    too), within `max_rounds` rollout rounds per iteration."""
    enable: bool = False
    max_rounds: int = 4
    """Rollout rounds per iteration at most (each starts rollout.groups_per_iteration new groups), >= 2 (one
    round could only drop); the iteration trains what it kept when they run out (verl's max_num_gen_batches)."""

    def __post_init__(self) -> None:
        if self.enable and self.max_rounds < 2:
            raise ValueError(f"filter_groups.max_rounds={self.max_rounds}: dynamic sampling needs headroom to refill "
                             f"the batch, at least one round after the first; expected >= 2")


@dataclass(frozen=True, kw_only=True)
class OverlongConfig:
    """DAPO's soft overlong punishment (arXiv:2503.14476 eq. 13; verl's overlong_buffer): an answer of L tokens
    in a turn of max_new_tokens = L_max gets min(0, (L_max - buffer_tokens - L) / buffer_tokens) * penalty_factor
    added to its reward: 0 up to L_max - buffer_tokens, down to -penalty_factor at L_max."""
    enable: bool = False
    buffer_tokens: int = 1
    """The buffer L_cache before the per-turn limit, in [1, rollout.max_new_tokens]."""
    penalty_factor: float = 1.0
    """The penalty at the limit, >= 0."""

    def __post_init__(self) -> None:
        if self.buffer_tokens < 1 or not 0 <= self.penalty_factor < math.inf:
            raise ValueError(f"overlong.buffer_tokens={self.buffer_tokens}, penalty_factor={self.penalty_factor}, "
                             f"expected >= 1 and a finite value >= 0")


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """PPO's value model (advantage=gae): the policy's architecture with a scalar head in place of the LM
    head (models/value.py), its own weights, FP32 gradient slots, host optimizer states (spilled and
    restored with the policy's) and checkpoint, trained by a second `Trainer` with the policy's chunks
    and micro-batches."""
    enable: bool = False
    value_clip: float | None = 0.5
    """PPO2's value clipping range around the values before the update (verl's cliprange_value), > 0; null = off."""
    init: str = "policy"
    """"policy": the trunk starts as the policy's weights and the head at zero (V = 0 at first; as OpenRLHF
    and verl start the critic from the actor's or the reward model's weights); "random": a seeded init."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-3))
    """The critic's AdamW (its own lr: a value head learns faster than the policy may move)."""

    def __post_init__(self) -> None:
        if self.value_clip is not None and not 0 < self.value_clip < math.inf:
            raise ValueError(f"critic.value_clip={self.value_clip!r}, expected a finite value > 0 or null (off)")
        if self.init not in ("policy", "random"):
            raise ValueError(f"critic.init={self.init!r}, expected 'policy' or 'random'")


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    advantage: str = "grpo"
    """Registered advantage estimator (verl's adv_estimator names): "grpo", "rloo" (outcome level),
    "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae" (token level; gae needs critic.enable)."""
    group_size: int = 8
    """Samples per prompt (GRPO group), generated with parallel sampling."""
    scale_rewards: str = "group"
    """GRPO's advantage scale (TRL's scale_rewards): "group" (each group's std), "batch" (the std of every
    reward in the step's batch) or "none" (Dr. GRPO: centred only)."""
    gamma: float = 1.0
    """Discount over a sequence's policy tokens, in (0, 1]; < 1 only for reinforce_plus_plus and gae."""
    lam: float = 1.0
    """GAE's lambda, in [0, 1] (0: the TD error, 1: Monte-Carlo return minus the value)."""
    loss: LossConfig = field(default_factory=LossConfig)
    ppo_epochs: int = 1
    """Passes over each rollout batch per update (rl/run/update.py `policy_update`); 1 = one pass."""
    mini_batches: int = 1
    """Mini-batches (of whole sequences, one optimizer step each) per pass; > 1 needs one data-parallel rank."""
    kl_in_reward: KLInRewardConfig = field(default_factory=KLInRewardConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    mask_truncated: bool = False
    """Trajectories whose last answer hit rollout.max_new_tokens without a stop train no token (TRL's
    mask_truncated_completions; DAPO's overlong filtering); their rewards still count in the group."""
    critic: CriticConfig = field(default_factory=CriticConfig)

    def __post_init__(self) -> None:
        from trainer.losses import lookup

        lookup("advantage", self.advantage)
        if self.group_size < 2:
            raise ValueError(f"algo.group_size={self.group_size}, expected >= 2 (group advantages need peers)")
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError(f"algo.ppo_epochs={self.ppo_epochs}, algo.mini_batches={self.mini_batches}, "
                             f"expected both >= 1")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"algo.scale_rewards={self.scale_rewards!r}, expected 'group', 'batch' or 'none'")
        if self.scale_rewards != "group" and self.advantage != "grpo":
            raise ValueError(f"algo.scale_rewards={self.scale_rewards!r} scales GRPO's advantages, but algo.advantage="
                             f"{self.advantage!r}; expected scale_rewards=group (the default) or advantage=grpo")
        if not 0 < self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"algo.gamma={self.gamma}, algo.lam={self.lam}, expected gamma in (0, 1], lam in [0, 1]")
        if self.gamma < 1 and self.advantage not in ("reinforce_plus_plus", "gae"):
            raise ValueError(f"algo.gamma={self.gamma} discounts token rewards, but algo.advantage={self.advantage!r} "
                             f"scores whole sequences; expected gamma=1, or advantage reinforce_plus_plus or gae")
        if self.advantage == "gae" and not self.critic.enable:
            raise ValueError("algo.advantage='gae' needs a critic (its values), but algo.critic.enable=false; set "
                             "algo.critic.enable=true (configs/algo/ppo.yaml) or choose another estimator")
        if self.critic.enable and self.advantage != "gae":
            raise ValueError(f"algo.critic.enable=true trains a value model that only advantage=gae reads, but "
                             f"algo.advantage={self.advantage!r}; expected advantage=gae or critic.enable=false")

    @property
    def token_level(self) -> bool:
        """Whether the estimator scores tokens (needs whole sequences: no context-parallel share)."""
        return self.advantage not in OUTCOME_ESTIMATORS
