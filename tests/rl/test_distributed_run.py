"""`torchrun --nproc_per_node 2 -m rl.train` (gloo, CPU, the tiny model) against the one-process run
of the same global batch and seeds: the multi-GPU smoke suite (NCCL on a GPU host via the same
commands). Each run is a subprocess with OMP_NUM_THREADS=1; the runs are shared by the tests."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from models.checkpoint import load_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from rl.train import run
from tests.rl.test_config import composed

ROOT = Path(__file__).resolve().parents[2]
# Rewards are nonzero from the first iteration with seed 1 (a zero-reward iteration would leave the
# weights untouched and the comparison empty). AdamW eps 1e-4: Adam moves an entry by ~lr whatever
# its gradient's size, so with eps 1e-8 an entry whose true gradient is ~0 moves by up to lr in a
# direction set by fp32 summation-order noise (1 vs 2 ranks: 1.2e-4 apart after two steps, seen);
# with 1e-4 the noise stays below eps and the runs agree to ~2e-7 (tests/trainer/test_step.py's OPT
# has the same note).
RUN = ["experiment=single_turn", "experiment.iterations=2", "tracking.wandb_mode=disabled", "tracking.progress=false", "tracking.plots=false",
       "rollout.groups_per_iteration=4", "algo.group_size=8", "rollout.max_new_tokens=2", "seed=1",
       "trainer.optimizer.eps=1e-4"]
# One group per iteration: iteration 0's group 0 is rank 0's, iteration 1's group 1 is rank 1's, so
# each rank has no work in one iteration. A rank without work adds exact zeros to the gradient sum:
# two ranks equal one bit for bit. Seed 3: both groups are rewarded (both updates move the weights).
# With a KL term (the streamed reference skips an empty rank) and, on two ranks, the optimizer states
# spilled to disk between iterations (each rank its own shard files).
# No gradient clipping here: the clip coefficient comes from the global norm, whose sum of squares
# is taken over each rank's shards and then over ranks, so its last bits (and the clipped weights')
# depend on the world size; clipped DP runs agree to <= 1e-6 (tests/trainer/test_grad_guard.py).
NO_WORK = [*RUN, "rollout.groups_per_iteration=1", "seed=3", "algo.loss.kl_coef=0.1", "trainer.max_grad_norm=null"]
SPILL = ["memory.spill_dir=nvme"]
TIMES: dict[str, float] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, *overrides: str, nproc: int, fault: str | None = None) -> subprocess.CompletedProcess:
    """`python -m rl.train` (nproc=1) or `python -m torch.distributed.run --nproc_per_node nproc -m rl.train`;
    `fault` ("<phase>:<iteration>"): every rank kills itself with SIGKILL as that phase starts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("HYBRIDRL_FAULT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if fault is not None:
        env.update(HYBRIDRL_FAULT=fault, HYBRIDRL_TEST_FAULTS="1")
    launcher = ([] if nproc == 1 else
                ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                 "--master_port", str(free_port())])
    cmd = [sys.executable, *launcher, "-m", "rl.train", f"run_dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    TIMES[f"{run_dir.name} ({nproc} rank{'s' if nproc > 1 else ''}{', resume' if 'resume=true' in overrides else ''})"] = \
        time.perf_counter() - t0
    return done


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if done.returncode != 0:  # the whole output, for the post-mortem (pytest shows its tail)
        Path(os.environ.get("TMPDIR", "/tmp"), "failed_run.log").write_text(done.stdout + "\n" + done.stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path, iteration: int = 1) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under the model's own parameter names."""
    return load_checkpoint(run_dir / "checkpoints" / f"iter_{iteration:06d}").state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    dirs = {name: root / name for name in ("one", "two", "one_no_work", "two_no_work")}
    ok(launch(dirs["one"], *RUN, nproc=1))
    ok(launch(dirs["two"], *RUN, nproc=2))
    ok(launch(dirs["one_no_work"], *NO_WORK, nproc=1))
    # the no-work run stops after iteration 0 and resumes on two ranks for iteration 1
    ok(launch(dirs["two_no_work"], *NO_WORK, *SPILL, "experiment.iterations=1", nproc=2))
    resumed = ok(launch(dirs["two_no_work"], *NO_WORK, *SPILL, "resume=true", nproc=2))
    said = " ".join(resumed.stdout.split())  # rich wraps long lines
    assert "resuming" in said and "after iteration 0 on 2 ranks" in said, said[-2000:]
    yield dirs
    print("\nrun seconds:", {k: round(v, 1) for k, v in TIMES.items()})


def test_two_ranks_equal_one_rank_with_the_same_global_batch(runs):
    one, two = metrics(runs["one"]), metrics(runs["two"])
    assert [m["iteration"] for m in two] == [0, 1]
    # the same episodes and tokens: rewards (summed in group order) equal bit for bit, global counts
    assert [m["reward_mean"] for m in two] == [m["reward_mean"] for m in one]
    assert one[0]["reward_mean"] > 0, "no reward: the update would be empty"
    for key in ("groups_trained", "train_sequences", "train_tokens", "rollout_tokens", "trajectories_finished"):
        assert [m[key] for m in two] == [m[key] for m in one], key
    assert two[0]["train_sequences"] == 32.0
    # the engines start from the same weights; after the first update they moved (and each rank's
    # engine held the same checksum, or the run would have stopped with the ranks named)
    assert two[0]["engine_checksum"] == one[0]["engine_checksum"] != two[1]["engine_checksum"]
    a, b = final_weights(runs["one"]), final_weights(runs["two"])
    init = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=1, std=0.1).state_dict()
    rel = {k: ((a[k].double() - b[k].double()).norm() / a[k].double().norm()).item() for k in a}
    moved = max((a[k] - init[k]).abs().max().item() for k in a)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"\n1 vs 2 ranks: max rel. diff per tensor {max(rel.values()):.2e}, max abs diff {diff:.2e}, "
          f"max move from init {moved:.2e}")
    assert a.keys() == b.keys() and max(rel.values()) <= 1e-5, sorted(rel.items(), key=lambda kv: -kv[1])[:3]
    assert diff < 1e-3 * moved
    assert abs(two[1]["loss"] - one[1]["loss"]) <= 1e-5 * max(1.0, abs(one[1]["loss"]))


def test_rank_zero_alone_writes_and_every_rank_checkpoints_its_share(runs):
    run_dir = runs["two"]
    phases = [(r["iteration"], r["phase"]) for r in map(json.loads, (run_dir / "phases.jsonl").read_text().splitlines())]
    one_rank = ["load_weights", "rollout", "sleep", "gather", "train", "checkpoint", "offload"]
    assert phases == [(0, p) for p in one_rank] + [(1, "wake")] + [(1, p) for p in one_rank]  # one writer
    ckpt = run_dir / "checkpoints" / "iter_000001"
    assert json.loads((ckpt / "iteration.json").read_text()) == {"iteration": 1, "world_size": 2}
    for rank in range(2):
        shard = torch.load(ckpt / f"optimizer-rank{rank}.pt")
        assert (shard["rank"], shard["world"]) == (rank, 2)
        driver = json.loads((ckpt / f"driver-rank{rank}.json").read_text())
        assert driver["next_group"] == 8 and driver["carry"] == [] and driver["waiting"] == {}
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))
    assert (run_dir / "summary.json").exists() and (run_dir / "train.log").exists()


def test_a_rank_without_work_joins_every_collective_and_resume_keeps_the_run(runs):
    """Each iteration one rank has no group; the 2-rank run, stopped after iteration 0 and resumed on
    2 ranks, equals the one-rank run bit for bit (weights, rewards, checksums)."""
    one, two = metrics(runs["one_no_work"]), metrics(runs["two_no_work"])
    assert [m["iteration"] for m in two] == [0, 1]
    for key in ("reward_mean", "groups_trained", "train_tokens", "engine_checksum", "loss", "loss/kl"):
        assert [m[key] for m in two] == [m[key] for m in one], key
    assert [m["groups_trained"] for m in two] == [1.0, 1.0] and all(m["reward_mean"] > 0 for m in two)
    assert two[1]["engine_checksum"] != two[0]["engine_checksum"], "iteration 0's update (rank 0's group) moved nothing"
    assert two[1]["loss/kl"] > 0  # the policy left the reference after iteration 0
    a, b = final_weights(runs["one_no_work"]), final_weights(runs["two_no_work"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # each rank its own store (and lock) in the run's subdirectory of memory.spill_dir
    spilled = sorted(f"{f.parent.name}/{f.name}" for f in (runs["two_no_work"] / "nvme").rglob("*.spill"))
    assert spilled == [f"rank{r}/train_states.rank{r}.chunk{c}.spill" for r in range(2) for c in range(2)]


def test_resume_with_another_number_of_ranks_is_refused(runs):
    cfg = composed(f"run_dir={runs['two']}", *RUN, "experiment.iterations=3", "resume=true")
    with pytest.raises(ValueError, match=r"run with 2 rank\(s\).*resume it with the same number of ranks"):
        run(cfg)
