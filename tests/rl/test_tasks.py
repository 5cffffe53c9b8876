import pytest

from rl.envs.tasks import TASKS, make_task


def test_majority_digit_prompts_have_a_unique_answer_and_rewards_are_honest():
    env = make_task("majority_digit", length=7)
    for seed in range(200):
        prompt = env.reset(seed)
        digits = prompt[:-1]
        assert prompt.endswith("=") and len(digits) == 7 and digits.isdigit() and "0" not in digits
        counts = sorted((digits.count(d) for d in set(digits)), reverse=True)
        assert len(counts) == 1 or counts[0] > counts[1]
        best = max(set(digits), key=digits.count)
        assert env.step(best + "xyz").reward == 1.0
        wrong = next(d for d in "123456789" if d != best)
        assert env.step(wrong).reward == pytest.approx(0.1)
        assert env.step("a" + best).reward == 0.0 and env.step("").reward == 0.0
    assert env.reset(5) == env.reset(5)  # deterministic per seed


def test_registry_and_bad_values():
    assert "majority_digit" in TASKS
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_task("nope")
    with pytest.raises(ValueError, match="length=2"):
        make_task("majority_digit", length=2)


def test_majority_digit_demonstration_is_the_answer():
    env = make_task("majority_digit", length=5)
    for seed in range(30):
        (answer,) = env.demonstration(seed)
        env.reset(seed)
        assert env.step(answer).reward == 1.0
