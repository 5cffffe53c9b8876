"""`torchrun --nproc_per_node 2 -m rl.train parallel.context=2` (gloo, CPU, the tiny model; every
training sequence split over the two ranks, the streamed reference's too) against the one-process
run of the same global batch and seeds, and resumed from its checkpoint."""
import pytest

from tests.rl.test_distributed_run import RUN, launch, metrics, ok
from tests.rl.test_expert_parallel_run import max_rel, weights

CP2 = ["parallel.context=2"]
KL = ["algo.loss.kl_coef=0.1"]  # the streamed reference runs under the split too

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    dirs = {name: root / name for name in ("one", "cp2", "cp2_resumed")}
    ok(launch(dirs["one"], *RUN, *KL, nproc=1))
    ok(launch(dirs["cp2"], *RUN, *KL, *CP2, nproc=2))
    ok(launch(dirs["cp2_resumed"], *RUN, *KL, *CP2, "experiment.iterations=1", nproc=2))
    ok(launch(dirs["cp2_resumed"], *RUN, *KL, *CP2, "resume=true", nproc=2))
    yield dirs


def test_two_context_ranks_equal_one_rank(runs):
    one, cp2 = metrics(runs["one"]), metrics(runs["cp2"])
    assert [m["iteration"] for m in cp2] == [0, 1]
    assert [m["reward_mean"] for m in cp2] == [m["reward_mean"] for m in one]
    assert one[0]["reward_mean"] > 0, "no reward: the update would be empty"
    for key in ("train_sequences", "train_tokens", "rollout_tokens", "trajectories_finished"):
        assert [m[key] for m in cp2] == [m[key] for m in one], key  # counted once over the context group
    for a, b in zip(one, cp2):
        # the loss sums the ranks' shares in other fp32 orders (states, key blocks, gradients)
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"]))
    rel = max_rel(weights(runs["one"]), weights(runs["cp2"]))
    print(f"\nC=2 vs one rank after 2 iterations: max rel. diff per tensor {rel:.2e}")
    assert rel <= 1e-5  # two Adam steps of lr 1e-3 whose gradients agree to ~1e-6 of their norm


def test_a_resumed_context_parallel_run_equals_the_uninterrupted_one(runs):
    full, resumed = metrics(runs["cp2"]), metrics(runs["cp2_resumed"])
    assert [m["iteration"] for m in resumed] == [0, 1]
    assert [m["reward_mean"] for m in resumed] == [m["reward_mean"] for m in full]
    assert max_rel(weights(runs["cp2"]), weights(runs["cp2_resumed"])) == 0.0  # the same ops on the same states
