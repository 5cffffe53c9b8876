"""Token-level estimators and the newer losses against the papers' formulas on small examples:
REINFORCE++ (and its group baseline), GAE, batch whitening, GSPO, CISPO, Dr. GRPO's aggregation,
rollout correction and the critic's clipped value loss.

Expected numbers are written out by hand or computed by plain-Python loops over lists that follow the
paper's formula, never by the code under test.
"""
import math
import threading

import pytest
import torch

from trainer.losses import (LossConfig, Segments, TokenRewards, cispo_loss, gae, gae_advantages, gspo_loss,
                            ppo_clip_loss, reinforce_plus_plus, reinforce_plus_plus_baseline, rl_loss,
                            rollout_weights, seq_mean_token_sum_norm, sequence_returns, token_level_rewards,
                            value_loss, whiten)

FP32 = dict(rtol=1e-5, atol=1e-5)
"""A float32 result of O(1) values against its float64 hand computation: each of the ~100 roundings it
takes (sums, whitening, the returns' recursion) is ~6e-8 of the scale; 1e-5 of the scale holds them on any
host; a wrong formula moves these O(1) values by far more."""

LOG = math.log
T, F = True, False


def t(rows, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def whiten_by_hand(xs):
    """(x - mean) / sqrt(var + 1e-8), var with Bessel's correction (verl's masked_whiten)."""
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def discount_by_hand(rs, gamma):
    """G_t = sum_{k >= t} gamma^(k - t) r_k over one sequence's steps."""
    return [sum(gamma ** (k - i) * rs[k] for k in range(i, len(rs))) for i in range(len(rs))]


def on_rows(step_values, mask):
    """The steps' values placed at the True rows of mask (a list of bools), 0 elsewhere."""
    it = iter(step_values)
    return [next(it) if m else 0.0 for m in mask]


# Multi-turn packed layout: seq 0 = prompt, step, step, tool observation, step; seq 1 = prompt, step,
# step; seq 2 = prompt only (no step: its reward has nowhere to go and it is left out of the statistics).
IDS = [0, 0, 0, 0, 0, 1, 1, 1, 2, 2]
MASK = [F, T, T, F, T, F, T, T, F, F]
KL = [9.0, 0.1, 0.2, 9.0, 0.3, 9.0, 0.1, 0.1, 9.0, 9.0]  # 9 on non-steps: must be ignored


def multi_turn(kl=None, values=None, rewards=(1.0, -0.5, 5.0), ids=IDS, mask=MASK, groups=None):
    num_seqs = max(ids) + 1
    return TokenRewards(rewards=t(list(rewards)), mask=torch.tensor(mask),
                        segments=Segments(torch.tensor(ids), num_seqs),
                        groups=torch.tensor(groups if groups is not None else list(range(num_seqs))),
                        kl_penalty=None if kl is None else t(kl), values=None if values is None else t(values))


# ---- REINFORCE++ ----------------------------------------------------------------------------------------
def test_token_rewards_put_the_outcome_on_the_last_step_and_kl_on_every_step():
    tr = multi_turn(kl=KL)
    # seq 0 steps: -0.1, -0.2, 1 - 0.3; seq 1 steps: -0.1, -0.5 - 0.1; non-steps and seq 2: 0
    expected = [0.0, -0.1, -0.2, 0.0, 0.7, 0.0, -0.1, -0.6, 0.0, 0.0]
    torch.testing.assert_close(token_level_rewards(tr), t(expected))
    torch.testing.assert_close(sequence_returns(tr), t([0.4, -0.7, 0.0]))
    assert torch.equal(token_level_rewards(multi_turn()), t(on_rows([0.0, 0.0, 1.0, 0.0, -0.5], MASK)))


@pytest.mark.parametrize("gamma, step_returns", [
    (1.0, [1.0, 1.0, 1.0, -0.5, -0.5]),
    # the tool row is not a step: seq 0's first step is 0.5^2 * 1, not 0.5^3 * 1
    (0.5, [0.25, 0.5, 1.0, -0.25, -0.5]),
])
def test_reinforce_plus_plus_discounts_over_the_steps_and_whitens(gamma, step_returns):
    advantages, returns = reinforce_plus_plus(multi_turn(), gamma=gamma)
    assert torch.equal(returns, t(on_rows(step_returns, MASK)))  # dyadic values: exact in any order
    torch.testing.assert_close(advantages, t(on_rows(whiten_by_hand(step_returns), MASK)),
                               **FP32)  # float32 whitening of O(1) values


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_reinforce_plus_plus_with_kl_in_the_reward(gamma):
    seq0, seq1 = [-0.1, -0.2, 1.0 - 0.3], [-0.1, -0.5 - 0.1]
    step_returns = discount_by_hand(seq0, gamma) + discount_by_hand(seq1, gamma)
    if gamma == 1.0:
        assert step_returns == pytest.approx([0.4, 0.5, 0.7, -0.7, -0.6])
    advantages, returns = reinforce_plus_plus(multi_turn(kl=KL), gamma=gamma)
    torch.testing.assert_close(returns, t(on_rows(step_returns, MASK)), **FP32)  # float32 rewards
    torch.testing.assert_close(advantages, t(on_rows(whiten_by_hand(step_returns), MASK)),
                               **FP32)  # float32 rewards 1 - 0.3, whitened: O(1e-7) relative


def test_reinforce_plus_plus_baseline_centres_on_the_group_mean():
    # seqs: 0 [T, T], 1 [F, T, T], 2 [T], 3 [T, F], 4 [T], 5 [T, T]; groups 7 = {0, 1, 2}, 3 = {3}, 5 = {4, 5}
    ids = [0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 5]
    mask = [T, T, F, T, T, T, T, F, T, T, T]
    tr = multi_turn(rewards=(1.0, 0.0, 0.5, 4.0, 0.3, 0.3), ids=ids, mask=mask, groups=[7, 7, 7, 3, 5, 5])
    # group 7: mean 0.5 -> 0.5, -0.5, 0; the singleton (4.0) and the constant group (0.3, 0.3): 0
    per_seq = [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    per_row = [per_seq[s] if m else 0.0 for s, m in zip(ids, mask)]
    advantages, centred = reinforce_plus_plus_baseline(tr)
    assert torch.equal(centred, t(per_row))  # dyadic: exact
    steps = [x for x, m in zip(per_row, mask) if m]  # [0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0, 0]
    torch.testing.assert_close(advantages, t(on_rows(whiten_by_hand(steps), mask)),
                               **FP32)  # float32 whitening of O(1) values


def test_reinforce_plus_plus_baseline_of_only_singletons_and_constant_groups_is_zero():
    tr = multi_turn(rewards=(2.0, 2.0, -3.0), groups=[0, 0, 1])  # seq 2 has no step
    advantages, centred = reinforce_plus_plus_baseline(tr)
    assert torch.equal(centred, torch.zeros(10)) and torch.equal(advantages, torch.zeros(10))


# ---- GAE ------------------------------------------------------------------------------------------------
# seq 0: prompt, step, step, tool, step (reward 1); seq 1: step, step (reward -1). V = 9 on non-steps.
GAE_IDS, GAE_MASK = [0, 0, 0, 0, 0, 1, 1], [F, T, T, F, T, T, T]
GAE_VALUES = [9.0, 0.5, 0.25, 9.0, 0.75, 0.5, -0.5]
STEP_R, STEP_V = ([0.0, 0.0, 1.0], [0.0, -1.0]), ([0.5, 0.25, 0.75], [0.5, -0.5])


def gae_inputs():
    return multi_turn(values=GAE_VALUES, rewards=(1.0, -1.0), ids=GAE_IDS, mask=GAE_MASK)


def td_errors(rs, vs, gamma):  # delta_t = r_t + gamma V_{t+1} - V_t, V after the last step = 0
    return [r + gamma * (vs[i + 1] if i + 1 < len(vs) else 0.0) - v for i, (r, v) in enumerate(zip(rs, vs))]


def gae_by_hand(rs, vs, gamma, lam):  # A_t = delta_t + gamma lam A_{t+1}
    out, running = [], 0.0
    for delta in reversed(td_errors(rs, vs, gamma)):
        running = delta + gamma * lam * running
        out.append(running)
    return out[::-1]


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_gae_lambda_zero_is_the_td_error_and_lambda_one_the_monte_carlo_return_minus_v(gamma):
    tr = gae_inputs()
    td = [d for rs, vs in zip(STEP_R, STEP_V) for d in td_errors(rs, vs, gamma)]
    mc = [g - v for rs, vs in zip(STEP_R, STEP_V) for g, v in zip(discount_by_hand(rs, gamma), vs)]
    literal = {1.0: ([-0.25, 0.5, 0.25, -1.0, -0.5], [0.5, 0.75, 0.25, -1.5, -0.5]),
               0.5: ([-0.375, 0.125, 0.25, -0.75, -0.5], [-0.25, 0.25, 0.25, -1.0, -0.5])}[gamma]
    assert (td, mc) == (literal[0], literal[1])  # dyadic: the hand formulas agree with the literals exactly
    rewards = token_level_rewards(tr)
    for lam, expected in ((0.0, td), (1.0, mc)):
        advantages, returns = gae(rewards, tr.values, tr.mask, tr.segments, gamma, lam)
        assert torch.equal(advantages, t(on_rows(expected, GAE_MASK)))  # dyadic: exact
        step_v = STEP_V[0] + STEP_V[1]
        assert torch.equal(returns, t(on_rows([a + v for a, v in zip(expected, step_v)], GAE_MASK)))


def test_gae_intermediate_lambda_follows_the_recursion():
    tr = gae_inputs()
    expected = [a for rs, vs in zip(STEP_R, STEP_V) for a in gae_by_hand(rs, vs, 0.9, 0.95)]
    advantages, _ = gae(token_level_rewards(tr), tr.values, tr.mask, tr.segments, 0.9, 0.95)
    torch.testing.assert_close(advantages, t(on_rows(expected, GAE_MASK)), **FP32)  # float32 out


def test_gae_advantages_whiten_and_keep_unwhitened_returns():
    advantages, returns = gae_advantages(gae_inputs(), gamma=1.0, lam=1.0)
    mc = [0.5, 0.75, 0.25, -1.5, -0.5]
    torch.testing.assert_close(advantages, t(on_rows(whiten_by_hand(mc), GAE_MASK)),
                               **FP32)  # float32 whitening of O(1) values
    assert torch.equal(returns, t(on_rows([1.0, 1.0, 1.0, -1.0, -1.0], GAE_MASK)))  # G_t = A + V, dyadic
    with pytest.raises(ValueError, match="advantage 'gae' needs the critic's values, got None"):
        gae_advantages(multi_turn(), gamma=1.0, lam=1.0)


# ---- whitening across ranks -----------------------------------------------------------------------------
def whiten_on_two_ranks(xs, masks):
    """whiten on each half in its own thread; `moments` sums the two ranks' tensors (an all-reduce)."""
    barrier, slots, out, errors = threading.Barrier(2, timeout=10), [None, None], [None, None], []

    def rank(i):
        def moments(v):
            slots[i] = v.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read before either writes the next call's slot
            return total
        try:
            out[i] = whiten(xs[i], masks[i], moments)
        except Exception as e:  # re-raised in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return torch.cat(out)


@pytest.mark.numerics  # two ranks' sums vs one batch's: two computation orders
def test_whiten_with_moments_over_two_ranks_equals_the_whole_batch():
    values = [3.0, -1.0, 0.5, 9.0, 2.0, 4.0, -2.5, 7.0, 1.0]
    mask = [T, T, T, F, T, T, T, F, T]
    expected = t(on_rows(whiten_by_hand([v for v, m in zip(values, mask) if m]), mask))
    x, m = t(values, torch.float64), torch.tensor(mask)
    whole = whiten(x, m)
    torch.testing.assert_close(whole, expected, **FP32)  # float32 result of O(1) values
    split = whiten_on_two_ranks((x[:4], x[4:]), (m[:4], m[4:]))
    torch.testing.assert_close(split, whole, **FP32)  # float64 sums in another order
    alone = torch.cat([whiten(x[:4], m[:4]), whiten(x[4:], m[4:])])  # each rank on its own statistics
    assert (alone - expected).abs().max() > 0.1


# ---- GSPO -----------------------------------------------------------------------------------------------
# log ratios (old_logp = 0). Row 0: mean 0.00105 / 3 = 3.5e-4 (its tokens' own ratios e^{+-0.5} are far
# outside any clip); row 1: mean -3.5e-4 over its two valid tokens (5.0 is padding); row 2: mean 7e-4.
GSPO_LOGP = [[0.5, -0.5, 0.00105], [-0.0002, -0.0005, 5.0], [0.001, 0.0007, 0.0004]]
GSPO_MASK = [[T, T, T], [T, T, F], [T, T, T]]
GSPO_ADV = [1.0, -2.0, 0.5]
GSPO = LossConfig(policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4)


def test_gspo_clips_the_sequence_ratio_and_its_gradient_is_s_times_minus_a():
    logp = t(GSPO_LOGP, torch.float64).requires_grad_()
    mask = torch.tensor(GSPO_MASK)
    adv = t(GSPO_ADV, torch.float64)[:, None].expand(3, 3)
    out = gspo_loss(logp, torch.zeros(3, 3, dtype=torch.float64), adv, GSPO, mask=mask)
    s = [math.exp(0.00105 / 3), math.exp(-0.0007 / 2), math.exp(0.0021 / 3)]  # geometric means of the ratios
    # row 0: s0 = 1.00035 < 1 + 4e-4 -> -A s0; row 1: A < 0, s1 = 0.99965 < 1 - 3e-4 -> pessimistic side
    # -A (1 - 3e-4) = 1.9994, clipped; row 2: A > 0, s2 = 1.0007 > 1 + 4e-4 -> -0.5 * 1.0004, clipped
    per_row = [-1.0 * s[0], 2.0 * (1 - 3e-4), -0.5 * (1 + 4e-4)]
    expected_loss = t([[per_row[b]] * 3 for b in range(3)], torch.float64)
    torch.testing.assert_close(torch.where(mask, out.loss, 0.0), torch.where(mask, expected_loss, 0.0),
                               rtol=1e-12, atol=0)  # float64, a handful of ops
    torch.testing.assert_close(torch.where(mask, out.ratio, 0.0), torch.where(mask, t(s, torch.float64)[:, None]
                               .expand(3, 3), 0.0), rtol=1e-12, atol=0)  # float64
    assert out.clipped[mask].tolist() == [F, F, F, T, T, T, T, T]
    torch.where(mask, out.loss, 0.0).sum().backward()
    expected_grad = [[-GSPO_ADV[0] * s[0]] * 3, [0.0] * 3, [0.0] * 3]  # unclipped: s_i * A_i * -1 per token
    torch.testing.assert_close(logp.grad, t(expected_grad, torch.float64), rtol=1e-12, atol=0)  # float64
    # a symmetric 3e-4 clip binds on row 0 too: the upper bound is clip_eps_high's
    symmetric = LossConfig(policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=3e-4)
    out = gspo_loss(logp.detach(), torch.zeros(3, 3, dtype=torch.float64), adv, symmetric, mask=mask)
    assert out.clipped[0].tolist() == [T, T, T]


@pytest.mark.numerics  # padded vs packed layout: two computation orders
def test_gspo_padded_and_packed_layouts_agree():
    padded = t(GSPO_LOGP, torch.float64).requires_grad_()
    mask = torch.tensor(GSPO_MASK)
    packed = t([x for row, ms in zip(GSPO_LOGP, GSPO_MASK) for x, m in zip(row, ms) if m],
               torch.float64).requires_grad_()
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    adv = t(GSPO_ADV, torch.float64)
    a = gspo_loss(padded, torch.zeros(3, 3, dtype=torch.float64), adv[:, None].expand(3, 3), GSPO, mask=mask)
    b = gspo_loss(packed, torch.zeros(8, dtype=torch.float64), adv[ids], GSPO, segments=Segments(ids, 3))
    torch.testing.assert_close(a.loss[mask], b.loss, rtol=1e-12, atol=0)  # float64, same sums up to zero terms
    torch.testing.assert_close(a.ratio[mask], b.ratio, rtol=1e-12, atol=0)
    assert torch.equal(a.clipped[mask], b.clipped)
    cfg = LossConfig(policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq-mean-token-mean")
    loss_a, _ = rl_loss(padded, torch.zeros(3, 3, dtype=torch.float64), adv, mask, cfg, behaviour_logp=None)
    loss_b, _ = rl_loss(packed, torch.zeros(8, dtype=torch.float64), adv[ids], torch.ones(8, dtype=torch.bool),
                        cfg, segments=Segments(ids, 3))
    s0 = math.exp(0.00105 / 3)
    expected = (-s0 + 2.0 * (1 - 3e-4) - 0.5 * (1 + 4e-4)) / 3  # each sequence's token mean, then the mean
    assert loss_a.item() == pytest.approx(expected, rel=1e-12) and loss_b.item() == pytest.approx(expected, rel=1e-12)
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(padded.grad[mask], packed.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(packed.grad[:3], t([-s0 / 9] * 3, torch.float64), rtol=1e-12, atol=0)  # 3 tokens, 3 seqs


def test_gspo_refuses_a_token_level_clip_range():
    with pytest.raises(ValueError, match=r"policy_loss='gspo' with clip_eps_low=0.2, clip_eps_high=0.2.*<= 0.01"):
        LossConfig(policy_loss="gspo")
    with pytest.raises(ValueError, match=r"policy_loss='gspo'.*clip_eps_high=0.2.*<= 0.01"):
        LossConfig(policy_loss="gspo", clip_eps_low=3e-4)
    assert GSPO.clip_eps_high == 4e-4


# ---- CISPO ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("clip_eps_low, weights", [
    (0.2, [1.28, 0.8, 1.28, 0.8, 1.1]),   # range [0.8, 1.28]
    (1.0, [1.28, 0.5, 1.28, 0.5, 1.1]),   # MiniMax-M1: no lower bound
])
def test_cispo_keeps_the_gradient_of_every_token(clip_eps_low, weights):
    ratios, adv = [1.5, 0.5, 1.5, 0.5, 1.1], [1.0, 1.0, -1.0, -1.0, 2.0]
    cfg = LossConfig(policy_loss="cispo", clip_eps_low=clip_eps_low, clip_eps_high=0.28)
    logp = t([LOG(r) for r in ratios], torch.float64).requires_grad_()
    old, a = torch.zeros(5, dtype=torch.float64), t(adv, torch.float64)
    out = cispo_loss(logp, old, a, cfg)
    expected_loss = [-w * x * LOG(r) for w, x, r in zip(weights, adv, ratios)]  # -sg(clip(r)) A logp
    torch.testing.assert_close(out.loss, t(expected_loss, torch.float64), rtol=1e-12, atol=1e-15)  # float64
    assert out.clipped.tolist() == [w != r for w, r in zip(weights, ratios)]
    out.loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([-w * x for w, x in zip(weights, adv)], torch.float64),
                               rtol=1e-12, atol=0)  # float64
    # PPO's clip zeroes tokens 0 (A > 0, r > 1.28) and 3 (A < 0, r < 0.8); elsewhere -r A
    ppo_logp = logp.detach().clone().requires_grad_()
    ppo_clip_loss(ppo_logp, old, a, cfg).loss.sum().backward()
    ppo_grad = [0.0, -0.5, 1.5, 0.0, -2.2] if clip_eps_low == 0.2 else [0.0, -0.5, 1.5, 0.5, -2.2]
    torch.testing.assert_close(ppo_logp.grad, t(ppo_grad, torch.float64), rtol=1e-12, atol=0)
    assert logp.grad[0] == pytest.approx(-1.28) and ppo_logp.grad[0] == 0.0


# ---- Dr. GRPO aggregation -------------------------------------------------------------------------------
def test_seq_mean_token_sum_norm_divides_by_sequences_times_the_budget():
    values = t([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[T, T, T, F], [T, T, F, F], [F, F, F, F]])  # seq 2: no valid token, not counted
    # valid sum 36 over 2 sequences: norm_tokens None = T = 4 -> 36 / 8; norm_tokens 10 -> 36 / 20
    assert seq_mean_token_sum_norm(values, mask).item() == pytest.approx(4.5)
    assert seq_mean_token_sum_norm(values, mask, norm_tokens=10).item() == pytest.approx(1.8)
    packed = t([1.0, 2.0, 3.0, 10.0, 20.0, 7.0])
    segments = Segments(torch.tensor([0, 0, 0, 1, 1, 2]), 3)
    pmask = torch.tensor([T, T, T, T, T, F])
    assert seq_mean_token_sum_norm(packed, pmask, segments).item() == pytest.approx(36 / (2 * 3))  # longest: 3 rows
    assert seq_mean_token_sum_norm(packed, pmask, segments, norm_tokens=10).item() == pytest.approx(1.8)


def test_seq_mean_token_sum_norm_through_rl_loss():
    logp = t([[-1.0, -2.0, -0.5, -3.0], [-0.1, -0.2, -0.3, -0.4], [-1.0, -1.0, -1.0, -1.0]]).requires_grad_()
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    cfg = LossConfig(aggregation="seq-mean-token-sum-norm", agg_norm_tokens=10)
    loss, _ = rl_loss(logp, logp.detach(), t([1.0, -2.0, 3.0]), mask, cfg)
    assert loss.item() == pytest.approx(-(3 * 1.0 + 2 * -2.0) / (2 * 10))  # on-policy: token loss -A
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-0.05, -0.05, -0.05, 0.0], [0.1, 0.1, 0.0, 0.0], [0.0] * 4]))
    with pytest.raises(ValueError, match=r"agg_norm_tokens=0, expected an integer >= 1"):
        LossConfig(aggregation="seq-mean-token-sum-norm", agg_norm_tokens=0)


# ---- rollout correction ---------------------------------------------------------------------------------
# old / behaviour ratios: seq 0 = 1.5, 3, (padding); seq 1 = 0.4, 1.5. Sequence ratios: 4.5 and 0.6.
RC_RATIOS = [1.5, 3.0, 50.0, 0.4, 1.5]
RC_MASK = [T, T, F, T, T]
RC_IDS = [0, 0, 0, 1, 1]


@pytest.mark.parametrize("mode, level, lower, cap, weights, outside", [
    ("truncate", "token", None, 2.0, [1.5, 2.0, 0.4, 1.5], 1),       # min(ratio, cap)
    ("mask", "token", None, 2.0, [1.5, 0.0, 0.0, 1.5], 2),           # kept in [1/2, 2]: 0.4 is below
    ("mask", "token", 0.3, 2.0, [1.5, 0.0, 0.4, 1.5], 1),            # kept in [0.3, 2]
    ("truncate", "sequence", None, 2.0, [2.0, 2.0, 0.6, 0.6], 2),    # 1.5 * 3 = 4.5 -> 2
    ("truncate", "sequence", None, 5.0, [4.5, 4.5, 0.6, 0.6], 0),
    ("mask", "sequence", None, 2.0, [0.0, 0.0, 0.6, 0.6], 2),        # the whole of seq 0 is masked
    ("mask", "sequence", None, 1.5, [0.0, 0.0, 0.0, 0.0], 4),        # 0.6 < 1 / 1.5
])
def test_rollout_weights_by_hand(mode, level, lower, cap, weights, outside):
    cfg = LossConfig(tis_cap=cap, rollout_is_mode=mode, rollout_is_level=level, rollout_is_threshold_lower=lower)
    old = t([-1.0, -2.0, -0.5, -0.7, -0.3], torch.float64)
    behaviour = old - t([LOG(r) for r in RC_RATIOS], torch.float64)
    mask = torch.tensor(RC_MASK)
    weight, metrics = rollout_weights(old, behaviour, mask, Segments(torch.tensor(RC_IDS), 2), cfg)
    torch.testing.assert_close(weight[mask], t(weights, torch.float64), rtol=1e-12, atol=0)  # float64 exp(log)
    assert metrics["tis_weight_mean"].item() == pytest.approx(sum(weights) / 4, rel=1e-6)  # float32 metric
    assert metrics["tis_capped_frac"].item() == outside / 4
    raw_max = 4.5 if level == "sequence" else 3.0  # the padding's 50 is not a valid token
    assert metrics["tis_raw_ratio_max"].item() == pytest.approx(raw_max, rel=1e-6)
    assert ("rollout_is_masked_frac" in metrics) == (mode == "mask")
    if mode == "mask":
        assert metrics["rollout_is_masked_frac"].item() == outside / 4


def test_rollout_correction_through_rl_loss_weights_the_policy_term():
    old = t([[-1.0, -2.0, -0.5], [-0.7, -0.3, 0.0]], torch.float64)
    ratios = t([[1.5, 3.0, 1.0], [0.4, 1.5, 1.0]], torch.float64)
    behaviour = old - ratios.log()
    mask = torch.tensor([[T, T, F], [T, T, F]])
    logp = old.clone().requires_grad_()
    cfg = LossConfig(tis_cap=2.0, rollout_is_mode="mask", rollout_is_level="sequence")
    loss, metrics = rl_loss(logp, old, t([1.0, 1.0], torch.float64), mask, cfg, behaviour_logp=behaviour)
    # on-policy, A = 1: token loss -w; seq 0 (ratio 4.5) masked, seq 1 (0.6) kept; token-mean over 4
    assert loss.item() == pytest.approx(-(0.6 + 0.6) / 4, rel=1e-12)
    assert metrics["rollout_is_masked_frac"] == 0.5 and metrics["tis_raw_ratio_max"] == pytest.approx(4.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[0.0, 0.0, 0.0], [-0.15, -0.15, 0.0]], torch.float64),
                               rtol=1e-12, atol=0)  # float64


def test_rollout_correction_config_bounds():
    assert LossConfig(tis_cap=4.0, rollout_is_mode="mask").rollout_is_bounds == (0.25, 4.0)
    assert LossConfig(tis_cap=4.0, rollout_is_mode="mask", rollout_is_threshold_lower=0.1).rollout_is_bounds == \
        (0.1, 4.0)
    with pytest.raises(ValueError, match=r"rollout_is_threshold_lower=0.5 with rollout_is_mode='truncate'.*"
                                         r"only the masked mode has a lower bound"):
        LossConfig(rollout_is_threshold_lower=0.5)
    with pytest.raises(ValueError, match=r"rollout_is_threshold_lower=1.5, expected None \(1 / tis_cap\)"):
        LossConfig(rollout_is_mode="mask", rollout_is_threshold_lower=1.5)
    with pytest.raises(ValueError, match=r"rollout_is_level='batch', expected 'token' or 'sequence'"):
        LossConfig(rollout_is_level="batch")


# ---- value loss -----------------------------------------------------------------------------------------
def test_value_loss_clipped_and_unclipped_by_hand():
    # t0: V 1, old 0.5 -> clipped V 0.7; R 2: (1 - 2)^2 = 1 < (0.7 - 2)^2 = 1.69 -> the clip binds
    # t1: V 1, old 0.5 -> 0.7; R 0: 1 > 0.49 -> plain error; t2: V - old = 0.125 inside the clip: 0.375^2
    # t3: masked (V 9, R -9)
    values = t([1.0, 1.0, 0.625, 9.0]).requires_grad_()
    old, returns, mask = t([0.5, 0.5, 0.5, 0.0]), t([2.0, 0.0, 1.0, -9.0]), torch.tensor([T, T, T, F])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0 + 0.140625) / 3, rel=1e-6)  # float32 (0.7 inexact)
    assert metrics["vf_clip_frac"].item() == pytest.approx(1 / 3)
    assert metrics["vpred_mean"].item() == pytest.approx((1.0 + 1.0 + 0.625) / 3)
    assert metrics["vf_loss"].item() == loss.item()
    loss.backward()
    # d/dV of 0.5 (V - R)^2 / 3 is (V - R) / 3; the clipped branch at t0 is constant in V
    torch.testing.assert_close(values.grad, t([0.0, 1 / 3, -0.125, 0.0]))
    values.grad = None
    loss, metrics = value_loss(values, old, returns, mask, clip=None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.140625) / 3, rel=1e-6)
    assert metrics["vf_clip_frac"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(values.grad, t([-1 / 3, 1 / 3, -0.125, 0.0]))
