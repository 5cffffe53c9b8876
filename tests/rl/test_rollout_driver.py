"""The rollout driver on the real engine and tiny model: groups, multi-turn, partial rollouts,
failing environments."""
from dataclasses import dataclass

import pytest

from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import ByteTokenizer
from rl.episodes.driver import DriverConfig, RolloutDriver, mix_seed
from rl.envs.tasks.base import TASKS, StepResult, register_task
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig


@dataclass
class Flaky:
    """Single-turn task whose step raises for odd episode seeds."""
    max_turns: int = 1
    seed: int = 0

    def reset(self, seed: int) -> str:
        self.seed = seed
        return "q="

    def step(self, answer: str) -> StepResult:
        if self.seed % 2:
            raise RuntimeError("tool server exploded")
        return StepResult("", 1.0, True)


if "test_flaky" not in TASKS:
    register_task("test_flaky")(Flaky)


@dataclass
class TwoTurns:
    """Always two turns: whatever the first answer, the tool replies with a fixed observation."""
    max_turns: int = 2
    turn: int = 0

    def reset(self, seed: int) -> str:
        self.turn = 0
        return "system: you are a tool user. question " + str(seed % 97) + "?"

    def step(self, answer: str) -> StepResult:
        self.turn += 1
        return StepResult(" tool says: fine; now answer:", 0.0, self.turn >= 2)


if "test_two_turns" not in TASKS:
    register_task("test_two_turns")(TwoTurns)


def engine(**config) -> Engine:
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=0, std=0.1)
    return Engine(model, EngineConfig.for_pages(model, 64, max_model_len=128, check_every_step=True,
                                                **config))


def driver(task="majority_digit", params=None, **kw) -> RolloutDriver:
    """A driver of 3 groups of 4, 4 new tokens per turn; `kw`: DriverConfig fields, or `engine`."""
    e = kw.pop("engine", None) or engine()
    config = DriverConfig(**{"groups_per_iteration": 3, "max_new_tokens": 4} | kw)
    return RolloutDriver(e, ByteTokenizer(), task,
                         {"length": 3} if params is None and task == "majority_digit" else (params or {}), config,
                         group_size=4, seed=1)


def check_trajectory(t, max_new_tokens):
    n = len(t.tokens)
    assert len(t.policy) == len(t.logprobs) == len(t.versions) == n
    assert all(v >= 1 for v, p in zip(t.versions, t.policy) if p) and all(v == -1 for v, p in zip(t.versions, t.policy) if not p)
    assert all(lp <= 0 for lp, p in zip(t.logprobs, t.policy) if p)
    assert 1 <= sum(t.policy) <= max_new_tokens * len(t.answers)


def test_one_iteration_finishes_every_group():
    d = driver()
    d.engine.load_weights(d.engine.model.state_dict(), version=1)
    metrics = d.run_iteration()
    groups = d.take_finished_groups()
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    assert metrics["trajectories_finished"] == 12 and metrics["trajectories_carried"] == 0
    for g in groups:
        assert len({tuple(t.tokens[:t.policy.index(True)]) for t in g}) == 1  # one prompt per group
        for t in g:
            check_trajectory(t, 4)
    assert d.engine.pool.num_used == 0


def test_multi_turn_conversation_has_observations_and_boundaries():
    d = driver("key_lookup", {"num_keys": 3}, max_new_tokens=3)
    d.engine.load_weights(d.engine.model.state_dict(), version=1)
    d.run_iteration()
    trajs = [t for g in d.take_finished_groups() for t in g]
    assert len(trajs) == 12
    two_turn = [t for t in trajs if len(t.answers) == 2]
    for t in two_turn:  # the tool's answer sits between the turns, given, not sampled
        b = t.turn_boundaries[0]
        assert not t.policy[b - 1] and t.policy[b]
    for t in trajs:
        check_trajectory(t, 3)


def test_later_turns_carry_turn_boundaries_into_the_engine_and_hit_the_prefix_cache():
    e = engine(prefix_cache=PrefixCacheConfig(hash_block=4, model_id="tiny"))
    seen = []  # (prompt length, turn boundaries) of every request the engine received
    add = e.add_request

    def recording_add(prompt, params=None, request_id=None, turn_boundaries=()):
        seen.append((len(prompt), tuple(turn_boundaries)))
        return add(prompt, params, request_id, turn_boundaries)

    e.add_request = recording_add
    d = driver("test_two_turns", {}, engine=e, max_new_tokens=3)
    e.load_weights(e.model.state_dict(), version=1)
    d.run_iteration()
    trajs = [t for g in d.take_finished_groups() for t in g]
    assert len(trajs) == 12 and all(len(t.answers) == 2 for t in trajs)
    firsts = [s for s in seen if not s[1]]
    seconds = [s for s in seen if s[1]]
    assert len(firsts) == 3 and len(seconds) == 12  # one forked request per group, then one per trajectory
    for t in trajs:  # the boundary the engine got is the trajectory's: the end of the observation
        assert (t.turn_boundaries[0], (t.turn_boundaries[0],)) in seconds
    prefix = e.cache.prefix
    assert prefix.hit_tokens > 0, "second turns should reuse their first turn's cache"
    assert prefix._turns, "checkpoints at the turn boundaries should be kept"


@pytest.mark.parametrize("mode", ["recompute", "kv"])
def test_partial_rollouts_carry_over_and_keep_versions(mode):
    d = driver(budget_tokens=10, partial_resume=mode, max_new_tokens=6, temperature=1.0, top_k=0)
    versions_seen = set()
    finished = []
    for it in range(12):
        d.engine.load_weights(d.engine.model.state_dict(), version=it + 1)
        d.run_iteration()
        for g in d.take_finished_groups():
            finished += g
        if len(finished) >= 8:
            break
        d.groups_per_iteration = 0  # only continue what was started
    assert finished, "no group finished"
    for t in finished:
        check_trajectory(t, 6)
        versions_seen |= {v for v, p in zip(t.versions, t.policy) if p}
    if mode == "recompute":
        assert len(versions_seen) > 1, "partial rollouts should mix policy versions"
    else:  # kept KV: what later versions sample reads the version-1 KV, and is tagged with it (stale)
        assert versions_seen == {1}
    if mode == "recompute":
        assert d.engine.pool.num_used == 0 or d.carry


def test_failing_environment_drops_only_its_trajectories():
    d = driver("test_flaky", {}, groups_per_iteration=4)
    d.engine.load_weights(d.engine.model.state_dict(), version=1)
    metrics = d.run_iteration()
    groups = d.take_finished_groups()
    odd = [g for g in range(4) if mix_seed(1, g) % 2]
    assert metrics["env_errors"] == 4 * len(odd)
    assert len(groups) == 4 - len(odd) and all(t.reward == 1.0 for g in groups for t in g)
    assert all("tool server exploded" in e and "/" in e.split(":")[0] for e in d.errors)


def test_state_round_trips_through_a_checkpoint():
    d = driver(budget_tokens=8)
    d.engine.load_weights(d.engine.model.state_dict(), version=1)
    d.run_iteration()
    state = d.state_dict()
    e = driver()
    e.load_state_dict(state)
    assert e.state_dict() == state and len(e.carry) == len(d.carry)


def test_max_groups_in_flight_bounds_the_carry_over():
    """A budget far below what an iteration samples: without the cap the unfinished groups pile up
    iteration after iteration; with it, new groups start only as old ones finish."""
    def unfinished_after(cap, iterations=6):
        d = driver(budget_tokens=6, partial_resume="recompute", max_new_tokens=6, temperature=1.0, top_k=0,
                   max_groups_in_flight=cap)
        counts = []
        for it in range(iterations):
            d.engine.load_weights(d.engine.model.state_dict(), version=it + 1)
            d.run_iteration()
            d.take_finished_groups()
            counts.append(len(d.group_sizes))
        return counts

    uncapped, capped = unfinished_after(None), unfinished_after(2)
    assert uncapped[-1] > uncapped[0] and uncapped[-1] > 2, uncapped
    assert max(capped) <= 2, capped
    with pytest.raises(ValueError, match="max_groups_in_flight=0"):
        DriverConfig(max_groups_in_flight=0)


def test_stop_strings_cut_answers_at_the_token_that_completes_them():
    free = driver(max_new_tokens=12)
    free.engine.load_weights(free.engine.model.state_dict(), version=1)
    free.run_iteration()
    generated = [[tok for tok, p in zip(t.tokens, t.policy) if p] for g in free.take_finished_groups() for t in g]
    printable = [c for c in range(33, 127) if any(c in g[:-1] for g in generated)]
    stop = chr(max(printable, key=lambda c: sum(c in g for g in generated)))  # the most common printable byte

    e = engine()
    tok = ByteTokenizer(stop_strings=(stop,))
    e.detokenize = tok.decode
    d = RolloutDriver(e, tok, "majority_digit", {"length": 3}, DriverConfig(groups_per_iteration=3, max_new_tokens=12),
                      group_size=4, seed=1)
    e.load_weights(e.model.state_dict(), version=1)
    d.run_iteration()
    trajs = [t for g in d.take_finished_groups() for t in g]
    cut = 0
    for t in trajs:
        check_trajectory(t, 12)
        answer_tokens = [tok_ for tok_, p in zip(t.tokens, t.policy) if p]
        if ord(stop) in answer_tokens:  # it ended at the stop string's first completion; the text stops before it
            assert answer_tokens.index(ord(stop)) == len(answer_tokens) - 1
            cut += 1
        assert t.answers[0] == tok.decode(answer_tokens).split(stop)[0]
    assert cut >= 1


def test_rollout_returns_the_finished_groups_the_metrics_and_the_errors_once():
    """`rollout()` is run_iteration + take_finished_groups, and hands over the error lines (the
    driver's list is emptied): the same groups and figures as the two calls."""
    plain, d = driver("test_flaky", {}, groups_per_iteration=4), driver("test_flaky", {}, groups_per_iteration=4)
    for x in (plain, d):
        x.engine.load_weights(x.engine.model.state_dict(), version=1)
    metrics, groups = plain.run_iteration(), plain.take_finished_groups()
    result = d.rollout()
    assert [[t.tokens for t in g] for g in result.groups] == [[t.tokens for t in g] for g in groups]
    assert result.metrics["env_errors"] == metrics["env_errors"] > 0
    assert result.errors == plain.errors and len(result.errors) == metrics["env_errors"] and d.errors == []
    second = d.rollout()  # reports only its own lines
    assert d.errors == [] and not set(second.errors) & set(result.errors)


def test_groups_in_flight_is_the_callers_count_over_the_ranks():
    """max_groups_in_flight caps the unfinished groups over all ranks; the driver makes no collective
    call for that count: on several ranks the caller passes it (summed at the phase boundary), on one
    rank the driver counts its own `unfinished_groups`."""
    def ranked(world, **kw):
        config = DriverConfig(groups_per_iteration=3, max_new_tokens=4, max_groups_in_flight=2, **kw)
        d = RolloutDriver(engine(), ByteTokenizer(), "majority_digit", {"length": 3}, config, group_size=4, seed=1,
                          rank=0, world=world)
        d.engine.load_weights(d.engine.model.state_dict(), version=1)
        return d

    d = ranked(2)
    with pytest.raises(ValueError, match=r"max_groups_in_flight=2 on 2 ranks.*groups_in_flight"):
        d.run_iteration()
    assert d.next_group == 0 and d.unfinished_groups == 0, "refused before anything started"
    d.run_iteration(groups_in_flight=1)  # one group unfinished somewhere: one new global group (group 0, ours)
    assert d.next_group == 1
    d.take_finished_groups()
    d.run_iteration(groups_in_flight=2)  # the cap reached over the ranks: nothing new here either
    assert d.next_group == 1
    one = ranked(1, budget_tokens=6)
    one.run_iteration()
    assert one.next_group == 2 and one.unfinished_groups == len(one.group_sizes) > 0
    unfinished = one.unfinished_groups
    one.run_iteration()  # by default its own count: 2 - unfinished new groups
    assert one.next_group == 2 + max(0, 2 - unfinished)


def test_the_progress_bar_follows_every_step_and_ends_at_the_iterations_figures():
    class Bar:
        def __init__(self):
            self.updates = []

        def update(self, done, tokens, kv_utilization, concurrency):
            self.updates.append((done, tokens, kv_utilization, concurrency))

    d, bar = driver(), Bar()
    d.engine.load_weights(d.engine.model.state_dict(), version=1)
    steps_before = d.engine.num_steps
    metrics = d.run_iteration(progress=bar)
    assert len(bar.updates) == d.engine.num_steps - steps_before + 1  # after each engine step, and at the end
    assert bar.updates[-1][:2] == (metrics["trajectories_finished"], metrics["rollout_tokens"])
    assert [u[0] for u in bar.updates] == sorted(u[0] for u in bar.updates)


def test_a_divided_rollout_starts_the_leaders_first_and_the_others_when_their_first_turn_ends():
    """stagger_lead=1: each group's first request holds one member; the other three's request is sent
    when it ends, before any of the leaders' later turns. Every trajectory still finishes, with the
    group's prompt."""
    e = engine()
    seen = []  # (n, prompt length, turn boundaries) of every request, in order
    add = e.add_request

    def recording_add(prompt, params=None, request_id=None, turn_boundaries=()):
        seen.append((params.n, len(prompt), tuple(turn_boundaries)))
        return add(prompt, params, request_id, turn_boundaries)

    e.add_request = recording_add
    d = driver("test_two_turns", {}, engine=e, max_new_tokens=3, stagger_lead=1)
    e.load_weights(e.model.state_dict(), version=1)
    metrics = d.run_iteration()
    groups = d.take_finished_groups()
    assert metrics["trajectories_finished"] == 12 and len(groups) == 3 and all(len(g) == 4 for g in groups)
    firsts = [n for n, _, turns in seen if not turns]
    assert firsts.count(1) == 3 and firsts.count(3) == 3  # the leader, then the three others, per group
    leaders_first = [i for i, (n, _, turns) in enumerate(seen) if not turns and n == 1]
    followers = [i for i, (n, _, turns) in enumerate(seen) if not turns and n == 3]
    assert all(f > lead for lead, f in zip(leaders_first, followers))
    for g in groups:
        assert len({tuple(t.tokens[:t.policy.index(True)]) for t in g}) == 1
    assert not d.held and e.pool.num_used == 0


def test_held_members_carry_over_when_the_budget_stops_the_iteration():
    """A budget that ends the iteration before the leaders' first turn: the held members are carried
    (none lost), and the next iteration finishes every group."""
    d = driver("test_two_turns", {}, max_new_tokens=3, stagger_lead=2, budget_tokens=1, max_concurrency=1)
    d.engine.load_weights(d.engine.model.state_dict(), version=1)
    d.run_iteration()
    assert not d.held and len(d.carry) + sum(len(w) for w in d.waiting.values()) == 12
    d.groups_per_iteration = 0
    d.config = DriverConfig(**{**d.config.__dict__, "budget_tokens": None})
    d.budget_tokens = None
    for version in range(2, 12):
        d.engine.load_weights(d.engine.model.state_dict(), version=version)
        d.run_iteration()
        if not d.carry:
            break
    groups = d.take_finished_groups()
    assert sum(len(g) for g in groups) == 12


def test_stagger_lead_is_checked():
    with pytest.raises(ValueError, match="stagger_lead=-1"):
        DriverConfig(stagger_lead=-1)
