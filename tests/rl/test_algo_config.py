"""The algorithm menu's config: each preset composes, bad combinations are refused by name."""
from __future__ import annotations

import pytest

from rl.config.algo import AlgoConfig, CriticConfig, FilterGroupsConfig, KLInRewardConfig
from trainer.losses import LossConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"advantage": "gae"}, r"advantage='gae' needs a critic"),
    ({"critic": CriticConfig(enable=True)}, r"critic.enable=true trains a value model that only advantage=gae reads"),
    ({"gamma": 0.9}, r"gamma=0.9 discounts token rewards, but algo.advantage='grpo'"),
    ({"scale_rewards": "batch", "advantage": "rloo"}, r"scale_rewards='batch' scales GRPO's advantages"),
    ({"lam": 1.5, "advantage": "gae", "critic": CriticConfig(enable=True)}, r"lam=1.5"),
])
def test_bad_algorithm_combinations_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**kwargs)


def test_dynamic_sampling_without_headroom_is_refused():
    with pytest.raises(ValueError, match=r"max_rounds=1: dynamic sampling needs headroom"):
        FilterGroupsConfig(enable=True, max_rounds=1)


def test_a_sequence_loss_with_a_token_clip_range_is_refused():
    with pytest.raises(ValueError, match=r"policy_loss='gspo' with clip_eps_low=0.2"):
        LossConfig(policy_loss="gspo")
    assert LossConfig(policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4).clip_eps_high == 4e-4


def test_kl_in_reward_values_are_checked():
    with pytest.raises(ValueError, match=r"controller='pid'"):
        KLInRewardConfig(coef=0.1, controller="pid")
    with pytest.raises(ValueError, match=r"unknown kl_estimator 'k9'"):
        KLInRewardConfig(estimator="k9")


def test_token_level_estimators_are_marked():
    assert not AlgoConfig().token_level and not AlgoConfig(advantage="rloo").token_level
    assert AlgoConfig(advantage="reinforce_plus_plus").token_level
    assert AlgoConfig(advantage="gae", critic=CriticConfig(enable=True)).token_level
