"""The trainer and the engine with the experts split over ranks (megatron-core's expert-parallel
groups, gloo, real processes) against one process holding every expert: one train step's updated
weights, greedy tokens with the prefix cache on, a rank without tokens, EP=2 x DP=2."""
import pytest
import torch
import torch.multiprocessing as mp

from models.config import load_model_config
from models.model import HybridLM
from tests.trainer.ep_step_worker import MICRO_BATCH_TOKENS, PROMPTS, engine_for, greedy, run
from tests.trainer.test_step import OPT, make_batch
from trainer.step import Trainer, TrainerConfig


@pytest.fixture(scope="module")
def whole():
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=3, std=0.1)
    trainer = Trainer(model, TrainerConfig(num_chunks=4, optimizer=OPT))
    lens, tokens, targets, weights = make_batch()
    trainer.train_step(tokens, lens, targets, lambda lp, rows, seqs: -(lp * weights[rows]).sum() / weights.numel(),
                       micro_batch_tokens=MICRO_BATCH_TOKENS)
    return {"state": model.state_dict(), "tokens": greedy(engine_for(model), PROMPTS), "reductions": trainer.num_grad_reductions}


def spawn(tmp_path, world: int, expert: int, idle_rank=None):
    mp.spawn(run, args=(world, str(tmp_path / "init"), str(tmp_path), expert, idle_rank), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def check(ranks, whole, expert: int, idle_rank=None):
    from tests.trainer.ep_step_worker import shares

    num_experts = 8 // expert
    worst = 0.0
    for r in ranks:
        for name, want in whole["state"].items():
            if ".experts.w" in name:
                want = want[r["expert_rank"] * num_experts:(r["expert_rank"] + 1) * num_experts]
            got = r["state"][name]
            assert got.shape == want.shape, name
            worst = max(worst, (got - want).abs().max().item())
        assert r["reductions"] == whole["reductions"] == 4  # one per chunk, whatever the micro-batches
    print(f"\nEP={expert} over {len(ranks)} ranks vs one: updated weights max abs diff {worst:.2e}")
    assert worst <= 1e-6
    per_rank = shares(len(ranks), idle_rank, PROMPTS)
    for r, prompts in zip(ranks, per_rank):
        for which in range(2):
            assert r["tokens"][which] == [whole["tokens"][which][i] for i in prompts]


def test_two_expert_parallel_ranks_take_the_one_rank_step_and_decode_its_tokens(tmp_path, whole):
    check(spawn(tmp_path, 2, 2), whole, 2)


def test_an_expert_parallel_rank_without_tokens_joins_training_and_rollout(tmp_path, whole):
    check(spawn(tmp_path, 2, 2, idle_rank=1), whole, 2, idle_rank=1)


@pytest.mark.slow
def test_ep2_by_dp2_over_four_ranks(tmp_path, whole):
    check(spawn(tmp_path, 4, 2), whole, 2)
