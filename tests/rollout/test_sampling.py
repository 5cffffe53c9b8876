"""The sampler: greedy, temperature, top-k / top-p, per-request seeds, the logprob convention."""
import math

import pytest
import torch

from rollout.sampling import SamplingParams, sample, truncate


def draws(logits, params, n, seed0=0):
    counts = torch.zeros(logits.shape[-1])
    for i in range(n):
        (token,), _ = sample(logits[None], [params], [torch.Generator().manual_seed(seed0 + i)])
        counts[token] += 1
    return counts / n


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.8)])
def test_frequencies_follow_the_truncated_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    expected = truncate(torch.log_softmax(logits / temperature, -1), top_k, top_p).softmax(-1)
    freq = draws(logits, params, 4000)
    assert (freq[expected == 0] == 0).all(), "a truncated token was drawn"
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_a_seeded_row_draws_the_same_whatever_the_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 50, generator=gen)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(5)]
    together, _ = sample(logits, params, [torch.Generator().manual_seed(100 + b) for b in range(5)])
    alone = [sample(logits[b:b + 1], params[b:b + 1], [torch.Generator().manual_seed(100 + b)])[0][0] for b in range(5)]
    assert together == alone


def test_greedy_rows_and_the_logprob_convention():
    logits = torch.tensor([[0.1, 3.0, -1.0], [1.0, 0.5, 0.2]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=1)]
    tokens, logprobs = sample(logits, params, [torch.Generator(), torch.Generator().manual_seed(0)])
    assert tokens == [1, 0]  # argmax; top-k 1 leaves only the argmax
    assert math.isclose(logprobs[0], torch.log_softmax(logits[0], -1)[1].item(), rel_tol=1e-6)
    # temperature-adjusted, before truncation: log softmax(logits / 2) of the drawn token
    assert math.isclose(logprobs[1], torch.log_softmax(logits[1] / 2.0, -1)[0].item(), rel_tol=1e-6)
