"""RL losses: hand-computed values, clipping sides, aggregation on ragged masks, gradients, errors.

Expected numbers are written out by hand or computed by plain-Python loops over lists, never by the
code under test.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.losses import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossConfig,
    Segments,
    grpo_advantages,
    lookup,
    register,
    rl_loss,
    rloo_advantages,
)

LOG = math.log


def t(rows, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


# ---- registry -------------------------------------------------------------------------------------------
def test_registries_hold_the_documented_names():
    assert set(ADVANTAGES) >= {"grpo", "rloo"}
    assert set(POLICY_LOSSES) >= {"ppo", "pg"}
    assert set(KL_ESTIMATORS) >= {"k1", "k2", "k3"}
    assert set(AGGREGATIONS) >= {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum"}
    assert lookup("advantage", "grpo") is grpo_advantages


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown kl_estimator 'k9'.*\['k1', 'k2', 'k3'\]"):
        lookup("kl_estimator", "k9")
    with pytest.raises(ValueError, match=r"unknown registry kind 'loss'.*'policy_loss'"):
        lookup("loss", "ppo")
    with pytest.raises(ValueError, match=r"unknown aggregation 'mean'.*'token-mean'"):
        LossConfig(aggregation="mean")


def test_register_adds_a_name_once():
    @register("kl_estimator", "test-zero")
    def zero(logp, ref_logp):
        return torch.zeros_like(logp)
    try:
        assert lookup("kl_estimator", "test-zero") is zero
        assert LossConfig(kl_estimator="test-zero").kl_estimator == "test-zero"
        with pytest.raises(ValueError, match="'test-zero' is already registered"):
            register("kl_estimator", "test-zero")
    finally:
        del KL_ESTIMATORS["test-zero"]


# ---- advantages -----------------------------------------------------------------------------------------
def test_grpo_advantages_by_hand():
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 2: all equal -> 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # 0.86602...
    adv = grpo_advantages(t([1, 0, 0, 1, 1, 1, 1, 1]), 4)
    assert adv.shape == (8,)
    torch.testing.assert_close(adv, t([a, -a, -a, a, 0, 0, 0, 0]))
    assert abs(a - 0.8660237) < 1e-6
    # [G, n] gives the same numbers in the same shape
    torch.testing.assert_close(grpo_advantages(t([[1, 0, 0, 1], [1, 1, 1, 1]]), 4), t([[a, -a, -a, a], [0, 0, 0, 0]]))


def test_grpo_advantages_mean_only_and_uneven_rewards():
    torch.testing.assert_close(grpo_advantages(t([1, 0, 0, 1]), 4, normalize_std=False), t([0.5, -0.5, -0.5, 0.5]))
    # rewards [3, 1, 2]: mean 2, unbiased std sqrt((1 + 1 + 0) / 2) = 1
    torch.testing.assert_close(grpo_advantages(t([3, 1, 2]), 3, eps=0.0), t([1.0, -1.0, 0.0]))


def test_grpo_singleton_and_constant_groups_are_zero_not_nan():
    adv = grpo_advantages(t([5.0, -2.0, 7.0]), 1)
    assert torch.equal(adv, t([0.0, 0.0, 0.0]))
    adv = grpo_advantages(t([0.3, 0.3, 0.3, 0.3]), 2, eps=0.0)
    assert torch.equal(adv, t([0.0, 0.0, 0.0, 0.0]))
    # fp32 mean of seven 0.1s is off by 7.5e-9; divided by (std 0 + eps 1e-6) that would be -0.0075
    assert torch.equal(grpo_advantages(t([0.1] * 7), 7), torch.zeros(7))


@given(st.floats(-1e6, 1e6, width=32), st.integers(2, 9), st.booleans())
@settings(max_examples=100, deadline=None)
def test_equal_rewards_give_exactly_zero(reward, n, normalize_std):
    # the float mean of n equal values can be off by an ulp; that residue must not become an advantage
    rewards = t([reward] * n)
    assert torch.equal(grpo_advantages(rewards, n, normalize_std=normalize_std), torch.zeros(n))
    assert torch.equal(rloo_advantages(rewards, n), torch.zeros(n))


def test_rloo_advantages_by_hand():
    # A_i = r_i - mean of the other three
    torch.testing.assert_close(rloo_advantages(t([1, 0, 0, 1]), 4), t([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.equal(rloo_advantages(t([4.0, 9.0]), 1), t([0.0, 0.0]))


@given(st.lists(st.floats(-10, 10), min_size=1, max_size=6), st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_grpo_matches_a_plain_python_loop(group, num_groups):
    rewards = [r + g for g in range(num_groups) for r in group]
    n = len(group)
    expected = []
    for g in range(num_groups):
        rs = rewards[g * n:(g + 1) * n]
        mean = sum(rs) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - 1)) if n > 1 else 0.0
        constant = all(r == rs[0] for r in rs)
        expected += [0.0 if constant else (r - mean) / (std + 1e-6) for r in rs]
    got = grpo_advantages(t(rewards, torch.float64), n)
    torch.testing.assert_close(got, t(expected, torch.float64), atol=1e-6, rtol=1e-6)


def test_advantage_errors():
    with pytest.raises(ValueError, match=r"rewards shape \(6,\).*group_size=4"):
        grpo_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match=r"rewards shape \(2, 3\) has groups of 3.*group_size=4"):
        grpo_advantages(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match=r"group_size=0"):
        grpo_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match=r"eps=-1.0, expected a finite value >= 0"):
        grpo_advantages(torch.zeros(4), 2, eps=-1.0)
    with pytest.raises(ValueError, match="rewards is empty"):
        grpo_advantages(torch.zeros(0), 2)
    with pytest.raises(ValueError, match=r"rewards has 2 non-finite"):
        grpo_advantages(t([1.0, float("nan"), float("inf"), 0.0]), 2)


# ---- KL estimators --------------------------------------------------------------------------------------
def test_k1_k2_k3_by_hand():
    # pi = 0.5, ref = 0.25:  log ratio = ln 2; ref/pi = 0.5 -> k3 = 0.5 - ln 0.5 - 1 = ln 2 - 0.5
    # pi = 0.2, ref = 0.6:   log ratio = -ln 3; ref/pi = 3 -> k3 = 3 - ln 3 - 1 = 2 - ln 3
    logp, ref = t([[LOG(0.5), LOG(0.2)]]), t([[LOG(0.25), LOG(0.6)]])
    torch.testing.assert_close(lookup("kl_estimator", "k1")(logp, ref), t([[LOG(2), -LOG(3)]]))
    torch.testing.assert_close(lookup("kl_estimator", "k2")(logp, ref), t([[LOG(2) ** 2 / 2, LOG(3) ** 2 / 2]]))
    torch.testing.assert_close(lookup("kl_estimator", "k3")(logp, ref), t([[LOG(2) - 0.5, 2 - LOG(3)]]))
    assert torch.equal(lookup("kl_estimator", "k3")(logp, logp), torch.zeros(1, 2))


@given(st.floats(-30, 0), st.floats(-30, 0), st.sampled_from([torch.float32, torch.float64]))
@settings(max_examples=300, deadline=None)
def test_k3_is_never_negative(logp, ref_logp, dtype):
    k3 = lookup("kl_estimator", "k3")(torch.tensor([logp], dtype=dtype), torch.tensor([ref_logp], dtype=dtype))
    assert k3.item() >= 0.0


@given(st.floats(-1e-6, 1e-6), st.floats(-3, 0))
@settings(max_examples=200, deadline=None)
def test_k3_is_never_negative_for_tiny_log_ratios(delta, logp):
    # exp(d) - d - 1 rounds below zero for |d| ~ 1e-7 in fp32; the estimator must not
    lp = torch.tensor([logp], dtype=torch.float32)
    assert lookup("kl_estimator", "k3")(lp, lp + delta).item() >= 0.0


def test_k1_and_k3_are_unbiased_for_kl_under_samples_from_pi():
    # pi = [0.7, 0.2, 0.1], ref = [0.2, 0.3, 0.5]; exact expectation under pi (weights, not samples)
    pi, ref = [0.7, 0.2, 0.1], [0.2, 0.3, 0.5]
    kl = sum(p * LOG(p / q) for p, q in zip(pi, ref))
    logp, ref_logp = t([[LOG(p) for p in pi]], torch.float64), t([[LOG(q) for q in ref]], torch.float64)
    weights = t([pi], torch.float64)
    for name in ("k1", "k3"):
        est = (lookup("kl_estimator", name)(logp, ref_logp) * weights).sum().item()
        assert est == pytest.approx(kl, rel=1e-12), name


# ---- aggregation ----------------------------------------------------------------------------------------
RAGGED_VALUES = [[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0], [7.0, 7.0, 7.0, 7.0]]
RAGGED_MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]  # third sequence has no valid token


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 3 + 10 + 20) / 5),    # 7.2
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + (10 + 20) / 2) / 2),  # (2 + 15) / 2 = 8.5
    ("seq-mean-token-sum", ((1 + 2 + 3) + (10 + 20)) / 2),  # 18
])
def test_aggregation_on_a_ragged_mask(mode, expected):
    got = lookup("aggregation", mode)(t(RAGGED_VALUES), t(RAGGED_MASK).bool())
    assert got.item() == pytest.approx(expected)


@given(st.lists(st.lists(st.tuples(st.floats(-100, 100), st.booleans()), min_size=1, max_size=5),
                min_size=1, max_size=4))
@settings(max_examples=80, deadline=None)
def test_aggregations_match_plain_python_loops(rows):
    width = max(len(r) for r in rows)
    rows = [r + [(0.0, False)] * (width - len(r)) for r in rows]
    if not any(m for r in rows for _, m in r):
        rows[0][0] = (rows[0][0][0], True)
    values = t([[v for v, _ in r] for r in rows], torch.float64)
    mask = torch.tensor([[m for _, m in r] for r in rows])
    valid = [[v for v, m in r if m] for r in rows]
    nonempty = [s for s in valid if s]
    expected = {
        "token-mean": sum(sum(s) for s in valid) / sum(len(s) for s in valid),
        "seq-mean-token-mean": sum(sum(s) / len(s) for s in nonempty) / len(nonempty),
        "seq-mean-token-sum": sum(sum(s) for s in nonempty) / len(nonempty),
    }
    for mode, want in expected.items():
        assert lookup("aggregation", mode)(values, mask).item() == pytest.approx(want, rel=1e-9, abs=1e-9), mode


# ---- PPO clipping ---------------------------------------------------------------------------------------
def ppo_tokens(ratios, advantages, **config):
    """Per-token PPO loss for one sequence of the given ratios/advantages (old_logp = 0)."""
    logp = t([[LOG(r) for r in ratios]])
    out = lookup("policy_loss", "ppo")(logp, torch.zeros_like(logp), t([advantages]), LossConfig(**config))
    return out.loss[0].tolist(), out.clipped[0].tolist(), out.dual_clipped[0].tolist()


def test_ppo_takes_the_pessimistic_side():
    # eps 0.2: clip range [0.8, 1.2]
    #   A=+1, r=1.5: -min(1.5, 1.2) = -1.2 (clipped)    A=+1, r=0.5: -min(0.5, 0.8) = -0.5 (not)
    #   A=-1, r=1.5: -min(-1.5, -1.2) = 1.5 (not)       A=-1, r=0.5: -min(-0.5, -0.8) = 0.8 (clipped)
    #   A=+2, r=1.1: inside the range -> -2.2            A=0: 0, never counted as clipped
    loss, clipped, _ = ppo_tokens([1.5, 0.5, 1.5, 0.5, 1.1, 3.0], [1, 1, -1, -1, 2, 0])
    assert loss == pytest.approx([-1.2, -0.5, 1.5, 0.8, -2.2, 0.0])
    assert clipped == [True, False, False, True, False, False]


def test_ppo_clip_higher_is_asymmetric():
    # eps_low 0.2, eps_high 0.28 (DAPO): range [0.8, 1.28]
    loss, clipped, _ = ppo_tokens([1.25, 1.5, 0.7], [1, 1, -1], clip_eps_high=0.28)
    assert loss == pytest.approx([-1.25, -1.28, 0.8])
    assert clipped == [False, True, True]


def test_ppo_dual_clip_caps_negative_advantage_loss():
    # c = 3: A=-1, r=5 -> max(5, 1.2) = 5, capped at 3; A=-1, r=2 -> 2; A=+1, r=5 -> -1.2 (no dual clip)
    loss, clipped, dual = ppo_tokens([5.0, 2.0, 5.0], [-1, -1, 1], dual_clip_c=3.0)
    assert loss == pytest.approx([3.0, 2.0, -1.2])
    assert dual == [True, False, False]
    assert clipped == [False, False, True]
    loss, _, dual = ppo_tokens([5.0], [-1])
    assert loss == pytest.approx([5.0]) and dual == [False]


def test_clipped_tokens_get_no_gradient():
    ratios, adv = [1.5, 0.5, 1.5, 0.5, 1.1], [1.0, 1.0, -1.0, -1.0, 2.0]
    logp = t([[LOG(r) for r in ratios]]).requires_grad_()
    loss, metrics = rl_loss(logp, torch.zeros(1, 5), t([adv]), torch.ones(1, 5), LossConfig())
    loss.backward()
    # token-mean over 5 tokens: d(-r A)/d logp = -r A / 5 where unclipped, 0 where clipped
    expected = [0.0, -0.5 * 1 / 5, -1.5 * -1 / 5, 0.0, -1.1 * 2 / 5]
    torch.testing.assert_close(logp.grad, t([expected]))
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert metrics["pg_loss"] == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8 - 2.2) / 5)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5)


# ---- rl_loss --------------------------------------------------------------------------------------------
def test_on_policy_first_step_is_minus_token_mean_advantage():
    logp = t([[-1.0, -2.0, -0.5, -3.0], [-0.1, -0.2, -0.3, -0.4]]).requires_grad_()
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    loss, metrics = rl_loss(logp, logp.detach().clone(), t([1.0, -2.0]), mask, LossConfig())
    # token-mean over 4 valid tokens: -(1 + 1 + 1 - 2) / 4
    assert loss.item() == pytest.approx(-0.25)
    assert metrics["ratio_mean"] == 1.0 and metrics["ratio_max"] == 1.0 and metrics["clip_frac"] == 0.0
    assert metrics["num_tokens"] == 4.0
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-0.25, -0.25, -0.25, 0.0], [0.5, 0.0, 0.0, 0.0]]))


def test_on_policy_seq_mean_token_mean_weights_sequences_equally():
    logp = t([[-1.0, -2.0, -0.5, -3.0], [-0.1, -0.2, -0.3, -0.4]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    loss, _ = rl_loss(logp, logp, t([1.0, -2.0]), mask, LossConfig(aggregation="seq-mean-token-mean"))
    assert loss.item() == pytest.approx(-(1.0 + -2.0) / 2)
    loss, _ = rl_loss(logp, logp, t([1.0, -2.0]), mask, LossConfig(aggregation="seq-mean-token-sum"))
    assert loss.item() == pytest.approx(-(3 * 1.0 + 1 * -2.0) / 2)


def test_per_token_advantages_and_nan_padding_are_ignored():
    nan = float("nan")
    logp = t([[-1.0, nan], [-0.5, -0.7]]).requires_grad_()
    adv = t([[2.0, nan], [-1.0, 4.0]])
    loss, _ = rl_loss(logp, t([[-1.0, nan], [-0.5, -0.7]]), adv, t([[1, 0], [1, 1]]).bool(), LossConfig())
    assert loss.item() == pytest.approx(-(2.0 - 1.0 + 4.0) / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0.0


def test_tis_weights_are_capped_and_detached():
    # old/behaviour ratios 1.5, 3, 0.5 -> weights 1.5, 2 (cap), 0.5
    old = t([[-1.0, -2.0, -0.5]])
    behaviour = (old - t([[LOG(1.5), LOG(3.0), LOG(0.5)]])).requires_grad_()
    logp = old.clone().requires_grad_()
    loss, metrics = rl_loss(logp, old, t([1.0]), torch.ones(1, 3), LossConfig(tis_cap=2.0),
                            behaviour_logp=behaviour)
    assert loss.item() == pytest.approx(-(1.5 + 2.0 + 0.5) / 3)
    assert metrics["tis_weight_mean"] == pytest.approx(4 / 3)
    assert metrics["tis_capped_frac"] == pytest.approx(1 / 3)
    assert metrics["tis_raw_ratio_max"] == pytest.approx(3.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-1.5 / 3, -2.0 / 3, -0.5 / 3]]))
    assert behaviour.grad is None
    # tis_cap=None: weights off, behaviour_logp ignored
    loss, metrics = rl_loss(old, old, t([1.0]), torch.ones(1, 3), LossConfig(tis_cap=None), behaviour_logp=behaviour)
    assert loss.item() == pytest.approx(-1.0) and "tis_weight_mean" not in metrics


def test_tis_off_policy_by_hand_with_all_three_logprobs_different():
    """logp != old_logp != behaviour_logp: the PPO ratio r = exp(logp - old) is 1.1, 0.9, 1.5 (clipped to 1.2
    with A = 1), the TIS weight w = exp(old - behaviour) is 1.5, 3 -> 2 (cap), 0.5; per token
    loss = -min(r, clip(r)) * w and d loss / d logp = -r * w / 3 where unclipped (0 where clipped). A weight
    computed from logp (or from behaviour against logp) gives other numbers."""
    old = t([[-1.0, -2.0, -0.5]])
    logp = (old + t([[LOG(1.1), LOG(0.9), LOG(1.5)]])).requires_grad_()
    behaviour = old - t([[LOG(1.5), LOG(3.0), LOG(0.5)]])
    loss, metrics = rl_loss(logp, old, t([1.0]), torch.ones(1, 3), LossConfig(tis_cap=2.0), behaviour_logp=behaviour)
    assert loss.item() == pytest.approx(-(1.1 * 1.5 + 0.9 * 2.0 + 1.2 * 0.5) / 3, rel=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx((1.5 + 2.0 + 0.5) / 3, rel=1e-6)
    assert metrics["tis_raw_ratio_max"] == pytest.approx(3.0, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-1.1 * 1.5 / 3, -0.9 * 2.0 / 3, 0.0]]), rtol=1e-5, atol=1e-7)


def test_kl_and_entropy_terms_by_hand():
    # on-policy, A = 0: loss = kl_coef * mean k3 - entropy_coef * mean entropy
    logp = t([[LOG(0.5), LOG(0.2)]])
    ref = t([[LOG(0.25), LOG(0.6)]])
    ent = t([[1.0, 3.0]])
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, metrics = rl_loss(logp, logp, t([0.0]), torch.ones(1, 2), cfg, ref_logp=ref, entropy=ent)
    k3_mean = ((LOG(2) - 0.5) + (2 - LOG(3))) / 2
    assert metrics["kl"] == pytest.approx(k3_mean)
    assert metrics["entropy"] == pytest.approx(2.0)
    assert loss.item() == pytest.approx(0.1 * k3_mean - 0.01 * 2.0)
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] + 0.1 * metrics["kl"] - 0.01 * metrics["entropy"])


def test_gradient_matches_hand_derivation_and_finite_differences():
    # Unclipped case: every ratio inside [0.8, 1.2]. For valid token t (N valid tokens, token-mean):
    #   d loss / d logp_t = (-A_t r_t w_t + kl_coef (1 - exp(ref_t - logp_t))) / N
    torch.manual_seed(0)
    B, T = 3, 5
    old = -torch.rand(B, T, dtype=torch.float64) * 3
    logp0 = old + (torch.rand(B, T, dtype=torch.float64) - 0.5) * 0.3  # |log r| < 0.15
    behaviour = old + (torch.rand(B, T, dtype=torch.float64) - 0.5) * 0.5
    ref = old + (torch.rand(B, T, dtype=torch.float64) - 0.5)
    adv = torch.randn(B, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    cfg = LossConfig(kl_coef=0.3, tis_cap=1.1)

    def f(lp):
        return rl_loss(lp, old, adv, mask, cfg, behaviour_logp=behaviour, ref_logp=ref)[0]

    logp = logp0.clone().requires_grad_()
    f(logp).backward()
    n = 10
    expected = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for s in range(T):
            if mask[b, s]:
                r = math.exp(logp0[b, s] - old[b, s])
                w = min(math.exp(old[b, s] - behaviour[b, s]), 1.1)
                expected[b, s] = (-adv[b].item() * r * w + 0.3 * (1 - math.exp(ref[b, s] - logp0[b, s]))) / n
    torch.testing.assert_close(logp.grad, expected, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(f, (logp0.clone().requires_grad_(),))


@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.sampled_from(sorted(AGGREGATIONS)),
       st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_the_packed_layout_gives_the_padded_layouts_loss_metrics_and_gradients(lens, aggregation, seed):
    """The same ragged sequences, packed (no padding; Segments) and padded ([B, T], NaN in the
    padding): equal loss, metrics and gradient at every token."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lens)

    def draw(scale=1.0, shift=0.0):
        return (torch.rand(rows, generator=gen, dtype=torch.float64) - 0.5) * scale + shift

    old, behaviour, ref, ent = draw(1, -1), draw(1, -1), draw(1, -1), draw(1, 1)
    logp = old + draw(0.6)
    adv_per_seq = torch.randn(len(lens), generator=gen, dtype=torch.float64)
    mask = torch.rand(rows, generator=gen) < 0.7
    mask[0] = True
    ids = torch.tensor([j for j, n in enumerate(lens) for _ in range(n)])
    cfg = LossConfig(aggregation=aggregation, kl_coef=0.2, entropy_coef=0.05, dual_clip_c=3.0)
    cols = torch.tensor([c for n in lens for c in range(n)])

    def pad(x, fill=float("nan")):
        out = torch.full((len(lens), max(lens)), fill, dtype=x.dtype)
        out[ids, cols] = x
        return out

    packed_logp, padded_logp = logp.clone().requires_grad_(), pad(logp).requires_grad_()
    packed, pm = rl_loss(packed_logp, old, adv_per_seq[ids], mask, cfg, behaviour_logp=behaviour, ref_logp=ref,
                         entropy=ent, segments=Segments(ids, len(lens)))
    padded, qm = rl_loss(padded_logp, pad(old), adv_per_seq, pad(mask, False), cfg, behaviour_logp=pad(behaviour),
                         ref_logp=pad(ref), entropy=pad(ent))
    packed.backward()
    padded.backward()
    assert packed.item() == pytest.approx(padded.item(), rel=1e-12, abs=1e-12)
    assert pm.keys() == qm.keys() and all(pm[k] == pytest.approx(qm[k], rel=1e-12, abs=1e-12) for k in pm)
    torch.testing.assert_close(packed_logp.grad, padded_logp.grad[ids, cols], rtol=1e-12, atol=1e-14)


def test_the_packed_layout_refuses_mismatched_segments():
    with pytest.raises(ValueError, match=r"segments.ids shape \(2,\), expected both \[N\]"):
        rl_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3), LossConfig(),
                segments=Segments(torch.zeros(2, dtype=torch.long), 1))
    with pytest.raises(ValueError, match="advantages shape .*expected one per row"):
        rl_loss(torch.zeros(3), torch.zeros(3), torch.zeros(1), torch.ones(3), LossConfig(),
                segments=Segments(torch.zeros(3, dtype=torch.long), 1))


def test_entropy_gradient_flows():
    ent = t([[0.5, 1.5, 2.0]]).requires_grad_()
    logp = t([[-1.0, -1.0, -1.0]])
    loss, _ = rl_loss(logp, logp, t([0.0]), t([[1, 1, 0]]), LossConfig(entropy_coef=0.1), entropy=ent)
    loss.backward()
    torch.testing.assert_close(ent.grad, t([[-0.05, -0.05, 0.0]]))


def test_half_precision_inputs_compute_in_fp32():
    logp = t([[LOG(1.1), 0.0]]).to(torch.bfloat16)
    loss, _ = rl_loss(logp, torch.zeros(1, 2, dtype=torch.bfloat16), t([1.0]), torch.ones(1, 2), LossConfig())
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(-(1.1 + 1.0) / 2, rel=1e-2)


def test_huge_log_ratio_with_zero_advantage_stays_finite():
    logp = t([[0.0, 0.0]])
    loss, _ = rl_loss(logp, t([[-200.0, 0.0]]), t([[0.0, 1.0]]), torch.ones(1, 2), LossConfig(policy_loss="pg"))
    assert loss.item() == pytest.approx(-0.5)


# ---- errors ---------------------------------------------------------------------------------------------
def good_inputs(B=2, T=3):
    return torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B), torch.ones(B, T)


def test_mismatched_shapes_name_both():
    logp, old, adv, mask = good_inputs()
    with pytest.raises(ValueError, match=r"old_logp shape \(2, 4\) does not match logp shape \(2, 3\)"):
        rl_loss(logp, torch.zeros(2, 4), adv, mask, LossConfig())
    with pytest.raises(ValueError, match=r"mask shape \(3, 2\) does not match logp shape \(2, 3\)"):
        rl_loss(logp, old, adv, torch.ones(3, 2), LossConfig())
    with pytest.raises(ValueError, match=r"advantages shape \(3,\) does not match logp shape \(2, 3\)"):
        rl_loss(logp, old, torch.zeros(3), mask, LossConfig())
    with pytest.raises(ValueError, match=r"ref_logp shape \(2, 2\) does not match logp shape \(2, 3\)"):
        rl_loss(logp, old, adv, mask, LossConfig(), ref_logp=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"logp shape \(6,\), expected \[B, T\]"):
        rl_loss(torch.zeros(6), old, adv, mask, LossConfig())


def test_empty_batch_is_rejected():
    with pytest.raises(ValueError, match=r"empty batch: logp shape \(0, 3\)"):
        rl_loss(*good_inputs(B=0), LossConfig())
    logp, old, adv, mask = good_inputs()
    with pytest.raises(ValueError, match="empty batch: mask .* has no valid token"):
        rl_loss(logp, old, adv, torch.zeros_like(mask), LossConfig())


def test_non_finite_inputs_are_counted_at_valid_tokens():
    logp, old, adv, mask = good_inputs()
    mask[1, 2] = 0
    bad = logp.clone()
    bad[0, 0], bad[0, 1], bad[1, 2] = float("nan"), float("-inf"), float("nan")  # last one is masked out
    with pytest.raises(ValueError, match=r"logp has 2 non-finite value\(s\)"):
        rl_loss(bad, old, adv, mask, LossConfig())
    with pytest.raises(ValueError, match=r"advantages has 3 non-finite value\(s\)"):
        rl_loss(logp, old, t([float("inf"), 0.0]), mask, LossConfig())  # one sequence = 3 valid tokens
    with pytest.raises(ValueError, match=r"ref_logp has 2 non-finite"):
        rl_loss(logp, old, adv, mask, LossConfig(), ref_logp=bad)


def test_bad_mask_and_missing_inputs():
    logp, old, adv, mask = good_inputs()
    with pytest.raises(ValueError, match=r"mask has 1 value\(s\) other than 0/1"):
        rl_loss(logp, old, adv, t([[1, 0, 2], [1, 1, 1]]), LossConfig())
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logp"):
        rl_loss(logp, old, adv, mask, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_coef=0.01 needs entropy"):
        rl_loss(logp, old, adv, mask, LossConfig(entropy_coef=0.01))


@pytest.mark.parametrize("field, value, message", [
    ("clip_eps_low", 1.5, r"clip_eps_low=1.5, expected a value in \[0, 1\]"),
    ("clip_eps_high", 0.0, r"clip_eps_high=0.0, expected a finite value > 0"),
    ("dual_clip_c", 1.0, r"dual_clip_c=1.0, expected None or a finite value > 1"),
    ("kl_coef", -0.1, r"kl_coef=-0.1, expected a finite value >= 0"),
    ("entropy_coef", float("nan"), r"entropy_coef=nan"),
    ("tis_cap", 0.5, r"tis_cap=0.5, expected None \(off\) or a finite value >= 1"),
    ("policy_loss", "grpo", r"unknown policy_loss 'grpo', expected one of \[.cispo., .gspo., .pg., .ppo."),
])
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**{field: value})


def test_config_defaults_and_immutability():
    cfg = LossConfig()
    assert (cfg.policy_loss, cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_estimator, cfg.kl_coef,
            cfg.entropy_coef, cfg.aggregation, cfg.tis_cap, cfg.dual_clip_c) == \
        ("ppo", 0.2, 0.2, "k3", 0.0, 0.0, "token-mean", 2.0, None)
    with pytest.raises(AttributeError):
        cfg.kl_coef = 1.0
    with pytest.raises(TypeError):
        LossConfig("ppo")
