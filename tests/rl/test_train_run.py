"""End-to-end RL runs of the tiny model: the loop, its files, and kill -9 + resume."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl.train import run
from tests.rl.test_config import composed

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["experiment=single_turn", "tracking.wandb_mode=disabled", "tracking.progress=false",
         "rollout.groups_per_iteration=4",
         "algo.group_size=4", "rollout.max_new_tokens=3"]
PHASES = ["load_weights", "rollout", "sleep", "train", "checkpoint", "offload"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_iterations_end_to_end(tmp_path):
    cfg = composed(f"run_dir={tmp_path}", "experiment.iterations=2", *SMALL)
    history = run(cfg)
    assert len(history) == 2 and all(h["groups_trained"] == 4 and h["train_sequences"] == 16 for h in history)
    metrics = records(tmp_path / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    assert all(0 <= m["reward_mean"] <= 1 for m in metrics)
    phases = [(r["iteration"], r["phase"]) for r in records(tmp_path / "phases.jsonl")]
    assert phases == [(0, p) for p in PHASES] + [(1, "wake")] + [(1, p) for p in PHASES]
    pool = [r["memory"]["device_pool"] for r in records(tmp_path / "phases.jsonl") if r["phase"] == "train"]
    assert pool == [0, 0], "the engine's pool must be released while training"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter_000001"
    for name in ("reward.png", "memory.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    with pytest.raises(FileExistsError, match="resume=true"):
        run(cfg)  # a used run_dir is not silently overwritten


def test_kv_partial_rollouts_park_in_the_host_pool_while_the_device_pool_is_released(tmp_path):
    """Budgeted rollouts leave requests paused with their KV; sleep parks it in the host KV pool,
    wake restores it, and the next iteration continues those trajectories."""
    cfg = composed(f"run_dir={tmp_path}", "experiment.iterations=3", *SMALL, "rollout.max_new_tokens=6",
                   "rollout.budget_tokens=40", "rollout.partial_resume=kv", "engine.host_pool_mb=4",
                   "prefix_cache=on", "engine.prefix_cache.hash_block=16")
    history = run(cfg)
    assert sum(h["trajectories_carried"] for h in history[:-1]) > 0, "the budget should leave work to carry over"
    phases = records(tmp_path / "phases.jsonl")
    assert [r["memory"]["device_pool"] for r in phases if r["phase"] == "sleep"] == [0, 0, 0]
    assert all(0 < r["memory"]["host_pool"] <= 4 << 20 for r in phases)
    assert sum(h["groups_trained"] for h in history) >= 4


def test_spilling_the_optimizer_states_to_nvme_leaves_the_run_bit_identical(tmp_path):
    """memory.spill_dir: after each iteration the optimizer's host states go to disk (restored before
    the next update); the run's weights, optimizer checkpoint and rewards equal a run without spill."""
    plain, spilled = tmp_path / "plain", tmp_path / "spilled"
    run(composed(f"run_dir={plain}", "experiment.iterations=3", *SMALL))
    run(composed(f"run_dir={spilled}", "experiment.iterations=3", *SMALL, "memory.spill_dir=nvme"))
    final = "checkpoints/iter_000002"
    a, b = load_file(plain / final / "model.safetensors"), load_file(spilled / final / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "spilled run's weights differ"
    oa, ob = torch.load(plain / final / "optimizer-rank0.pt"), torch.load(spilled / final / "optimizer-rank0.pt")
    assert all(torch.equal(x, y) for x, y in zip(oa["masters"], ob["masters"]))
    for i, st in oa["adam"]["state"].items():
        assert all(torch.equal(v, ob["adam"]["state"][i][k]) for k, v in st.items() if torch.is_tensor(v))
    assert [m["reward_mean"] for m in records(spilled / "metrics.jsonl")] == \
        [m["reward_mean"] for m in records(plain / "metrics.jsonl")]
    phases = records(spilled / "phases.jsonl")
    assert [(r["iteration"], r["phase"]) for r in phases if r["iteration"] == 1] == \
        [(1, p) for p in ["wake", "load_weights", "rollout", "sleep", "restore", "train", "checkpoint", "offload"]]
    by = {(r["iteration"], r["phase"]): r for r in phases}
    trained_host = by[(0, "train")]["memory"]["train_host"]
    for it in (0, 1, 2):
        off = by[(it, "offload")]
        assert off["bytes_moved"] > 0 and off["memory"]["train_disk"] >= off["bytes_moved"]
        assert off["memory"]["train_host"] < trained_host // 100  # only scalar step counters stay resident
        assert by[(it, "train")]["memory"]["train_disk"] == 0 and by[(it, "train")]["memory"]["train_host"] == trained_host
        # the checkpoint reads the states from host memory, before the offload: never from the spill,
        # so each state is written once (offload) and read once (restore) per iteration
        ckpt = by[(it, "checkpoint")]["memory"]
        assert ckpt["train_disk"] == 0 and ckpt["train_host"] == trained_host
        assert [r["phase"] for r in phases if r["iteration"] == it and r["bytes_moved"]
                and r["phase"] not in ("sleep", "offload", "restore")] == []
    for it in (1, 2):
        assert by[(it, "rollout")]["memory"]["train_disk"] > 0  # spilled while generating
        assert by[(it, "restore")]["bytes_moved"] == by[(it - 1, "offload")]["bytes_moved"]
    assert all(r["memory"]["train_disk"] == 0 for r in records(plain / "phases.jsonl"))


def cli(run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("HYBRIDRL_FAULT", None)
    if fault:
        env.update(HYBRIDRL_FAULT=fault, HYBRIDRL_TEST_FAULTS="1")
    return subprocess.run([sys.executable, "-m", "rl.train", f"run_dir={run_dir}", "experiment.iterations=3",
                           *SMALL, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def assert_resume_reproduces(straight: Path, crashed: Path, *extra: str) -> None:
    """`resume=true` on the crashed run ends with the uninterrupted run's weights and rewards."""
    again = cli(crashed, *extra, "resume=true")
    assert again.returncode == 0, again.stderr[-2000:]
    a = load_file(straight / "checkpoints" / "iter_000002" / "model.safetensors")
    b = load_file(crashed / "checkpoints" / "iter_000002" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "resumed weights differ"
    assert [m["reward_mean"] for m in records(crashed / "metrics.jsonl")] == \
        [m["reward_mean"] for m in records(straight / "metrics.jsonl")]


def straight_run(tmp_path_factory, *extra: str) -> Path:
    """The uninterrupted run every kill/resume case compares with (one per module and settings)."""
    straight = tmp_path_factory.mktemp("straight")
    done = cli(straight, *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    return straight


@pytest.fixture(scope="module")
def straight_plain(tmp_path_factory) -> Path:
    return straight_run(tmp_path_factory)


@pytest.fixture(scope="module")
def straight_spilled(tmp_path_factory) -> Path:
    return straight_run(tmp_path_factory, "memory.spill_dir=spill")


@pytest.mark.slow
def test_kill_during_train_then_resume_reproduces_the_uninterrupted_run(tmp_path, straight_plain):
    straight, crashed = straight_plain, tmp_path / "crashed"
    killed = cli(crashed, fault="train:1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (crashed / "checkpoints" / "latest").read_text() == "iter_000000"
    again = cli(crashed, "resume=true")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming" in again.stdout
    a = load_file(straight / "checkpoints" / "iter_000002" / "model.safetensors")
    b = load_file(crashed / "checkpoints" / "iter_000002" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "resumed weights differ"
    assert [m["iteration"] for m in records(crashed / "metrics.jsonl")] == [0, 1, 2]
    assert [m["reward_mean"] for m in records(crashed / "metrics.jsonl")] == \
        [m["reward_mean"] for m in records(straight / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["rollout:1", "offload:1"])
def test_kill_with_states_spilled_then_resume_reproduces_the_uninterrupted_run(tmp_path, fault, straight_spilled):
    """memory.spill_dir on: killed while the optimizer states sit on disk (rollout: stale spill files
    left behind) or just after they were read back and updated (offload: nothing on disk), the
    resumed run starts from the last checkpoint and ends with the uninterrupted run's weights and
    rewards."""
    spill = ("memory.spill_dir=spill",)
    straight, crashed = straight_spilled, tmp_path / "crashed"
    killed = cli(crashed, *spill, fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    left = list((crashed / "spill").rglob("*.spill"))  # in the run's subdirectory, one store per rank
    assert bool(left) == (fault == "rollout:1"), left  # spilled during rollout, read back (and dropped) before train
    assert_resume_reproduces(straight, crashed, *spill)


def test_token_eviction_runs_in_the_loop(tmp_path, monkeypatch):
    """kv_budget=... engine.kv_budget.budget_tokens: the engine keeps each sequence's MLA cache within the budget
    (InfiniGen: evicted tokens offloaded to host memory) while the loop trains as usual."""
    from rollout.engine import Engine

    evicted: list[int] = []
    stats = Engine.stats

    def watched(self):
        figures = stats(self)
        evicted.append(figures["kv_evicted"])
        return figures

    monkeypatch.setattr(Engine, "stats", watched)
    cfg = composed(f"run_dir={tmp_path}", "experiment.iterations=2", *SMALL, "rollout.max_new_tokens=48",
                   "engine.max_model_len=128", "kv_budget=infinigen", "engine.kv_budget.budget_tokens=40")
    history = run(cfg)
    assert len(history) == 2 and all(h["groups_trained"] > 0 for h in history)
    assert evicted and max(evicted) > 0, "48 new tokens after the prompt must exceed a 40-token budget"


@pytest.mark.slow
@pytest.mark.parametrize("fault, latest", [
    ("wake:1", 0), ("load_weights:1", 0), ("sleep:1", 0), ("restore:1", 0), ("checkpoint:1", 0),
    ("checkpoint_written:1", 0),  # inside save_iteration: written and fsynced, not yet renamed
    ("checkpoint_published:1", 1),  # inside save_iteration: `latest` moved, older ones not yet retired
])
def test_kill_at_every_phase_boundary_then_resume_reproduces_the_uninterrupted_run(tmp_path, fault, latest,
                                                                                  straight_spilled):
    """kill -9 as each remaining phase starts (train, rollout and offload: the tests above) and at
    the two points inside the checkpoint, with the optimizer states spilled: the resume continues
    from the last published checkpoint and ends with the uninterrupted run's weights and rewards."""
    spill = ("memory.spill_dir=spill",)
    straight, crashed = straight_spilled, tmp_path / "crashed"
    killed = cli(crashed, *spill, fault=fault)
    assert killed.returncode == -signal.SIGKILL, f"{fault} never fired: " + killed.stderr[-2000:]
    assert (crashed / "checkpoints" / "latest").read_text() == f"iter_{latest:06d}"
    assert_resume_reproduces(straight, crashed, *spill)
    assert not list((crashed / "checkpoints").glob(".tmp_*"))


def test_host_pages_written_back_counts_the_write_back_at_sleep(tmp_path, monkeypatch):
    """Every page the host tier writes back, during the rollout or when sleep writes the prefix
    cache's turn-boundary entries back (only when they outlive the new weights: reuse_stale), is in some
    iteration's `host_pages_written_back`."""
    from rollout.engine import Engine

    engines, at_sleep = [], []
    sleep = Engine.sleep

    def watched(self):
        before = self.cache.host_tier.pages_written_back
        written = sleep(self)
        engines.append(self)
        at_sleep.append(self.cache.host_tier.pages_written_back - before)
        assert written == at_sleep[-1], "sleep returns the pages it wrote back"
        return written

    monkeypatch.setattr(Engine, "sleep", watched)
    history = run(composed(f"run_dir={tmp_path}", "experiment.iterations=2", *SMALL, "task=key_lookup",
                           "engine.host_pool_mb=4", "prefix_cache=on", "engine.prefix_cache.hash_block=4",
                           "engine.max_model_len=64", "engine.prefix_cache.reuse_stale=true"))
    assert sum(at_sleep) > 0, "the multi-turn task leaves turn-boundary entries for sleep to write back"
    assert sum(h["host_pages_written_back"] for h in history) == engines[-1].cache.host_tier.pages_written_back


@pytest.mark.slow
def test_a_start_killed_before_its_first_checkpoint_is_run_again_without_duplicate_records(tmp_path, straight_plain):
    """Killed with iteration 0's metrics logged but its checkpoint not yet published: no checkpoint, so
    resume=true starts a new run, which must not keep the dead start's records (found by the random-instant
    kill harness: metrics.jsonl held iteration 0 twice)."""
    crashed = tmp_path / "crashed"
    killed = cli(crashed, fault="checkpoint_written:0")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [m["iteration"] for m in records(crashed / "metrics.jsonl")] == [0]
    assert not (crashed / "checkpoints" / "latest").exists()
    assert_resume_reproduces(straight_plain, crashed)
    assert [m["iteration"] for m in records(crashed / "metrics.jsonl")] == [0, 1, 2]
    assert [r["iteration"] for r in records(crashed / "phases.jsonl")].count(0) == \
        [r["iteration"] for r in records(straight_plain / "phases.jsonl")].count(0)
