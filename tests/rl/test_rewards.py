"""Reward functions of the anchors' shapes called by keyword (rl/envs/rewards.py), and verl's files as they
are: a parquet with chat-message prompts, `reward_model.ground_truth`, `data_source` and `extra_info`
trains with task=scored, the data files and the reward path only."""
import asyncio

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rl.data import preview
from rl.envs.data import DataConfig, load_rows
from rl.envs.rewards import RewardFunction
from rl.envs.tasks import make_task
from rl.train import run
from tests.rl.test_config import composed

ROW = {"prompt": [{"role": "user", "content": "2+2?"}], "label": "4", "data_source": "toy",
       "extra_info": {"index": 3}}


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "toy" and isinstance(extra_info, dict) and extra_info["index"] == 3
    return {"score": float(solution_str.strip() == ground_truth), "acc": solution_str.strip() == ground_truth}


def trl_reward(completions, ground_truth, **kwargs):
    assert isinstance(completions[0], list) and completions[0][0]["role"] == "assistant"  # chat prompts
    assert kwargs["prompts"][0] == ROW["prompt"] and set(kwargs["data_source"]) == {"toy"}
    return [float(c[0]["content"] == g) for c, g in zip(completions, ground_truth)]


def openrlhf_reward(queries, prompts, labels):
    assert queries[0].startswith("2+2?")
    return torch.tensor([float(q.endswith(label)) for q, label in zip(queries, labels)])


async def slime_rm(args, sample):
    await asyncio.sleep(0)
    return float(sample.response == sample.label)


async def verl_async(solution_str, ground_truth):
    return float(solution_str == ground_truth)


@pytest.mark.parametrize("fn,shape", [(verl_score, "verl"), (trl_reward, "trl"), (openrlhf_reward, "openrlhf"),
                                      (slime_rm, "slime"), (verl_async, "verl")])
def test_each_shape_is_called_by_keyword_with_the_rows_fields(fn, shape):
    reward = RewardFunction(fn, fn.__name__)
    assert reward.shape == shape
    right, wrong = reward.score("4", ROW), reward.score("5", ROW)
    value = lambda out: out["score"] if isinstance(out, dict) else out  # noqa: E731
    assert (value(right), value(wrong)) == (1.0, 0.0)
    assert [value(v) for v in reward.batch(["4", "5", "4"], [ROW] * 3)] == [1.0, 0.0, 1.0]


def test_an_unknown_signature_is_refused_naming_the_function_and_the_shapes():
    def mine(text, answer):
        return 1.0

    with pytest.raises(ValueError, match=r"mine\(text, answer\): a signature of no known shape; expected one of: "
                                         r"verl/ours: compute_score\(data_source, solution_str.*TRL.*OpenRLHF.*slime"):
        RewardFunction(mine, "mine")


def test_a_batched_reward_returning_the_wrong_count_is_an_error_naming_it():
    reward = RewardFunction(lambda completions, **kw: [1.0], "short")
    with pytest.raises(ValueError, match="short returned 1 rewards for 2 answers"):
        reward.batch(["a", "b"], [ROW, ROW])


VERL_REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "arith" and "index" in extra_info
    return 1.0 if solution_str.strip()[:1] == ground_truth[:1] else 0.0
'''


def write_verl_parquet(path, n: int) -> None:
    """verl's column layout (its gsm8k preprocessing): data_source, prompt (chat messages), ability,
    reward_model {style, ground_truth}, extra_info {split, index}."""
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i % 5}+0="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i % 5)}, "extra_info": {"split": "train", "index": i}}
            for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_a_verl_parquet_loads_with_its_own_columns(tmp_path):
    write_verl_parquet(tmp_path / "train.parquet", 6)
    rows = load_rows([str(tmp_path / "train.parquet")], DataConfig()).rows
    assert rows[2] == {"prompt": [{"role": "user", "content": "2+0="}], "label": "2", "data_source": "arith",
                       "extra_info": {"split": "train", "index": 2}, "ability": "math"}
    nested = load_rows([str(tmp_path / "train.parquet")], DataConfig(label_key="extra_info.index")).rows
    assert [r["label"] for r in nested] == list(range(6))  # any nested column, by its dotted path
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    env = make_task("scored", reward_path=str(tmp_path / "reward.py"))
    env.reset(0, row=rows[2])
    assert env.step("2").reward == 1.0 and env.step("3").reward == 0.0


def test_a_verl_parquet_and_verl_reward_train_with_the_files_and_the_reward_path_only(tmp_path):
    write_verl_parquet(tmp_path / "train.parquet", 16)
    write_verl_parquet(tmp_path / "val.parquet", 4)
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    args = ["task=scored", f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'val.parquet'}]", f"task.params.reward_path={tmp_path / 'reward.py'}"]
    figures = preview(["experiment=single_turn", *args], say=lambda *_: None)
    assert figures["train"]["reward_of_label_as_answer"] == 1.0 and figures["val"]["rows"] == 4
    history = run(composed(*args, "experiment.iterations=2", "rollout.groups_per_iteration=2", "algo.group_size=4",
                           "rollout.max_new_tokens=2", "tracking.wandb_mode=disabled", "tracking.progress=false",
                           "tracking.plots=false", f"run_dir={tmp_path / 'run'}"))
    assert len(history) == 2 and all(h["trajectories_finished"] == 8 and h["trajectories_dropped"] == 0
                                     for h in history)


BATCHED_REWARDS = '''import asyncio, json, os, threading

def log(kind, n):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps([kind, n]) + "\\n")

def trl_reward(completions, label, **kwargs):
    log("trl", len(completions))
    return [float(c[:1] == l[:1]) for c, l in zip(completions, label)]

def fragile(completions, label, **kwargs):
    log("fragile", len(completions))
    if len(completions) > 1:
        raise RuntimeError("cannot batch")
    return [1.0]

RUNNING = {"now": 0, "most": 0}

async def async_score(solution_str, ground_truth):
    RUNNING["now"] += 1
    RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    await asyncio.sleep(0.01)
    RUNNING["now"] -= 1
    log("async", RUNNING["most"])
    return float(solution_str[:1] == ground_truth[:1])
'''


@pytest.mark.parametrize("name, expect", [("trl_reward", "trl"), ("async_score", "async"), ("fragile", "fallback")])
def test_batched_and_async_rewards_run_on_a_whole_group_at_once(tmp_path, monkeypatch, name, expect):
    """A group's 4 samples end their turn together: a TRL function gets them in one call of 4 (not 4
    calls of 1), an async one has all 4 in flight at once (not one after the other), in training and
    in validation; each trajectory is scored all the same (none dropped)."""
    import json

    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n")
    (tmp_path / "reward.py").write_text(BATCHED_REWARDS)
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "calls.jsonl"))
    history = run(composed("task=scored", f"data.train_files={tmp_path / 'train.jsonl'}",
                           f"task.params.reward_path={tmp_path / 'reward.py'}", f"task.params.reward_name={name}",
                           f"data.val_files={tmp_path / 'train.jsonl'}", "eval.num_prompts=2", "eval.n=4",
                           "eval.temperature=1.0", "experiment.iterations=1", "rollout.groups_per_iteration=2",
                           "algo.group_size=4",
                           "rollout.max_new_tokens=2", "tracking.wandb_mode=disabled", "tracking.progress=false",
                           "tracking.plots=false", f"run_dir={tmp_path / 'run'}"))
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert history[0]["trajectories_finished"] == 8 and history[0]["trajectories_dropped"] == 0
    # 2 groups trained, 2 prompts x 4 samples validated before training and after the update
    assert history[0]["val/num_samples"] == 8 and "final_val/num_samples" in json.loads(
        (tmp_path / "run" / "summary.json").read_text())
    if expect == "trl":
        assert calls == [["trl", 4]] * 6
    elif expect == "fallback":  # a failed batch: in training each trajectory is stepped alone (and scored);
        # in validation the call's samples end with its error
        group = [["fragile", 4]] + [["fragile", 1]] * 4
        assert [n for _, n in calls] == [4, 4] + [4, 1, 1, 1, 1] * 2 + [4, 4] and calls[2:12] == group * 2
        assert history[0]["val/errors"] == 8
    else:
        assert len(calls) == 24 and max(n for _, n in calls) == 4
