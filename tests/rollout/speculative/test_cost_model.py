"""rollout/speculative/cost_model.py: the fitted step cost recovers a known cost law, falls back to its
prior where the steps say nothing, and its verdicts (how many proposals pay, the break-even batch)
follow from the fitted parts as the formula says."""
import random

import pytest

from rollout.speculative.cost_model import VERIFY_FLOOR, VERIFY_ROWS, StepCostModel


def synthetic(model: StepCostModel, fixed: float, decode_row: float, verify_row: float, steps: int,
              verify: bool = True, noise: float = 0.02, seed: int = 0, verify_seq: float = 0.0) -> None:
    rng = random.Random(seed)
    for _ in range(steps):
        n = rng.randint(1, 128)
        s = rng.randint(1, n) if verify and rng.random() < 0.5 else 0
        v = s * rng.randint(1, 4)  # 1-4 proposals per verifying sequence, the step's choice
        seconds = fixed + decode_row * n + verify_row * v + verify_seq * s
        model.observe(n, v, seconds * (1 + noise * rng.uniform(-1, 1)), s)


def test_the_fit_recovers_a_known_cost_law():
    model = StepCostModel(prior_row_cost=0.016)
    synthetic(model, fixed=3e-3, decode_row=50e-6, verify_row=70e-6, steps=500)
    fixed, decode_row, verify_row = model.fit()
    # 2% multiplicative noise on each step: the parts come back within a few percent of their own size
    assert fixed == pytest.approx(3e-3, rel=0.05)
    assert decode_row == pytest.approx(50e-6, rel=0.05) and verify_row == pytest.approx(70e-6, rel=0.05)


def test_without_verification_steps_the_verification_row_stays_at_the_prior():
    model = StepCostModel(prior_row_cost=0.016)
    synthetic(model, fixed=3e-3, decode_row=50e-6, verify_row=0.0, steps=300, verify=False)
    fixed, decode_row, verify_row = model.fit()
    assert fixed == pytest.approx(3e-3, rel=0.05) and decode_row == pytest.approx(50e-6, rel=0.1)
    assert verify_row / fixed == pytest.approx(0.016, rel=0.25)  # the prior's share, not zero or noise


def test_the_fit_recovers_a_verifications_own_cost():
    """Each verifying sequence costs 200 us besides its rows: the fit finds it, and counts it in
    verification rows when it weighs proposals."""
    model = StepCostModel(prior_row_cost=0.016)
    synthetic(model, fixed=3e-3, decode_row=50e-6, verify_row=60e-6, steps=500, verify_seq=200e-6)
    model.fit()
    assert model.verify_seq == pytest.approx(200e-6, rel=0.1) and model.verify_row == pytest.approx(60e-6, rel=0.1)
    assert model.overhead_rows == pytest.approx(200 / 60, rel=0.15)


def test_before_any_step_the_verdicts_are_the_constant_models():
    model = StepCostModel(prior_row_cost=1 / 64)
    assert model.overhead_rows == VERIFY_ROWS
    for n in (1, 16, 64):
        assert model.saved_per_kept(n) == pytest.approx(1 + 64 / n)  # 1 + 1 / (r n)


def test_how_many_proposals_pay_is_the_best_expected_saving():
    model = StepCostModel(prior_row_cost=0.016)
    synthetic(model, fixed=3e-3, decode_row=50e-6, verify_row=50e-6, steps=400)
    model.fit()
    for a in (0.2, 0.5, 0.8, 0.95):
        for n in (1, 8, 64, 512):
            saved = model.saved_per_kept(n)
            gains = [sum(a ** j * saved - 1 for j in range(1, k + 1)) - model.overhead_rows for k in range(1, 9)]
            best = max(range(8), key=lambda i: gains[i])
            assert model.worth(a, n, 8) == (best + 1 if gains[best] > 0 else 0), (a, n)
    # the break-even batch shrinks with the acceptance and is the last size that still pays
    sizes = [model.break_even(a, 8) for a in (0.95, 0.8, 0.5, 0.2)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    n = model.break_even(0.8, 8)
    assert model.worth(0.8, n, 8) > 0 and model.worth(0.8, n + 1, 8) == 0


def test_verification_rows_that_look_free_are_floored_and_the_break_even_stays_finite():
    """Steps whose time does not grow with their verification rows (what a handful of noisy steps can
    say): the fit's verification row is VERIFY_FLOOR of a decode row, not zero, so a large enough batch
    still decodes plainly, for any acceptance below 1."""
    model = StepCostModel(prior_row_cost=0.016)
    synthetic(model, fixed=3e-3, decode_row=50e-6, verify_row=0.0, steps=300)
    _, decode_row, verify_row = model.fit()
    assert verify_row == pytest.approx(VERIFY_FLOOR * decode_row)
    assert 0 < model.break_even(0.95, 4) < 4096
