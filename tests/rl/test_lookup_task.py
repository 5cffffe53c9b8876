import random
import string

import pytest

from rl.envs.tasks import TASKS, make_task


def run_episode(env, seed, policy):
    """Drive one episode like the rollout driver: the conversation grows by answer + observation."""
    conversation = env.reset(seed)
    total = 0.0
    for _ in range(env.max_turns):
        answer = policy(conversation)
        result = env.step(answer)
        total += result.reward
        conversation += answer + result.observation
        if result.done:
            return total, conversation
    raise AssertionError("episode did not end within max_turns")


def oracle(conversation: str) -> str:
    """Copies the queried key into the call, then the returned digit into the answer."""
    if conversation.endswith(";"):
        return conversation[-2] + "<eos>"
    return f"[{conversation[4]}]"


def test_reset_is_deterministic_per_seed_and_draws_a_valid_table():
    env = make_task("key_lookup", brackets=True)
    prompts = set()
    for seed in range(50):
        prompt = env.reset(seed)
        table, query = env.table, env.query
        assert prompt == f"get {query}:"
        assert len(table) == 4 and set(table) <= set(string.ascii_lowercase) and query in table
        assert all(1 <= v <= 9 for v in table.values())
        assert env.reset(seed) == prompt and env.table == table and env.query == query
        prompts.add(prompt)
    assert len(prompts) > 10  # seeds vary the query


def test_oracle_scores_one():
    env = make_task("key_lookup", brackets=True)
    for seed in range(50):
        total, conversation = run_episode(env, seed, oracle)
        assert total == 1.0
        q = env.query
        assert conversation == f"get {q}:[{q}]={env.table[q]};{env.table[q]}<eos>"


def test_wrong_existing_key_then_observed_value_scores_call_reward():
    env = make_task("key_lookup", brackets=True, call_reward=0.3)
    for seed in range(50):
        env.reset(seed)
        other = next(k for k in env.table if k != env.query)
        first = env.step(f"[{other}]")
        assert (first.reward, first.done) == (0.0, False)
        assert first.observation == f"={env.table[other]};"
        last = env.step(first.observation[1])  # copies the value it observed: the wrong key's value
        assert (last.reward, last.done) == (pytest.approx(0.3), True)


def test_right_call_then_wrong_digit_scores_call_reward():
    env = make_task("key_lookup", brackets=True)
    env.reset(3)
    env.step(f"[{env.query}]")
    wrong = next(d for d in "123456789" if int(d) != env.table[env.query])
    assert env.step(wrong).reward == pytest.approx(0.2)


def test_observation_is_the_value_of_the_key_called():
    env = make_task("key_lookup", brackets=True, num_keys=26)
    for key in string.ascii_lowercase:
        env.reset(11)
        assert env.step(f"[{key}]xyz").observation == f"={env.table[key]};"


@pytest.mark.parametrize("answer", ["", "[", "[c", "c]", "(c)", "[C]", "[cc]", " [c]", "[1]"])
def test_malformed_call_ends_the_episode_with_zero(answer):
    env = make_task("key_lookup", brackets=True, num_keys=1)
    seed = next(s for s in range(1000) if env.reset(s) == "get c:")  # the table is {c: value}
    env.reset(seed)
    result = env.step(answer)
    assert (result.observation, result.reward, result.done) == ("", 0.0, True)


def test_call_for_a_key_not_in_the_table_ends_with_zero():
    env = make_task("key_lookup", brackets=True)
    env.reset(7)
    absent = next(k for k in string.ascii_lowercase if k not in env.table)
    result = env.step(f"[{absent}]")
    assert (result.observation, result.reward, result.done) == ("", 0.0, True)


def test_random_bytes_policy_scores_about_zero():
    rng = random.Random(0)
    env = make_task("key_lookup", brackets=True)

    def random_policy(_conversation: str) -> str:
        return bytes(rng.randrange(256) for _ in range(8)).decode("utf-8", errors="replace")

    mean = sum(run_episode(env, seed, random_policy)[0] for seed in range(200)) / 200
    assert mean < 0.02


def test_step_outside_an_episode_raises():
    env = make_task("key_lookup", brackets=True)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("[a]")
    env.reset(0)
    env.step("xx")  # malformed: done
    with pytest.raises(RuntimeError, match="done"):
        env.step("[a]")
    env.reset(0)
    env.step(f"[{env.query}]")
    env.step("1")
    with pytest.raises(RuntimeError, match="done"):
        env.step("1")


def test_registry_and_bad_arguments():
    assert "key_lookup" in TASKS
    for num_keys in (0, 27):
        with pytest.raises(ValueError, match=rf"num_keys={num_keys}, expected in 1\.\.26"):
            make_task("key_lookup", num_keys=num_keys)
    for call_reward in (-0.1, 1.0):
        with pytest.raises(ValueError, match=rf"call_reward={call_reward}, expected in \[0, 1\)"):
            make_task("key_lookup", call_reward=call_reward)


def test_bare_letter_calls_when_brackets_are_off():
    from rl.envs.tasks.lookup import KeyLookup

    env = KeyLookup(brackets=False)
    key = env.reset(3)[4]
    result = env.step(key)
    assert not result.done and result.observation == f"={env.table[key]};"
    assert env.step(str(env.table[key])).reward == 1.0
    env.reset(3)
    assert env.step("[" + key + "]").done  # the bracketed form is not a call in this mode


@pytest.mark.parametrize("brackets", [True, False])
def test_a_demonstration_replayed_into_the_environment_scores_one(brackets):
    env = make_task("key_lookup", brackets=brackets)
    for seed in range(50):
        answers = env.demonstration(seed)
        assert env.query and answers[0] == (f"[{env.query}]" if brackets else env.query)
        env.reset(seed)
        assert [env.step(a).reward for a in answers] == [0.0, 1.0]
        assert answers == env.demonstration(seed)  # deterministic per seed


def test_a_demonstration_without_the_value_calls_right_and_guesses_the_digit():
    env = make_task("key_lookup", brackets=False)
    rewards = []
    for seed in range(900):
        call, digit = env.demonstration(seed, value=False)
        assert call == env.query and digit in "123456789" and len(digit) == 1
        env.reset(seed)
        assert env.step(call).observation == f"={env.table[call]};"
        rewards.append(env.step(digit).reward)
    assert set(rewards) <= {0.2, 1.0}
    # the digit is independent of the value: right ~1/9 of the time, so imitation scores ~0.2 + 0.8/9
    assert abs(sum(rewards) / len(rewards) - (0.2 + 0.8 / 9)) < 0.04


def test_no_constant_answer_beats_the_stated_ceiling():
    env = make_task("key_lookup", brackets=False)
    seeds = range(2000)
    best = 0.0
    for letter in string.ascii_lowercase:
        for digit in "159":  # the digits are exchangeable: three stand for all nine
            total = 0.0
            for seed in seeds:
                env.reset(seed)
                result = env.step(letter)
                total += result.reward if result.done else env.step(digit).reward
            best = max(best, total / len(seeds))
    assert best <= env.constant_answer_ceiling * 1.3
    assert env.constant_answer_ceiling == pytest.approx(4 / 26 * (0.2 + 0.8 / 4 / 9))
