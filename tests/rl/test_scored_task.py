"""Your own data and reward: the `scored` task, tasks by import path, and the rollout driver fed
from a RowSampler on the real engine and tiny model."""
import pytest

from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import ByteTokenizer
from rl.envs.data import RowSampler
from rl.run.ranks import merge_metrics
from rl.episodes.driver import DriverConfig, RolloutDriver
from rl.envs.tasks.base import make_task
from rl.envs.tasks.digits import MajorityDigit
from rollout.engine import Engine, EngineConfig

REWARD = '''
def compute_score(solution_str, ground_truth, extra_info):
    hit = solution_str[:1] == ground_truth
    return {"score": float(hit) + 0.25, "acc": hit, "fmt": 0.25, "tag": extra_info["tag"], "note": "text"}
'''


@pytest.fixture
def reward_path(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    return str(path)


ROWS = [{"prompt": f"q{i}=", "label": str(i), "tag": float(i)} for i in range(5)]


def test_scored_task_returns_the_row_prompt_and_the_functions_dict(reward_path):
    env = make_task("scored", reward_path=reward_path)
    assert env.reset(0, row=ROWS[3]) == "q3="
    hit, miss = env.step("3"), env.step("x")
    assert (hit.reward, hit.done, hit.is_correct, hit.components) == (1.25, True, True, {"acc": 1.0, "fmt": 0.25, "tag": 3.0})
    assert (miss.reward, miss.is_correct) == (0.25, False)
    messages = [{"role": "user", "content": "hi"}]
    assert env.reset(1, row={"prompt": messages, "label": None}) == messages
    with pytest.raises(ValueError, match="data row"):
        env.reset(0)


def test_scored_task_errors_name_the_file_and_function(tmp_path, reward_path):
    with pytest.raises(ValueError, match="nope.py.*no such file"):
        make_task("scored", reward_path=str(tmp_path / "nope.py"))
    with pytest.raises(ValueError, match="defines no 'score_it'"):
        make_task("scored", reward_path=reward_path, reward_name="score_it")
    (tmp_path / "const.py").write_text("compute_score = 3\n")
    with pytest.raises(ValueError, match="'compute_score' is a int, expected a callable"):
        make_task("scored", reward_path=str(tmp_path / "const.py"))
    (tmp_path / "plain.py").write_text("def compute_score(solution_str, **kwargs):\n    return 1.0\n")
    env = make_task("scored", reward_path=str(tmp_path / "plain.py"))
    env.reset(0, row=ROWS[0])
    assert (env.step("a").reward, env.step("a").is_correct, env.step("a").components) == (1.0, True, {})
    (tmp_path / "unnamed.py").write_text("def compute_score(s, g, e):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"unnamed.py:compute_score\(s, g, e\): a signature of no known shape; "
                                         r"expected one of: verl/ours.*TRL.*OpenRLHF.*slime"):
        make_task("scored", reward_path=str(tmp_path / "unnamed.py"))


def test_tasks_by_import_path():
    env = make_task("rl.envs.tasks.digits:MajorityDigit", length=5)
    assert isinstance(env, MajorityDigit) and env.length == 5
    with pytest.raises(ValueError, match="no_such_pkg.env:Env.*cannot import module 'no_such_pkg.env'"):
        make_task("no_such_pkg.env:Env")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        make_task("rl.envs.tasks.digits:Nope")
    with pytest.raises(ValueError, match="'register_task' is a function, expected a class"):
        make_task("rl.envs.tasks.digits:register_task")
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_task("nope")


def engine() -> Engine:
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=0, std=0.1)
    e = Engine(model, EngineConfig.for_pages(model, 64, max_model_len=128, check_every_step=True))
    e.load_weights(e.model.state_dict(), version=1)
    return e


def driver(reward_path, rows, rank=0, world=1, **kw) -> RolloutDriver:
    config = DriverConfig(**{"groups_per_iteration": 3, "max_new_tokens": 4} | kw)
    return RolloutDriver(engine(), ByteTokenizer(), "scored", {"reward_path": reward_path}, config,
                         group_size=2, seed=1, rank=rank, world=world, rows=rows)


def sent_prompt(t) -> list[int]:
    return t.tokens[:t.policy.index(True)]


def test_driver_sends_each_groups_row_and_logs_components(reward_path):
    rows = ROWS[:4] + [{"prompt": [{"role": "user", "content": "chat="}], "label": "c", "tag": 4.0}]
    sampler = RowSampler(rows, seed=7)
    d = driver(reward_path, sampler, groups_per_iteration=5)
    tok = ByteTokenizer()
    metrics = d.run_iteration()
    groups = d.take_finished_groups()
    assert len(groups) == 5 and sampler.position == 5
    for g in groups:
        row = sampler[g[0].group_id]
        messages = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        for t in g:
            assert t.row_index == t.group_id and sent_prompt(t) == tok.render(messages)
            assert t.is_correct == (t.reward == 1.25) and t.components["fmt"] == 0.25
    assert sorted(sent_prompt(g[0]) for g in groups) == sorted(
        tok.render(r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}])
        for r in rows)  # one epoch: every row once
    assert metrics["reward/fmt"] == 0.25 and metrics["reward/tag"] == pytest.approx(2.0)
    assert merge_metrics([metrics, metrics])["reward/fmt"] == 0.25


def test_ranks_agree_on_which_group_gets_which_row(reward_path):
    prompts = {}
    for rank in range(2):
        d = driver(reward_path, RowSampler(ROWS, seed=2), rank=rank, world=2)
        d.run_iteration()
        for g in d.take_finished_groups():
            prompts[g[0].group_id] = bytes(sent_prompt(g[0])[1:]).decode()
    one = RowSampler(ROWS, seed=2)
    assert prompts == {g: one[g]["prompt"] for g in range(3)}


def test_state_round_trip_resumes_the_rows_and_replays_carried_episodes(reward_path):
    d = driver(reward_path, RowSampler(ROWS, seed=5), budget_tokens=3)
    d.run_iteration()
    state = d.state_dict()
    assert state["rows"] == {"epoch": 0, "index": 3} and d.carry
    e = driver(reward_path, RowSampler(ROWS, seed=5), budget_tokens=3, max_groups_in_flight=1)
    e.load_state_dict(state)
    assert e.state_dict() == state
    trained = []
    for _ in range(8):
        e.run_iteration()
        trained += e.take_finished_groups()
    assert not e.errors  # the carried episodes' environments got their rows back (else reset raises)
    assert {0, 1, 2} <= {g[0].group_id for g in trained} and all(t.row_index == t.group_id for g in trained for t in g)
    old = {k: v for k, v in state.items() if k != "rows"}  # a checkpoint from before the data source
    f = driver(reward_path, RowSampler(ROWS, seed=5))
    f.rows.position = 4
    f.load_state_dict(old)
    assert f.rows.position == 0


def test_data_exhausted_stops_new_groups(reward_path):
    d = driver(reward_path, RowSampler(ROWS, seed=0, epochs=1), groups_per_iteration=4)
    d.run_iteration()
    assert not d.data_exhausted and d.next_group == 4
    d.run_iteration()
    assert d.data_exhausted and d.next_group == 5 and d.rows.position == 5
    exact = driver(reward_path, RowSampler(ROWS, seed=0, epochs=1), groups_per_iteration=5)
    exact.run_iteration()  # the last row started: known at once, so the run needs no empty iteration
    assert exact.data_exhausted and exact.next_group == 5
