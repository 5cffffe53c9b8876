"""The RL loop on CUDA (`experiment.device=cuda`): where build puts each part, a two-iteration run
on one GPU with a streamed KL reference, micro-batches and a resume, and, with two GPUs, the
`torchrun --nproc_per_node 2` NCCL run against the one-GPU run of the same global batch.

Skipped without a GPU (`pytest -m gpu tests/rl/test_cuda_run.py` on a GPU host). Never run yet:
written on a CPU-only machine. The CPU half of the device plumbing is audited by
tests/rl/test_device.py (rl/, trainer/), tests/rollout/test_engine_device.py (the engine and the
paged mixer) and tests/models/test_model_device.py (the training mixer).
"""
import math

import pytest
import torch

from models.checkpoint import load_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from rl.run.ranks import Ranks
from rl.train import run
from rl.run.build import build
from tests.rl.test_config import composed
from tests.rl.test_distributed_run import RUN, final_weights, launch, metrics, ok
from tests.rl.test_train_run import SMALL, records
from trainer.ref_stream import StreamedReference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = ["experiment.device=cuda"]


def test_build_puts_models_and_gradient_slots_on_the_gpu_and_optimizer_states_on_the_host(tmp_path):
    gpu = torch.device("cuda", torch.cuda.current_device())
    cfg = composed(f"run_dir={tmp_path}", *SMALL, *CUDA, "algo.loss.kl_coef=0.1")
    parts = build(cfg, resume_from=None, ranks=Ranks(device=gpu))
    assert parts.device == gpu == parts.ranks.device
    assert {p.device for p in parts.policy.parameters()} == {gpu}
    assert {t.device for t in parts.engine.model.state_dict().values()} == {gpu}
    assert parts.engine.pool.device == gpu and parts.trainer.arena.device == gpu
    assert all(m.device.type == "cpu" for m in parts.trainer.optimizer.masters)
    ref = parts.ref_model
    assert isinstance(ref, StreamedReference) and ref.device == gpu
    assert all(h.is_pinned() for h in ref.host) and not ref.bound_parameters()  # weights on the host between uses


def test_two_iterations_on_one_gpu_then_resume(tmp_path):
    # RUN: seed 1, rewarded from the first iteration on the CPU (the same initial weights here)
    args = [f"run_dir={tmp_path}", *RUN, *CUDA, "algo.loss.kl_coef=0.1", "trainer.micro_batch_tokens=48"]
    history = run(composed(*args))
    assert len(history) == 2 and all(h["groups_trained"] == 4 and math.isfinite(h["loss"]) for h in history)
    assert "cuda" in torch.load(tmp_path / "checkpoints" / "iter_000001" / "rng-rank0.pt")
    resumed = run(composed(*args, "experiment.iterations=3", "resume=true"))
    assert len(resumed) == 1 and [m["iteration"] for m in records(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert resumed[0]["loss/kl"] > 0, "after two updates the policy differs from the reference"
    init = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=1, std=0.1).state_dict()
    final = load_checkpoint(tmp_path / "checkpoints" / "iter_000002").state_dict()
    assert any(not torch.equal(final[k], v) for k, v in init.items()), "no update moved the weights"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_over_nccl_equal_one_gpu_with_the_same_global_batch(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    ok(launch(one, *RUN, *CUDA, nproc=1))
    ok(launch(two, *RUN, *CUDA, nproc=2))
    m1, m2 = metrics(one), metrics(two)
    for key in ("groups_trained", "train_sequences", "reward_mean", "train_tokens"):
        assert [m[key] for m in m2] == [m[key] for m in m1], key
    assert m1[0]["reward_mean"] > 0, "no reward: the update would be empty"
    a, b = final_weights(one), final_weights(two)
    rel = max(((a[k].double() - b[k].double()).norm() / a[k].double().norm()).item() for k in a)
    print(f"\n1 vs 2 GPUs: max rel. diff per tensor {rel:.2e}")
    assert a.keys() == b.keys() and rel <= 1e-4  # CPU over gloo: 1.8e-7 (fp32 summation order only)
    for rank in range(2):
        shard = torch.load(two / "checkpoints" / "iter_000001" / f"optimizer-rank{rank}.pt")
        assert (shard["rank"], shard["world"]) == (rank, 2)
