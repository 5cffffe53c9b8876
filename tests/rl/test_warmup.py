"""rl/run/warmup.py: the supervised warm-up lowers the demonstrations' loss, runs once per run (a resume
reads its record and reproduces the uninterrupted run), and the summary separates its gain from RL's."""
import json

import pytest
import torch
from safetensors.torch import load_file

from models.model import HybridLM
from models.tokenizer import ByteTokenizer
from rl.run.figures import reward_figures
from rl.run.ranks import Ranks
from rl.envs.tasks import make_task
from rl.train import run
from rl.run.warmup import WarmupConfig, demo_tokens, load_record, warmup_step
from tests.rl.test_config import composed
from trainer.step import Trainer, TrainerConfig

SMALL = ["tracking.wandb_mode=disabled", "tracking.progress=false", "rollout.groups_per_iteration=2",
         "algo.group_size=4", "warmup.steps=3", "warmup.episodes_per_step=8", "warmup.eval_groups=2",
         "algo.loss.kl_coef=0.05"]


def test_a_demonstration_is_packed_as_the_driver_builds_a_trajectory():
    tok, env = ByteTokenizer(), make_task("key_lookup", brackets=False)
    tokens, policy = demo_tokens(env, tok, seed=3, value=True)
    env.reset(3)
    q = env.query
    v = str(env.table[q])
    eos = tok.eos_token_id
    assert tokens == tok.encode(f"get {q}:") + [ord(q), eos] + list(f"={v};".encode()) + [ord(v), eos]
    trained = [t for t, p in zip(tokens, policy) if p]
    assert trained == [ord(q), eos, ord(v), eos]  # the answers and their eos; prompt and observation given
    with pytest.raises(ValueError, match="no demonstration"):
        demo_tokens(object(), tok, 0, True)


def test_warmup_steps_lower_the_demonstrations_loss_and_restore_the_learning_rate():
    cfg = composed("task=key_lookup")
    torch.manual_seed(0)
    model = HybridLM(cfg.model)
    model.init_weights(seed=0, std=0.1)
    trainer = Trainer(model, TrainerConfig(num_chunks=2))
    env, tok = make_task("key_lookup", brackets=False), ByteTokenizer()
    episodes = [demo_tokens(env, tok, seed, value=True) for seed in range(16)]
    rl_lr = trainer.optimizer.adam.param_groups[0]["lr"]
    with trainer.unscheduled(3e-3):
        assert trainer.optimizer.adam.param_groups[0]["lr"] == 3e-3
        losses = [warmup_step(trainer, episodes, Ranks())["loss"] for _ in range(12)]
    assert trainer.optimizer.adam.param_groups[0]["lr"] == rl_lr
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:4])), losses  # the first steps descend steadily


def test_bad_warmup_values_name_them():
    with pytest.raises(ValueError, match="steps=-1"):
        WarmupConfig(steps=-1)
    with pytest.raises(ValueError, match="lr=0"):
        WarmupConfig(lr=0.0)


def test_the_warmup_runs_once_and_a_resume_reproduces_the_uninterrupted_run(tmp_path):
    """A new run takes the warm-up before iteration 0 and records it; a resume neither repeats it
    nor loses it: its KL reference is the warm-up's result again, so the resumed run ends with the
    uninterrupted run's weights and rewards, and the record is untouched."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(composed(f"run_dir={straight}", "experiment.iterations=3", *SMALL))
    run(composed(f"run_dir={resumed}", "experiment.iterations=2", *SMALL))
    record_path = resumed / "warmup" / "record.json"
    record, stamp = record_path.read_text(), record_path.stat().st_mtime_ns
    assert len(json.loads(record)["steps"]) == 3
    run(composed(f"run_dir={resumed}", "experiment.iterations=3", *SMALL, "resume=true"))
    assert record_path.read_text() == record and record_path.stat().st_mtime_ns == stamp, "the warm-up ran again"
    a = load_file(straight / "checkpoints" / "iter_000002" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "iter_000002" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"
    metrics = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert [m["reward_mean"] for m in metrics] == \
        [json.loads(line)["reward_mean"] for line in (straight / "metrics.jsonl").read_text().splitlines()]
    # the reference streamed in every iteration, and the summary separates the warm-up's gain from RL's
    assert all(m["ref_stream_bytes"] > 0 for m in metrics)
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["reward_after_warmup"] == load_record(resumed)["reward_after"]
    assert summary["rl_gain"] == pytest.approx(summary["reward_final"] - summary["reward_after_warmup"])


def test_the_warmup_weights_are_saved_and_differ_from_the_initial_policy(tmp_path):
    run(composed(f"run_dir={tmp_path}", "experiment.iterations=1", *SMALL, "warmup.lr=0.01"))
    warm = load_file(tmp_path / "warmup" / "model.safetensors")
    cfg = composed("task=majority_digit")
    init = HybridLM(cfg.model)
    init.init_weights(seed=0, std=0.1)
    changed = [k for k, v in init.state_dict().items() if k in warm and not torch.equal(warm[k], v)]
    assert changed, "the warm-up changed no weight"


def test_the_summary_states_the_warmups_share_of_the_gain():
    records = [{"iteration": i, "reward_mean": r} for i, r in enumerate([0.3, 0.4, 0.5, 0.6, 0.7])]
    figures = reward_figures(records, {"steps": [{"step": 0, "loss": 1.0}] * 4, "reward_before": 0.0,
                                       "reward_after": 0.3, "seconds": 1.0})
    assert figures["reward_final"] == pytest.approx(0.6)  # the last tenth, at least 3 iterations
    assert figures["warmup_gain"] == pytest.approx(0.3) and figures["rl_gain"] == pytest.approx(0.3)
    assert figures["warmup_share_of_gain"] == pytest.approx(0.5) and figures["warmup_steps"] == 4


def test_the_default_runs_summary_states_the_constant_answer_ceiling(tmp_path):
    """The task's best constant-answer reward is in summary.json, the bar the run must clear."""
    from rl.run.figures import run_summary
    from rl.run.tracking import Tracker, TrackingConfig

    tracker = Tracker(tmp_path, TrackingConfig(wandb_mode="disabled", progress=False, plots=False), run_config={})
    tracker.log(0, {"reward_mean": 0.5})
    ceiling = make_task("key_lookup", brackets=False).constant_answer_ceiling
    summary = run_summary(tmp_path, None, ceiling)
    assert summary["constant_answer_ceiling"] == pytest.approx(0.0342, abs=1e-4) and summary["reward_final"] == 0.5


@pytest.mark.slow
def test_the_default_run_killed_then_resumed_reproduces_the_uninterrupted_run(tmp_path):
    """`make run`'s config with every mechanism on (warm-up, prefix cache, host pool, spill, streamed
    reference, kv partial rollouts), shortened: kill -9 in iteration 2's train phase, resume, and the
    weights and rewards are the uninterrupted run's; the warm-up ran once."""
    import os
    import signal
    import subprocess
    import sys

    from tests.rl.test_train_run import ROOT, records

    args = ["experiment.iterations=4", "warmup.steps=5", "tracking.wandb_mode=disabled", "tracking.progress=false"]

    def cli(run_dir, *extra, fault=None):
        env = {k: v for k, v in os.environ.items() if k != "HYBRIDRL_FAULT"}
        if fault:
            env.update(HYBRIDRL_FAULT=fault, HYBRIDRL_TEST_FAULTS="1")
        return subprocess.run([sys.executable, "-m", "rl.train", f"run_dir={run_dir}", *args, *extra], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)

    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert cli(straight).returncode == 0
    assert cli(crashed, fault="train:2").returncode == -signal.SIGKILL
    again = cli(crashed, "resume=true")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming" in again.stdout and "warm-up" not in again.stdout
    a = load_file(straight / "checkpoints" / "iter_000003" / "model.safetensors")
    b = load_file(crashed / "checkpoints" / "iter_000003" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"
    assert [m["reward_mean"] for m in records(crashed / "metrics.jsonl")] == \
        [m["reward_mean"] for m in records(straight / "metrics.jsonl")]
