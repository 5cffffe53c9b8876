"""VPP chunks: chunk-by-chunk recompute + backward gives exactly the plain model's gradients."""
import itertools
import random

import pytest
import torch

from models.config import load_model_config
from models.model import HybridLM
from tests.trainer.plain import plain_packed_logprobs
from trainer.chunks import ChunkedModel, chunk_specs, split_chunks, unit_numels

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=1, std=0.1)


def test_split_is_contiguous_balanced_and_validated():
    specs = split_chunks(8, 3)
    assert [list(s.layers) for s in specs] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert specs[0].has_embedding and not specs[0].has_head and specs[-1].has_head
    with pytest.raises(ValueError, match="num_chunks=9, expected 1..num_layers=8"):
        split_chunks(8, 9)


def test_params_split_minimises_the_largest_chunk():
    """Against every contiguous split of random unit sizes: the largest chunk is the smallest
    possible, chunks are non-empty and in order, the embedding opens the first and the head closes
    the last, and every layer is in exactly one chunk."""
    rng = random.Random(0)
    for _ in range(300):
        layers = rng.randint(1, 6)
        units = [rng.randint(1, 30) for _ in range(layers + 2)]
        k = rng.randint(1, layers + 2)
        specs = split_chunks(layers, k, units)
        assert len(specs) == k and specs[0].has_embedding and specs[-1].has_head
        assert [i for s in specs for i in s.layers] == list(range(layers))
        sums = [units[0] * s.has_embedding + sum(units[1 + i] for i in s.layers) + units[-1] * s.has_head
                for s in specs]
        assert all(sums), specs  # no empty chunk
        best = min(max(sum(units[a:b]) for a, b in zip((0, *cuts), (*cuts, len(units))))
                   for cuts in itertools.combinations(range(1, len(units)), k - 1))
        assert max(sums) == best, (units, k, specs)


def test_params_split_of_the_model_gives_embedding_and_head_their_own_chunks(model):
    layers = model.config.num_hidden_layers
    specs = chunk_specs(model, layers + 2, "params")
    assert specs[0].has_embedding and not specs[0].layers and specs[-1].has_head and not specs[-1].layers
    assert [list(s.layers) for s in specs[1:-1]] == [[i] for i in range(layers)]
    numels = unit_numels(model)
    assert sum(numels) == sum(p.numel() for p in model.parameters())
    chunked = ChunkedModel(model, 3, "params")
    assert max(chunked.chunk_numel(c) for c in range(3)) <= max(ChunkedModel(model, 3).chunk_numel(c) for c in range(3))
    with pytest.raises(ValueError, match="num_chunks=11, expected 1..num_layers \\+ 2 = 10"):
        chunk_specs(model, layers + 3, "params")
    with pytest.raises(ValueError, match="chunk_split='bytes', expected one of"):
        chunk_specs(model, 2, "bytes")


@pytest.mark.parametrize("num_chunks,split", [(1, "layers"), (2, "layers"), (4, "layers"), (8, "layers"),
                                              (3, "params"), (10, "params")])
def test_chunked_backward_equals_plain_backward(model, num_chunks, split):
    gen = torch.Generator().manual_seed(num_chunks)
    lens = [37, 5, 80]
    tokens = torch.randint(0, 259, (sum(lens),), generator=gen)
    targets = torch.randint(0, 259, (sum(lens),), generator=gen)
    weights = torch.randn(sum(lens), generator=gen)

    def loss_fn(logp):
        return (logp * weights).sum() / len(lens)

    # plain: the whole model in one piece
    model.zero_grad()
    plain_logp = plain_packed_logprobs(model, lens, tokens, targets)
    plain_loss = loss_fn(plain_logp)
    plain_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    chunked = ChunkedModel(model, num_chunks, split)
    seen, snapshots = [], {}

    def done(c):
        seen.append(c)
        snapshots[c] = {n: p.grad.clone() for n, p in chunked.chunk_parameters(c) if p.grad is not None}

    loss, logprobs = chunked.forward_backward(tokens, lens, targets, loss_fn, on_chunk_done=done)
    assert seen == list(reversed(range(num_chunks)))
    assert abs(loss.item() - plain_loss.item()) <= 1e-5 * abs(plain_loss.item())
    assert rel_err(logprobs, plain_logp.detach()) <= 1e-6
    names = [n for c in range(num_chunks) for n, _ in chunked.chunk_parameters(c)]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each parameter in one chunk
    for n, p in model.named_parameters():
        if n not in expected:
            assert p.grad is None or p.grad.abs().sum() == 0, n  # e.g. experts no token chose
            continue
        # 3e-5: a KDA A_log gradient (2 numbers, each a sum over every token with cancellations) moves
        # by up to 1.6e-5 when the residual gradients are summed at chunk boundaries in another order
        # (one layer per chunk); every other parameter stays within 1e-5.
        assert rel_err(p.grad, expected[n]) <= 3e-5, n
    # each chunk's gradients were already final when its callback ran
    for c, grads in snapshots.items():
        for n, g in grads.items():
            assert torch.equal(g, dict(model.named_parameters())[n].grad), (c, n)


def test_bad_inputs(model):
    chunked = ChunkedModel(model, 2)
    with pytest.raises(ValueError, match=r"seq_lens \[3, 3\] must be positive and sum to 5"):
        chunked.forward_backward(torch.zeros(5, dtype=torch.long), [3, 3], torch.zeros(5, dtype=torch.long),
                                 lambda lp: lp.sum())


def test_each_layer_runs_twice_except_the_last_chunk_once(model):
    """The graph-free forward stops before the last chunk: its layers run once (the recompute with a
    graph), every other chunk's twice (graph-free, then recomputed)."""
    chunked = ChunkedModel(model, 3)
    calls = [0] * model.config.num_hidden_layers
    handles = [layer.input_layernorm.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, layer in enumerate(model.model.layers)]
    try:
        tokens = torch.randint(0, 259, (20,), generator=torch.Generator().manual_seed(0))
        chunked.forward_backward(tokens, [12, 8], tokens.roll(-1), lambda lp: -lp.sum())
    finally:
        for h in handles:
            h.remove()
    last = set(chunked.specs[-1].layers)
    assert calls == [1 if i in last else 2 for i in range(len(calls))]


def test_chunk_major_micro_batches_equal_one_pass_per_micro_batch(model):
    """forward_backward_batches (every micro-batch's backward of a chunk before the next chunk down,
    each chunk's callback once) accumulates the same gradients as one forward_backward per
    micro-batch (each calling every chunk's callback), within 1e-6; the losses are the same."""
    from trainer.chunks import MicroBatch

    gen = torch.Generator().manual_seed(3)
    batches = []
    for lens in ([7, 12], [20], [3, 5, 9]):
        tokens = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=gen)
        batches.append((tokens, lens, tokens.roll(-1)))
    chunked = ChunkedModel(model, 3)
    model.zero_grad()
    per_batch = [chunked.forward_backward(t, lens, y, lambda lp: -lp.mean())[0] for t, lens, y in batches]
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    calls = []
    results = chunked.forward_backward_batches([MicroBatch(t, lens, y, lambda lp: -lp.mean()) for t, lens, y in batches],
                                               on_chunk_done=lambda c: calls.append(("done", c)),
                                               on_chunk_start=lambda c: calls.append(("start", c)))
    assert calls == [(kind, c) for c in (2, 1, 0) for kind in ("start", "done")]
    assert [r[0].item() for r in results] == [loss.item() for loss in per_batch]
    for n, p in model.named_parameters():
        if n in expected:
            assert rel_err(p.grad, expected[n]) <= 1e-6, n
    model.zero_grad()


def test_a_train_step_reduces_each_chunk_once_whatever_its_micro_batches():
    """Four micro-batches, four chunks: one gradient reduction per chunk in the step."""
    from trainer.step import Trainer, TrainerConfig

    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=2, std=0.1)
    trainer = Trainer(model, TrainerConfig(num_chunks=4))
    lens = [10, 12, 9, 11]
    tokens = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(0))
    metrics = trainer.train_step(tokens, lens, tokens.roll(-1), lambda lp, rows, seqs: -lp.sum() / len(tokens),
                                 micro_batch_tokens=12)
    assert metrics["micro_batches"] == 4 and trainer.num_grad_reductions == 4
