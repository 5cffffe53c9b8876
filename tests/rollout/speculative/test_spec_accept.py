"""The speculative acceptance rule (rollout/speculative/spec_accept.py) against distributions computed by hand: over a
bigram "model" on a 5-token vocabulary, speculative generation of two tokens (n-gram point-mass proposals,
always right, always wrong or random, and a draft distribution's samples) gives each 2-token outcome with the
target's probability p(t1) p(t2 | t1), by a chi-square bound at a fixed seed; greedy emits the argmax path;
the reported logprobs are the sampler's."""
import itertools

import pytest
import torch

from rollout.sampling import SamplingParams
from rollout.speculative.spec_accept import accept, accept_many, target_probs
from tests.bounds import LOGPROB_TOL

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

VOCAB = 5
BIGRAM = torch.tensor([[1.2, 0.3, -0.5, 0.8, 0.0],
                       [0.1, 1.5, 0.2, -1.0, 0.6],
                       [-0.3, 0.4, 0.9, 0.0, 1.1],
                       [0.7, -0.2, 0.1, 1.3, -0.4],
                       [0.0, 0.5, -0.7, 0.2, 0.9]])
"""Logits of the next token given the previous one (row)."""
DRAFT = torch.softmax(BIGRAM.flip(1) * 0.7, dim=-1)
"""A draft model's next-token distribution given the previous token: deliberately unlike the target."""
CHI2_DF24_P9999 = 56.0
"""The 99.99% quantile of chi-square with 24 degrees of freedom (25 outcomes) is 55.9 (tables)."""


def by_hand(params: SamplingParams) -> torch.Tensor:
    """p(t1) p(t2 | t1) [VOCAB, VOCAB] after token 0, each factor the sampler's distribution written out:
    softmax(logits / T), top-k kept by rank, top-p smallest prefix reaching p, renormalised."""
    def dist(prev: int) -> torch.Tensor:
        z = BIGRAM[prev] / params.temperature
        p = torch.softmax(z, dim=0)
        order = p.argsort(descending=True)
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        mass = 0.0
        for rank, t in enumerate(order.tolist()):
            if (params.top_k and rank >= params.top_k) or mass >= params.top_p:
                break
            keep[t], mass = True, mass + float(p[t])
        p = torch.where(keep, p, 0.0)
        return p / p.sum()
    first = dist(0)
    return torch.stack([first[a] * dist(a) for a in range(VOCAB)])


def speculate_two(params, generator, propose) -> tuple[int, int]:
    """Generate 2 tokens after token 0 by speculation: `propose(prefix) -> (proposal, draft_probs or None)`,
    verified against the bigram target; rounds until 2 tokens are out."""
    out: list[int] = []
    prev = 0
    while len(out) < 2:
        proposal, q = propose(prev)
        logits = torch.stack([BIGRAM[t] for t in [prev, *proposal]])
        verdict = accept(logits, proposal, params, generator, q)
        out += verdict.tokens
        prev = out[-1]
    return out[0], out[1]


def proposers():
    rng = torch.Generator().manual_seed(99)

    def right(prev):  # the target's own argmax path: mostly accepted at low temperature
        a = int(BIGRAM[prev].argmax())
        return [a, int(BIGRAM[a].argmax())], None

    def wrong(prev):  # the target's least likely tokens
        a = int(BIGRAM[prev].argmin())
        return [a, int(BIGRAM[a].argmin())], None

    def random_tokens(prev):
        return torch.randint(VOCAB, (3,), generator=rng).tolist(), None

    def draft(prev):  # sampled from the draft's distribution, which the rule is told
        tokens, rows = [], []
        for _ in range(2):
            rows.append(DRAFT[prev])
            prev = int(torch.multinomial(DRAFT[prev], 1, generator=rng))
            tokens.append(prev)
        return tokens, torch.stack(rows)

    return {"right": right, "wrong": wrong, "random": random_tokens, "draft": draft}


@pytest.mark.parametrize("proposer", ["right", "wrong", "random", "draft"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t1", "t07_k3", "t13_p08"])
def test_speculated_pairs_follow_the_target_distribution(proposer, params):
    expected = by_hand(params)  # [VOCAB, VOCAB]
    generator = torch.Generator().manual_seed(1234)
    propose = proposers()[proposer]
    draws = 6000
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(draws):
        a, b = speculate_two(params, generator, propose)
        counts[a, b] += 1
    assert (counts[expected == 0] == 0).all(), "a token outside top-k / top-p was emitted"
    support = expected > 0
    want = expected[support] * draws
    chi2 = float(((counts[support] - want) ** 2 / want).sum())
    assert chi2 < CHI2_DF24_P9999, (chi2, counts, want)


def test_a_wrong_rule_fails_the_same_bound():
    """The bound has teeth: accepting every proposal (no rejection) is far outside it."""
    params = SamplingParams(temperature=1.0)
    expected = by_hand(params)
    counts = torch.zeros(VOCAB, VOCAB)
    propose = proposers()["random"]
    for _ in range(6000):
        proposal, _ = propose(0)
        counts[proposal[0], proposal[1]] += 1
    want = expected * 6000
    assert float(((counts - want) ** 2 / want).sum()) > 10 * CHI2_DF24_P9999


@pytest.mark.parametrize("proposal,kept", [([0, 0, 0], 3), ([0, 3, 0], 1), ([2, 0], 0), ([], 0)])
def test_greedy_keeps_the_argmax_prefix_and_samples_the_argmax(proposal, kept):
    """Greedy: the argmax after 0 is 0 (1.2), and after 0 again 0: proposals are kept while they are the
    argmax; the token after is the argmax at the first mismatch (or after the last kept)."""
    params = SamplingParams(temperature=0.0)
    logits = torch.stack([BIGRAM[t] for t in [0, *proposal]])
    verdict = accept(logits, proposal, params, None)
    assert verdict.num_accepted == kept
    assert verdict.tokens == proposal[:kept] + [0]  # the argmax after token 0 is 0
    logp = torch.log_softmax(BIGRAM[0], dim=0)
    # a row of a batched log_softmax vs the one-row op: rounding only, relative to the logits' few units
    assert verdict.logprobs == pytest.approx([float(logp[0])] * (kept + 1), **LOGPROB_TOL)


def test_logprobs_are_the_samplers_before_truncation():
    params = SamplingParams(temperature=0.7, top_k=2)
    generator = torch.Generator().manual_seed(5)
    logits = torch.stack([BIGRAM[t] for t in [0, 3, 3]])
    verdict = accept(logits, [3, 3], params, generator)
    for row, token, lp in zip(range(len(verdict.tokens)), verdict.tokens, verdict.logprobs):
        assert lp == pytest.approx(float(torch.log_softmax(logits[row] / 0.7, dim=0)[token]), **LOGPROB_TOL)
    probs, _ = target_probs(logits, params)
    assert torch.allclose(probs.sum(-1), torch.ones(3)) and ((probs > 0).sum(-1) == 2).all()


def test_bad_shapes_are_refused_naming_what_was_expected():
    params = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="logits of 2 rows for 2 proposals: expected 3"):
        accept(BIGRAM[:2], [1, 2], params, torch.Generator())
    with pytest.raises(ValueError, match=r"draft_probs of shape \(1, 5\), expected \(2, 5\)"):
        accept(BIGRAM[:3], [1, 2], params, torch.Generator(), DRAFT[:1])
    with pytest.raises(ValueError, match="needs the sequence's generator"):
        accept(BIGRAM[:1], [], params, None)


def test_the_same_seed_speculates_the_same_tokens():
    params = SamplingParams(temperature=1.0)
    runs = [[speculate_two(params, g, proposers()["random"]) for _ in range(50)]
            for g in (torch.Generator().manual_seed(3), torch.Generator().manual_seed(3))]
    assert runs[0] == runs[1]
    assert len(set(itertools.chain.from_iterable(runs[0]))) > 1


@pytest.mark.parametrize("with_draft", [False, True])
def test_batched_acceptance_equals_the_one_sequence_rule(with_draft):
    """`accept_many` over a step's verifications (mixed settings: greedy, T=1, T=0.7 top-k 3, T=1.3 top-p
    0.8; proposals of 0-4 tokens, half of them right) returns `accept`'s verdicts, token for token and
    logprob for logprob, from generators in the same state; and leaves them in the same state."""
    rng = torch.Generator().manual_seed(5)
    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3, top_p=0.8)]
    for trial in range(40):
        num = 1 + trial % 5
        params = [settings[(trial + i) % 4] for i in range(num)]
        proposals, logits, drafts = [], [], []
        for i in range(num):
            k = int(torch.randint(0, 5, (1,), generator=rng))
            rows = torch.randn(k + 1, VOCAB, generator=rng) * 2
            right = rows.argmax(dim=-1).tolist()
            proposals.append([right[j] if (j + i) % 2 else int(torch.randint(0, VOCAB, (1,), generator=rng))
                              for j in range(k)])
            logits.append(rows)
            drafts.append(torch.softmax(torch.randn(k, VOCAB, generator=rng), dim=-1) if with_draft else None)
        seeds = [trial * 10 + i for i in range(num)]
        gens = [torch.Generator().manual_seed(s) if p.temperature > 0 else None for s, p in zip(seeds, params)]
        many = accept_many(torch.cat(logits), proposals, params, gens, drafts if with_draft else None)
        gens_one = [torch.Generator().manual_seed(s) if p.temperature > 0 else None for s, p in zip(seeds, params)]
        one = [accept(x, prop, p, g, q) for x, prop, p, g, q in zip(logits, proposals, params, gens_one, drafts)]
        for a, b in zip(many, one):
            assert a.tokens == b.tokens
            # one softmax over all rows vs one per verification: rounding only, tokens and generators exactly equal
            assert a.logprobs == pytest.approx(b.logprobs, **LOGPROB_TOL) and a.entropies == pytest.approx(b.entropies, abs=1e-5)
        for a, b in zip(gens, gens_one):
            if a is not None:
                assert torch.equal(a.get_state(), b.get_state())
