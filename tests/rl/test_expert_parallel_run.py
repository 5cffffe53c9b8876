"""`torchrun --nproc_per_node 2 -m rl.train parallel.expert=2` (gloo, CPU, the tiny model with its
experts split over the two ranks) against the one-process run of the same global batch and seeds;
resumes across expert-parallel sizes (2 -> 1, 1 -> 2) and a kill -9 under expert parallelism."""
import json

import pytest
import torch

from models.checkpoint import load_checkpoint
from tests.rl.test_distributed_run import NO_WORK, RUN, SPILL, launch, metrics, ok

EP2 = ["parallel.expert=2"]


def weights(run_dir, iteration: int = 1) -> dict[str, torch.Tensor]:
    """The checkpoint's whole model (every expert, whichever rank wrote it)."""
    return load_checkpoint(run_dir / "checkpoints" / f"iter_{iteration:06d}").state_dict()


def max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / a[k].double().norm().clamp_min(1e-30)).item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    dirs = {name: root / name for name in ("one", "ep2", "one_no_work", "ep2_to_1", "ep1_to_2")}
    ok(launch(dirs["one"], *RUN, nproc=1))
    ok(launch(dirs["ep2"], *RUN, *EP2, nproc=2))
    ok(launch(dirs["one_no_work"], *NO_WORK, nproc=1))
    # one rank has no group in each iteration (rollout and training): iteration 0 at EP=2, resumed at EP=1
    ok(launch(dirs["ep2_to_1"], *NO_WORK, *SPILL, *EP2, "experiment.iterations=1", nproc=2))
    ok(launch(dirs["ep2_to_1"], *NO_WORK, *SPILL, "resume=true", nproc=2))
    # iteration 0 at EP=1, resumed at EP=2, killed (SIGKILL, every rank) as iteration 1 trains, resumed again
    ok(launch(dirs["ep1_to_2"], *RUN, "experiment.iterations=1", nproc=2))
    killed = launch(dirs["ep1_to_2"], *RUN, *EP2, "resume=true", nproc=2, fault="train:1")
    assert killed.returncode != 0
    dirs["killed_metrics"] = len(metrics(dirs["ep1_to_2"]))
    ok(launch(dirs["ep1_to_2"], *RUN, *EP2, "resume=true", nproc=2))
    yield dirs


def test_two_expert_parallel_ranks_equal_one_rank(runs):
    one, ep2 = metrics(runs["one"]), metrics(runs["ep2"])
    assert [m["iteration"] for m in ep2] == [0, 1]
    assert [m["reward_mean"] for m in ep2] == [m["reward_mean"] for m in one]
    assert one[0]["reward_mean"] > 0, "no reward: the update would be empty"
    for key in ("train_sequences", "train_tokens", "rollout_tokens", "trajectories_finished"):
        assert [m[key] for m in ep2] == [m[key] for m in one], key
    rel = max_rel(weights(runs["one"]), weights(runs["ep2"]))
    print(f"\nEP=2 vs one rank after 2 iterations: max rel. diff per tensor {rel:.2e}")
    assert rel <= 1e-5
    ckpt = runs["ep2"] / "checkpoints" / "iter_000001"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.1.block_sparse_moe.experts.0.w1.weight"] == "model-00001-of-00002.safetensors"
    assert index["model.layers.1.block_sparse_moe.experts.7.w1.weight"] == "model-00002-of-00002.safetensors"


def test_a_rank_without_tokens_and_a_resume_from_ep2_onto_ep1(runs):
    """Each iteration one rank has no group (it joins its peer's exchanges in rollout, the streamed
    reference and training); iteration 0 ran at EP=2, iteration 1 resumed at EP=1 (the optimizer
    states resharded): equal to the one-rank run."""
    one, resumed = metrics(runs["one_no_work"]), metrics(runs["ep2_to_1"])
    assert [m["iteration"] for m in resumed] == [0, 1]
    assert [m["reward_mean"] for m in resumed] == [m["reward_mean"] for m in one]
    assert [m["train_sequences"] for m in resumed] == [m["train_sequences"] for m in one]
    assert max_rel(weights(runs["one_no_work"]), weights(runs["ep2_to_1"])) <= 1e-5


def test_resume_from_ep1_onto_ep2_after_a_kill_equals_the_uninterrupted_run(runs):
    assert runs["killed_metrics"] == 1  # the kill came before iteration 1 was recorded
    one, resumed = metrics(runs["one"]), metrics(runs["ep1_to_2"])
    assert [m["iteration"] for m in resumed] == [0, 1]
    assert [m["reward_mean"] for m in resumed] == [m["reward_mean"] for m in one]
    assert max_rel(weights(runs["one"]), weights(runs["ep1_to_2"])) <= 1e-5
