"""RL runs of the algorithm presets on the tiny model: PPO's critic trains, spills and checkpoints with
the policy; dynamic sampling trains only groups with a spread; a killed PPO run resumes bit for bit."""
import signal

import pytest
from safetensors.torch import load_file

from rl.train import run
from tests.rl.test_config import composed
from tests.rl.test_train_run import SMALL, cli, records

PPO = ("algo=ppo", "algo.kl_in_reward.coef=0.05", "algo.kl_in_reward.controller=adaptive",
       "algo.kl_in_reward.horizon=20", "memory.spill_dir=spill")


def test_ppo_trains_its_critic_beside_the_policy(tmp_path):
    cfg = composed(f"run_dir={tmp_path}", "experiment.iterations=2", *SMALL, *PPO)
    history = run(cfg)
    assert all(h["groups_trained"] == 4 for h in history)
    last = records(tmp_path / "metrics.jsonl")[-1]
    assert last["critic/vf_loss"] > 0 and last["critic/grad_norm"] > 0
    assert last["kl_in_reward/beta"] != 0.05  # the adaptive controller moved after the first update
    ckpt = tmp_path / "checkpoints" / "iter_000001"
    assert (ckpt / "critic" / "model.safetensors").is_file() and (ckpt / "critic" / "optimizer-rank0.pt").is_file()
    assert (ckpt / "kl_controller.json").is_file()
    head = load_file(ckpt / "critic" / "model.safetensors")["lm_head.weight"]
    assert tuple(head.shape)[0] == 1 and head.abs().sum() > 0  # the value head left zero: it trained
    train = [r for r in records(tmp_path / "phases.jsonl") if r["phase"] == "restore"]
    assert train and all(r["bytes_moved"] > 0 for r in train)  # both models' states came back from NVMe


def test_dynamic_sampling_trains_only_groups_with_a_spread(tmp_path):
    cfg = composed(f"run_dir={tmp_path}", "experiment.iterations=2", *SMALL, "algo=dapo", "algo.overlong.enable=false")
    run(cfg)
    for m in records(tmp_path / "metrics.jsonl"):
        assert 1 <= m["dynamic_sampling/rounds"] <= 4
        assert m["groups_trained"] + m["dynamic_sampling/short"] == 4
        assert m["groups_zero_std_frac"] >= 0 and 0 <= m["dynamic_sampling/drop_rate"] <= 1


@pytest.mark.slow
def test_a_killed_ppo_run_resumes_bit_for_bit(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    done = cli(straight, *PPO)
    assert done.returncode == 0, done.stderr[-2000:]
    killed = cli(crashed, *PPO, fault="train:1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    again = cli(crashed, *PPO, "resume=true")
    assert again.returncode == 0, again.stderr[-2000:]
    for rel in ("model.safetensors", "critic/model.safetensors"):
        a = load_file(straight / "checkpoints" / "iter_000002" / rel)
        b = load_file(crashed / "checkpoints" / "iter_000002" / rel)
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), f"resumed {rel} differs"
    assert [m["reward_mean"] for m in records(crashed / "metrics.jsonl")] == \
        [m["reward_mean"] for m in records(straight / "metrics.jsonl")]
