"""Expert parallelism in the model (models/expert_parallel.py): 2 processes over gloo, each holding
half of every MoE layer's experts, against the whole model in one process."""
import pytest
import torch
import torch.multiprocessing as mp

from tests.models.ep_worker import model_and_batch, run
from tests.bounds import scaled_err

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


def _spawn(tmp_path, num_experts: int, idle_rank: int | None):
    mp.spawn(run, args=(2, str(tmp_path / "init"), str(tmp_path), num_experts, idle_rank), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def _whole(num_experts: int):
    config, model, tokens = model_and_batch(num_experts)
    with torch.no_grad():
        logits = model(tokens)
    model(tokens).float().square().mean().backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("num_experts", [8, 16])
def test_two_ranks_holding_half_the_experts_equal_the_whole_model(tmp_path, num_experts):
    ranks = _spawn(tmp_path, num_experts, idle_rank=None)
    logits, grads = _whole(num_experts)
    assert [r["first"] for r in ranks] == [0, num_experts // 2]
    # Two ranks sum each token's expert outputs in another order (rows regrouped by the all-to-all), so the
    # bound is relative to the logits' scale: 1e-5 of their largest entry, ~100 fp32 ulps.
    for r in ranks:
        assert scaled_err(r["logits"], logits) <= 1e-5
    per = num_experts // 2
    for name, g in grads.items():
        for rank, r in enumerate(ranks):
            got = r["grads"][name]
            # both ranks ran the same batch: a rank's experts gather both ranks' tokens' gradients
            want = 2 * g[rank * per:(rank + 1) * per] if ".experts.w" in name else g
            assert got.shape == want.shape, name
            assert scaled_err(got, want) <= 1e-5, name  # the same orders as the logits, per gradient's scale


def test_a_rank_without_tokens_joins_the_exchanges_and_the_other_equals_the_whole_model(tmp_path):
    ranks = _spawn(tmp_path, 8, idle_rank=1)
    logits, grads = _whole(8)
    assert scaled_err(ranks[0]["logits"], logits) <= 1e-5  # other summation orders, as above
    # rank 0's experts: its own tokens' whole gradient; rank 1's experts saw rank 0's tokens only
    assert scaled_err(ranks[0]["grads"]["model.layers.1.mlp.experts.w1"], grads["model.layers.1.mlp.experts.w1"][:4]) <= 1e-5
    idle = ranks[1]["grads"]["model.layers.1.mlp.experts.w1"]
    assert scaled_err(idle, grads["model.layers.1.mlp.experts.w1"][4:]) <= 1e-5
    assert "model.embed_tokens.weight" not in ranks[1]["grads"]  # no token of its own reached the rest
