"""PPO's critic: the value model starts at V = 0 on the policy's trunk, its steps fit the GAE returns
(the value loss falls), and the train phase's estimate reads its values; the algo presets compose."""
import pytest
import torch

from models.value import ValueModel
from rl.config.algo import AlgoConfig, CriticConfig
from rl.config.compose import compose_run_config
from rl.run.advantages import KLController, estimate, overlong_penalty
from rl.run.critic import Critic
from rl.episodes.driver import Trajectory
from trainer.host_adam import OptimizerConfig
from trainer.losses import Segments, value_loss
from trainer.step import Trainer, TrainerConfig
from tests.rl.test_ppo_epochs import make_batch, make_model

PRESETS = ["grpo", "rloo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo", "gspo", "cispo"]


def make_critic(lr: float = 1e-2) -> Critic:
    policy = make_model()
    model = ValueModel(policy.config).init_weights(seed=1, std=0.1).start_from(policy)
    config = CriticConfig(enable=True, optimizer=OptimizerConfig(lr=lr, backend="torch"))
    return Critic(model, Trainer(model, TrainerConfig(num_chunks=2, optimizer=config.optimizer)), config)


def test_value_model_starts_at_zero_on_the_policys_trunk():
    critic, policy = make_critic(), make_model()
    batch = make_batch()
    assert torch.equal(critic.values(batch, None), torch.zeros(len(batch.token_ids)))
    own = critic.model.state_dict()
    for name, tensor in policy.state_dict().items():
        if not name.startswith("lm_head."):
            assert torch.equal(own[name], tensor), name
    assert tuple(critic.model.lm_head.weight.shape) == (1, policy.config.hidden_size)


def test_critic_steps_lower_the_value_loss_against_gae_returns():
    critic = make_critic()
    batch = make_batch()
    algo = AlgoConfig(advantage="gae", critic=CriticConfig(enable=True))
    values = critic.values(batch, None)
    estimate(batch, algo, batch.rewards, values=values)
    returns = batch.returns
    seg = Segments(batch.seq_of_row, batch.num_sequences)

    def loss_now() -> float:
        return float(value_loss(critic.values(batch, None), values, returns, batch.mask, None, seg)[0])

    before = loss_now()
    tokens = int(batch.mask.sum())
    for _ in range(5):
        metrics = critic.update(batch, critic.values(batch, None), returns, None, tokens,
                                [list(range(batch.num_sequences))], 1)
    assert set(metrics) >= {"critic/vf_loss", "critic/vf_clip_frac", "critic/grad_norm"}
    assert loss_now() < 0.9 * before, (before, loss_now())  # 5 steps at lr 1e-2: 0.82x measured; a broken step stays 1x


def test_gae_with_zero_values_and_lambda_one_is_the_whitened_return():
    batch = make_batch()
    algo = AlgoConfig(advantage="gae", critic=CriticConfig(enable=True))
    estimate(batch, algo, batch.rewards, values=torch.zeros(len(batch.token_ids)))
    # gamma = lam = 1, V = 0: every step's advantage is its sequence's reward, then whitened over tokens
    mask = batch.mask
    raw = batch.rewards[batch.seq_of_row][mask].double()
    expected = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(batch.advantages[mask].double(), expected, rtol=1e-5, atol=1e-5)  # fp32 whitening of O(1) values: ~100 roundings of 6e-8 each, 1e-5 of the scale
    assert torch.equal(batch.returns[mask], batch.rewards[batch.seq_of_row][mask])


def test_adaptive_kl_controller_moves_towards_its_target():
    from rl.config.algo import KLInRewardConfig
    ctl = KLController(KLInRewardConfig(coef=0.1, controller="adaptive", target_kl=0.1, horizon=100))
    ctl.update(kl=1.0, sequences=10)  # far above target: error clipped at 0.2 -> beta * (1 + 0.2 * 10 / 100)
    assert ctl.beta == pytest.approx(0.1 * 1.02)
    ctl.update(kl=0.0, sequences=10)
    assert ctl.beta == pytest.approx(0.1 * 1.02 * 0.98)
    fixed = KLController(KLInRewardConfig(coef=0.1))
    fixed.update(kl=1.0, sequences=10)
    assert fixed.beta == 0.1


def test_overlong_penalty_by_hand():
    from rl.config.algo import OverlongConfig
    algo = AlgoConfig(overlong=OverlongConfig(enable=True, buffer_tokens=2, penalty_factor=1.0))
    # turns of 3 and 4 policy tokens with max_new_tokens 4: expected length 2 -> -0.5 and -1.0
    traj = Trajectory("t", 0, 0, list(range(10)), [False, True, True, True, False, False, True, True, True, True],
                      [0.0] * 10, [-1] * 10, 0)
    assert overlong_penalty(traj, algo, 4) == pytest.approx(-1.5)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes(preset):
    cfg = compose_run_config([f"algo={preset}"])
    assert cfg.algo.critic.enable == (preset == "ppo")


def test_dapo_needs_headroom_and_composes_with_it():
    with pytest.raises(ValueError, match="no headroom"):
        compose_run_config(["algo=dapo"])
    cfg = compose_run_config(["algo=dapo", "rollout.budget_tokens=null", "rollout.max_groups_in_flight=null"])
    assert cfg.algo.filter_groups.enable and cfg.algo.overlong.enable
