"""The sampler: greedy, temperature, top-k / top-p, per-request seeds, the logprob convention, batched
truncation against the per-row reference, one host copy per step."""
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rollout.sampling import SamplingParams, sample, truncate, truncate_rows


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


def mixed_rows(num_rows: int, vocab: int, seed: int, ties: bool):
    """Random logits [num_rows, vocab] (with ties: few distinct values, so equal log-probs straddle the
    top-k and top-p cut-offs) and per-row settings mixing top-k, top-p, both and neither."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randint(-4, 4, (num_rows, vocab), generator=gen).float() * 0.5 if ties
              else torch.randn(num_rows, vocab, generator=gen) * 3)
    choice = torch.randint(0, 1000, (num_rows, 2), generator=gen).tolist()
    top_k = [[0, 1, 3, 17, vocab, vocab + 4][a % 6] for a, _ in choice]
    top_p = [[1.0, 0.9, 0.5, 0.2, 0.999][b % 5] for _, b in choice]
    return logits, top_k, top_p


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("vocab", [6, 259, 3001])
def test_batched_truncation_equals_the_per_row_reference(vocab, ties):
    logits, top_k, top_p = mixed_rows(24, vocab, seed=vocab, ties=ties)
    logp = torch.log_softmax(logits / 0.8, dim=-1)
    got = truncate_rows(logp, top_k, top_p)
    want = torch.stack([truncate(logp[r], top_k[r], top_p[r]) for r in range(len(top_k))])
    assert torch.equal(got, want)
    assert ((got == float("-inf")).sum(-1) > 0).any() and ((got > float("-inf")).sum(-1) > 0).all()
    keeps_all = [r for r in range(len(top_k)) if top_k[r] in (0, vocab, vocab + 4) and top_p[r] == 1.0]
    assert keeps_all and torch.equal(got[keeps_all], logp[keeps_all])  # untouched, bit for bit


def reference_sample(logits, params, generators):
    """The sampler row by row with `truncate`: what `sample` must equal, token for token."""
    tokens, logprobs = [], []
    for row, p, gen in zip(logits.float(), params, generators):
        logp = torch.log_softmax(row / (p.temperature if p.temperature > 0 else 1.0), dim=-1)
        token = int(row.argmax())
        if p.temperature > 0:
            cdf = truncate(logp, p.top_k, p.top_p).exp().cumsum(0)
            u = torch.rand(1, generator=gen)
            token = min(int(torch.searchsorted(cdf, u * cdf[-1], side="right")), row.shape[0] - 1)
        tokens.append(token)
        logprobs.append(float(logp[token]))
    return tokens, logprobs


@pytest.mark.parametrize("ties", [False, True])
def test_a_mixed_batch_samples_as_the_row_by_row_reference(ties):
    logits, top_k, top_p = mixed_rows(20, 259, seed=5, ties=ties)
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][r % 4], top_k=k, top_p=p)
              for r, (k, p) in enumerate(zip(top_k, top_p))]
    tokens, logprobs = sample(logits, params, [torch.Generator().manual_seed(50 + r) for r in range(20)])
    assert (tokens, logprobs) == reference_sample(logits, params, [torch.Generator().manual_seed(50 + r)
                                                                   for r in range(20)])
    assert all(type(t) is int for t in tokens) and all(type(lp) is float for lp in logprobs)


class HostReads(TorchFunctionMode):
    """Counts calls that copy tensor values to the host."""
    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero,
             torch.nonzero, torch.unique, torch.Tensor.unique, torch.masked_select}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS or (func is torch.where and len(args) == 1):
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_step_copies_tokens_and_logprobs_to_the_host_once():
    logits, top_k, top_p = mixed_rows(12, 259, seed=9, ties=False)
    params = [SamplingParams(temperature=[0.0, 1.0, 0.6][r % 3], top_k=k, top_p=p)
              for r, (k, p) in enumerate(zip(top_k, top_p))]
    with HostReads() as audit:
        sample(logits, params, [torch.Generator().manual_seed(r) for r in range(12)])
    assert audit.calls == ["tolist"]


def test_entropy_of_each_row_is_that_of_its_tempered_distribution():
    """Row 0 samples at temperature 0.5 with top-k 1 (the entropy is the untruncated tempered
    distribution's: the policy, not the truncation), row 1 is greedy (temperature 1's), row 2 has a
    token of probability 0 (adds nothing, no nan). Expected values by hand: -sum p log p."""
    from rollout.sampling import SamplingRows, sample_rows

    logits = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, float("-inf")]])
    params = [SamplingParams(temperature=0.5, top_k=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    rows = SamplingRows.plan(params, gens, 3)
    settings = torch.tensor(rows.values, dtype=torch.float64)
    rows.fill_draws(settings)
    tokens, logprobs, entropy = sample_rows(logits, rows, settings, with_entropy=True)
    z = math.exp(2.0) + 2.0  # temperature 0.5: exp(1 / 0.5) for token 0, exp(0) twice
    p = [math.exp(2.0) / z, 1 / z, 1 / z]
    assert entropy[0] == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-6)
    assert entropy[1] == pytest.approx(math.log(3), rel=1e-6) and entropy[2] == pytest.approx(math.log(2), rel=1e-6)
    assert tokens[0] == 0  # top-k 1 kept the argmax, whatever the entropy says


# Distributions written by hand for a 4-token vocabulary q = [0.5, 0.25, 0.15, 0.1] (not derived from
# the module's own truncation): temperature T gives q^(1/T) renormalised; top-k keeps the k likeliest;
# top-p keeps the smallest prefix (likeliest first) whose mass reaches p: the tokens whose preceding mass is < p.
Q = [0.5, 0.25, 0.15, 0.1]
BY_HAND = [
    (dict(temperature=1.0), [0.5, 0.25, 0.15, 0.1]),
    (dict(temperature=1.0, top_k=2), [2 / 3, 1 / 3, 0.0, 0.0]),
    (dict(temperature=1.0, top_p=0.6), [2 / 3, 1 / 3, 0.0, 0.0]),          # preceding 0, 0.5 < 0.6; 0.75 is not
    (dict(temperature=1.0, top_p=0.8), [5 / 9, 2.5 / 9, 1.5 / 9, 0.0]),    # 0, 0.5, 0.75 < 0.8; 0.9 is not
    (dict(temperature=1.0, top_p=0.4), [1.0, 0.0, 0.0, 0.0]),              # the likeliest alone reaches 0.4
    (dict(temperature=0.5), [0.25 / 0.345, 0.0625 / 0.345, 0.0225 / 0.345, 0.01 / 0.345]),
    (dict(temperature=2.0, top_k=3), [x / (0.5 ** 0.5 + 0.25 ** 0.5 + 0.15 ** 0.5) for x in
                                      (0.5 ** 0.5, 0.25 ** 0.5, 0.15 ** 0.5)] + [0.0]),
    # top-p over what top-k kept, renormalised: 5/9, 2.5/9, 1.5/9 with preceding mass 0, 5/9, 7.5/9 (> 0.8)
    (dict(temperature=1.0, top_k=3, top_p=0.8), [2 / 3, 1 / 3, 0.0, 0.0]),
]


@pytest.mark.parametrize("settings, expected", BY_HAND, ids=[str(s) for s, _ in BY_HAND])
def test_sampled_frequencies_match_distributions_written_by_hand(settings, expected):
    """Many rows in one batch (the engine's batched truncation), one draw each: the frequencies follow the
    hand-written distribution, and a token it gives 0 is never drawn."""
    logits = torch.tensor(Q).log()
    n = 6000
    params = [SamplingParams(**settings)] * n
    tokens, _ = sample(logits.expand(n, -1).clone(), params, [torch.Generator().manual_seed(i) for i in range(n)])
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / n
    expected = torch.tensor(expected, dtype=torch.float64)
    assert (freq[expected == 0] == 0).all(), (settings, freq)
    assert (freq - expected).abs().max() < 0.025, (settings, freq, expected)


@pytest.mark.parametrize("settings, expected", [c for c in BY_HAND if c[0]["temperature"] == 1.0],
                         ids=[str(s) for s, _ in BY_HAND if s["temperature"] == 1.0])
def test_the_one_row_reference_truncation_keeps_what_the_hand_says(settings, expected):
    kept = truncate(torch.tensor(Q).log(), settings.get("top_k", 0), settings.get("top_p", 1.0)).softmax(-1)
    # against the hand's fractions (no second computation order): dropped entries are exactly 0, kept ones are
    # probabilities of 0.1-1, so atol 1e-6 is a relative bound there
    torch.testing.assert_close(kept, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_top_p_stops_at_the_prefix_whose_mass_reaches_p_exactly():
    """Dyadic probabilities [0.5, 0.25, 0.125, 0.125] (exact in floating point) and top_p = 0.75: the prefix
    {0, 1} reaches 0.75 exactly, so token 2 (preceding mass 0.75, not < 0.75) is dropped, by the batched
    sampler and by the reference; a rule that kept it ("mass before < p" read as "<=") would draw it."""
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    torch.testing.assert_close(truncate(logits, 0, 0.75).softmax(-1), torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    n = 3000
    tokens, _ = sample(logits.expand(n, -1).clone(), [SamplingParams(temperature=1.0, top_p=0.75)] * n,
                       [torch.Generator().manual_seed(i) for i in range(n)])
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / n
    assert freq[2] == 0 and freq[3] == 0 and abs(freq[0] - 2 / 3) < 0.03, freq
