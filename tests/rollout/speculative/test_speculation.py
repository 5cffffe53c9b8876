"""Speculative decoding in the engine (rollout/speculative/speculation.py): greedy speculation emits plain decoding's
tokens and logprobs with proposals always right, always wrong, random, and from the n-gram proposer; after
every step each running sequence's pool state (MLA latents of its computed tokens, KDA states and conv
tails) equals a from-scratch recompute of its computed prefix; pool integrity holds after every step; with
the prefix cache every registered entry is a recompute of verified tokens and the output is the same."""
import random

import pytest
import torch

from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.request import SeqStatus
from rollout.sampling import SamplingParams
from rollout.speculative.proposers import NgramProposer, Proposer
from tests.rollout.kv.test_prefix_cache import HB, make_verifier
from tests.bounds import LOGPROB_TOL

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def prompts(num: int, seed: int) -> list[list[int]]:
    """Random prompts with repeats inside (as tool output copied into a conversation): n-grams recur."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        piece = [rng.randrange(256) for _ in range(rng.randint(3, 9))]
        out.append([rng.randrange(256) for _ in range(rng.randint(2, 20))] + piece * rng.randint(1, 3)
                   + [rng.randrange(256) for _ in range(rng.randint(0, 6))])
    return out


class Oracle(Proposer):
    """Proposes what plain decoding will emit (always right), or its tokens shifted by one (always wrong)."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], wrong: bool = False) -> None:
        self.expected, self.wrong = expected, wrong

    def propose(self, seq, k):
        for prompt, out in self.expected.items():
            n = len(prompt)
            if tuple(seq.tokens[:n]) == prompt:
                done = len(seq.tokens) - n
                guess = out[done:done + k]
                return [(t + 1) % 256 for t in guess] if self.wrong else guess
        raise AssertionError("unknown sequence")


class RandomProposer(Proposer):
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, seq, k):
        return [self.rng.randrange(256) for _ in range(self.rng.randint(1, k))]


def engine_for(model, speculative: str = "off", prefix: bool = False, pages: int = 80, **knobs) -> Engine:
    return Engine(model, EngineConfig.for_pages(
        model, pages, max_model_len=200, check_every_step=True, speculative=speculative,
        prefix_cache=PrefixCacheConfig(hash_block=HB, model_id="tiny") if prefix else None, **knobs))


def generate(engine: Engine, batch: list[list[int]], params=GREEDY, after_step=None, turns=False):
    """Run `batch` to the end; `turns`: each prompt ends a conversation turn (the prefix cache keeps a KDA
    checkpoint there)."""
    ids = [engine.add_request(p, params, turn_boundaries=[len(p)] if turns else ()) for p in batch]
    outs = {}
    while len(outs) < len(ids):
        for out in engine.step():
            outs[out.request_id] = out
        if after_step is not None:
            after_step(engine)
    return [outs[i].samples[0] for i in ids]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def pool_states(engine: Engine, seq) -> list[torch.Tensor]:
    """A running sequence's pool entries for its computed tokens: each KDA layer's state and conv tails,
    each MLA layer's latents of tokens 0 .. num_computed - 1."""
    out = []
    for g, layers in enumerate(engine.layout.kda_groups):
        for layer in layers:
            state = engine.pool.read_kda_state(seq.kda_pages[g], layer)
            out += [state.recurrent.clone(), state.conv_tail.clone()]
    for g, layers in enumerate(engine.layout.mla_groups):
        for layer in layers:
            view = engine.pool.mla_view(layer)
            out.append(torch.cat([view[p] for p in seq.mla_pages[g]])[:seq.num_computed].clone())
    return out


def snapshots(record: dict, compare: dict | None = None):
    """After each step, each running sequence's pool entries keyed by (prompt, num_computed): recorded
    (a plain run's), or compared with the plain run's at the same key (every key must be there)."""
    def after_step(engine):
        for seq in engine.sequences():
            if seq.status is not SeqStatus.RUNNING or not seq.holds_pages or seq.num_computed < seq.prompt_len:
                continue
            key = (tuple(seq.tokens[:seq.prompt_len]), seq.num_computed)
            got = pool_states(engine, seq)
            if compare is None:
                record[key] = got
                continue
            errors = [rel(a, b) for a, b in zip(got, compare[key])]
            record["first_layer"] = max(record.get("first_layer", 0.0), *errors[:2])
            record["worst"] = max(record.get("worst", 0.0), *errors)
            record["checked"] = record.get("checked", 0) + 1
    return after_step


@pytest.fixture(scope="module")
def plain(tiny_model):
    batch, states = prompts(6, seed=1), {}
    samples = generate(engine_for(tiny_model), batch, after_step=snapshots(states))
    return batch, samples, states


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "right", "wrong", "random"])
def test_greedy_speculation_emits_plain_decodings_tokens_and_logprobs(tiny_model, plain, proposer):
    batch, want, plain_states = plain
    engine = engine_for(tiny_model, "suffix" if proposer == "suffix" else "ngram", num_speculative_tokens=4)
    expected = {tuple(p): s.tokens for p, s in zip(batch, want)}
    if proposer not in ("ngram", "suffix"):
        engine.speculator.proposer = {"right": Oracle(expected), "wrong": Oracle(expected, wrong=True),
                                      "random": RandomProposer(3)}[proposer]
    checked: dict = {}
    got = generate(engine, batch, after_step=snapshots(checked, plain_states))
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, **LOGPROB_TOL)  # verify chunks vs decode steps; measured <= 1.0e-5 abs
    spec = engine.speculator
    assert spec.num_verifications > 0 and checked["checked"] > 0
    # The accepted prefix's KV and KDA states are a plain run's: the first layer (the same inputs) within
    # 1e-6, deeper layers within 1e-5 (a verify chunk and a decode step round differently in fp32, and the
    # difference rides through the layers: ~2e-6 at the last here, as between two chunkings of a prompt).
    assert checked["first_layer"] <= 1e-6 and checked["worst"] <= 1e-5, checked
    if proposer == "right":
        assert spec.acceptance_rate == 1.0
        assert engine.num_steps < 24 * 6  # several tokens per step
    if proposer == "wrong":
        assert spec.num_accepted == 0
    assert engine.pool.num_used == 0


def test_with_the_prefix_cache_output_is_the_same_and_only_verified_tokens_are_cached(tiny_model, plain):
    """Random proposals (mostly rejected: unverified tokens sit in the pool's slots and position pages):
    after every step every index entry is a recompute of a prefix of what plain decoding produced (a
    proposal in a cached block would not be), and a next turn (the prompt and 5 of its tokens) hits them
    and decodes the same."""
    batch, want, _ = plain
    engine = engine_for(tiny_model, "ngram", prefix=True)
    engine.speculator.proposer = RandomProposer(5)
    verify, checked = make_verifier(tiny_model, [p + s.tokens for p, s in zip(batch, want)])
    first = generate(engine, batch, after_step=verify, turns=True)
    later = SamplingParams(temperature=0.0, max_new_tokens=19, ignore_eos=True)  # the next turn: the same ends
    again = generate(engine, [p + s.tokens[:5] for p, s in zip(batch, want)], later, after_step=verify, turns=True)
    assert [s.tokens for s in first] == [s.tokens for s in want]
    assert [s.tokens for s in again] == [s.tokens[5:] for s in want]
    assert engine.cache.prefix.hit_tokens > 0 and checked["mla"] > 0 and checked["kda"] > 0
    assert engine.speculator.num_verifications > 0


def test_accepted_proposals_cross_hash_blocks_and_the_cache_checkpoints_from_position_pages(tiny_model, plain):
    """Proposals always right with k = 6 (chunks of 7 tokens, hash blocks of 16): verifications cross
    hash-block boundaries inside their accepted tokens; the cache hashes the accepted proposals before they
    are appended and checkpoints the KDA state at the crossed boundary from its position page. Every entry
    is a recompute of a prefix of plain decoding's output after every step, and the next turn hits them."""
    batch, want, _ = plain
    engine = engine_for(tiny_model, "ngram", prefix=True, num_speculative_tokens=6)
    engine.speculator.proposer = Oracle({tuple(p): s.tokens for p, s in zip(batch, want)})
    crossed = []
    after_forward = engine.cache.after_forward

    def spy(seqs, pending=None, inner=None):
        crossed.extend((inner or {}).values())
        after_forward(seqs, pending, inner)

    engine.cache.after_forward = spy
    verify, checked = make_verifier(tiny_model, [p + s.tokens for p, s in zip(batch, want)])
    first = generate(engine, batch, after_step=verify, turns=True)
    assert [s.tokens for s in first] == [s.tokens for s in want]
    assert len(crossed) >= len(batch) and all(position % HB == 0 for position, _ in crossed)
    kda_checked = checked["kda"]
    later = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True)
    again = generate(engine, [p + s.tokens[:10] for p, s in zip(batch, want)], later, after_step=verify)
    assert [s.tokens for s in again] == [s.tokens[10:] for s in want]
    assert engine.cache.prefix.hit_tokens > 0 and kda_checked > 0
    assert engine.speculator.acceptance_rate == 1.0


def test_siblings_and_a_later_epoch_propose_from_the_suffix_tree_and_the_output_stays_plain(tiny_model, plain):
    """Each prompt twice in one batch (a group's siblings) and then again (the next epoch): every token and
    logprob is plain decoding's, and the next epoch's proposals, from the earlier responses in the prompt's
    tree, are kept (the siblings decode in lockstep: neither has text ahead of the other to propose)."""
    batch, want, _ = plain
    engine = engine_for(tiny_model, "suffix", num_speculative_tokens=4)
    twice = [p for p in batch for _ in range(2)]
    got = generate(engine, twice)
    assert [s.tokens for s in got] == [s.tokens for s in want for _ in range(2)]
    for g, w in zip(got, [w for w in want for _ in range(2)]):
        assert g.logprobs == pytest.approx(w.logprobs, **LOGPROB_TOL)
    spec = engine.speculator
    proposed, accepted = spec.num_proposed, spec.num_accepted
    engine.sleep()
    engine.wake()
    again = generate(engine, batch)  # the trees outlive the engine's sleep
    assert [s.tokens for s in again] == [s.tokens for s in want]
    later = (spec.num_accepted - accepted) / max(1, spec.num_proposed - proposed)
    assert later > 0.8, (accepted, proposed, later)  # the earlier epoch's text is greedy's own
    assert engine.pool.num_used == 0


def test_sampled_speculation_is_seeded_and_keeps_the_budget(tiny_model):
    batch = prompts(4, seed=2)
    params = SamplingParams(temperature=0.9, top_k=20, max_new_tokens=10, seed=11, ignore_eos=True)
    runs = [generate(engine_for(tiny_model, "ngram"), batch, params) for _ in range(2)]
    assert [s.tokens for s in runs[0]] == [s.tokens for s in runs[1]]
    assert all(len(s.tokens) == 10 and len(s.logprobs) == 10 == len(s.versions) for s in runs[0])


def test_ngram_proposer_copies_the_continuation_of_the_latest_match():
    class Seq:
        def __init__(self, tokens, prompt_len):
            self.tokens, self.prompt_len = tokens, prompt_len

    seq = Seq([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2], prompt_len=4)
    proposer = NgramProposer(1, 3)
    assert proposer.propose(seq, 3) == [3, 7, 8]  # "1 2" last seen before 3 7 8 ...
    seq.tokens += [3]
    assert proposer.propose(seq, 2) == [7, 8]  # "1 2 3" -> 7 8 (the latest of two)
    seq.tokens += [4]
    assert proposer.propose(seq, 2) == []  # "4" never occurred before
    # another sequence: its own tokens first, then what the first generated (not its prompt)
    other = Seq([6, 6, 9, 1], prompt_len=4)
    assert proposer.propose(other, 3) == [2, 3, 7]  # "9 1" generated by the first: its continuation
    assert proposer.propose(Seq([5, 1], prompt_len=2), 2) == [2, 3]  # "5 1" only in a prompt: "1" matches
    assert proposer.propose(Seq([8, 8, 5], prompt_len=3), 2) == []  # "5" was only ever a prompt token


def test_speculation_with_a_kv_budget_is_refused_at_config_time(tiny_model):
    from rollout.kv import KVBudgetConfig
    with pytest.raises(ValueError, match="speculative='ngram' with a KV budget"):
        EngineConfig(speculative="ngram", kv_budget=KVBudgetConfig(policy="h2o", budget_tokens=64))
    with pytest.raises(ValueError, match="speculative='eagle', expected one of off, ngram"):
        EngineConfig(speculative="eagle")


@pytest.mark.parametrize("pages,host_pages", [(14, 0), (14, 24)], ids=["recompute", "swap"])
def test_a_small_pool_preempts_and_speculation_still_decodes_plainly(tiny_model, plain, pages, host_pages):
    """A pool too small for every sequence at once: preemption (recompute, or swap to the host tier), and
    steps where the position pages do not fit (those sequences decode plainly); greedy output unchanged,
    integrity after every step, every page back at the end."""
    batch = [p + p[:30] for p in plain[0]]  # 54-60 tokens: growing past a 64-token page preempts
    want = generate(engine_for(tiny_model), batch)
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, pages, host_pages=host_pages, max_model_len=100,
                                                       check_every_step=True, speculative="ngram"))
    expected = {tuple(p): s.tokens for p, s in zip(batch, want)}
    engine.speculator.proposer = Oracle(expected)
    got = generate(engine, batch)
    assert [s.tokens for s in got] == [s.tokens for s in want]
    assert engine.scheduler.num_preemptions > 0 and engine.speculator.num_verifications > 0
    assert engine.pool.num_used == 0
    if host_pages:
        assert engine.scheduler.num_swapped_out > 0


def test_pause_resume_and_a_stop_inside_a_verification(tiny_model, plain):
    """A request paused mid-generation and resumed decodes on as if never paused; a stop token that lands
    inside a verified run of proposals ends the request there (the tokens after it are dropped)."""
    batch, want, _ = plain
    expected = {tuple(p): s.tokens for p, s in zip(batch, want)}
    stop_at = 7  # the 8th generated token of the first prompt becomes a stop token
    stop = want[0].tokens[stop_at]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, stop_token_ids=(stop,))
    engine = engine_for(tiny_model, "ngram")
    engine.speculator.proposer = Oracle(expected)
    first = engine.add_request(batch[0], params)
    second = engine.add_request(batch[1], GREEDY)
    outs = {}
    for _ in range(3):
        outs.update((o.request_id, o) for o in engine.step())
    engine.pause(second)
    for _ in range(3):
        outs.update((o.request_id, o) for o in engine.step())
    engine.resume(second)
    while len(outs) < 2:
        outs.update((o.request_id, o) for o in engine.step())
    cut = want[0].tokens.index(stop) + 1
    assert outs[first].samples[0].tokens == want[0].tokens[:cut] and outs[first].samples[0].finish_reason == "stop"
    assert outs[second].samples[0].tokens == want[1].tokens
    assert engine.pool.num_used == 0


def test_forks_speculate_on_their_own_and_stay_seeded(tiny_model):
    """n = 4 samples of one prompt (forked after its prefill) each speculate; two runs with one seed agree
    and every sample holds max_new_tokens tokens with their logprobs and versions."""
    prompt = prompts(1, seed=9)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=5, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = engine_for(tiny_model, "ngram")
        engine.speculator.proposer = RandomProposer(1)
        (out,) = engine.generate([prompt], params)
        runs.append([s.tokens for s in out.samples])
        assert all(len(s.tokens) == len(s.logprobs) == len(s.versions) == 12 for s in out.samples)
        assert engine.speculator.num_verifications > 0 and engine.pool.num_used == 0
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) > 1


def test_the_auto_throttle_admits_as_without_speculation_and_nothing_is_preempted_for_it(tiny_model, plain):
    """Full-length KV admission is the same with speculation (the k + 1 slots lie within the full length;
    position pages come from free pages for one step), and a pool sized for the requests preempts nobody
    with speculation on, its position pages taken only where they fit."""
    from rollout.dispatcher import Dispatcher, ThrottleConfig

    prompt = list(range(1, 30))
    params = SamplingParams(max_new_tokens=20, n=3)
    plain_pages = Dispatcher(engine_for(tiny_model), ThrottleConfig())._full_length_pages(prompt, params)
    engine = engine_for(tiny_model, "ngram", num_speculative_tokens=5)
    assert Dispatcher(engine, ThrottleConfig())._full_length_pages(prompt, params) == plain_pages
    batch, want, _ = plain
    tight = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 4 * len(batch) + 6, max_model_len=100,
                                                      check_every_step=True, speculative="ngram"))
    tight.speculator.proposer = Oracle({tuple(p): s.tokens for p, s in zip(batch, want)})
    assert [s.tokens for s in generate(tight, batch)] == [s.tokens for s in want]
    assert tight.scheduler.num_preemptions == 0 and tight.speculator.num_verifications > 0


def test_the_entropy_sum_counts_the_emitted_tokens_only(tiny_model, plain):
    """Greedy speculation with proposals always right and a stop inside a verified run: the engine's
    entropy sum over the emitted tokens equals plain decoding's (tokens dropped past the stop add nothing)."""
    batch, want, _ = plain
    stop = want[0].tokens[7]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, stop_token_ids=(stop,))
    sums = []
    for speculative in ("off", "ngram"):
        engine = engine_for(tiny_model, speculative)
        if engine.speculator is not None:
            engine.speculator.proposer = Oracle({tuple(p): s.tokens for p, s in zip(batch, want)})
        (out,) = engine.generate([batch[0]], params)
        sums.append((engine.entropy_sum, engine.num_generated, out.samples[0].tokens))
    assert sums[0][1:] == sums[1][1:] and sums[1][1] == want[0].tokens.index(stop) + 1
    assert sums[1][0] == pytest.approx(sums[0][0], rel=1e-5)


def test_the_length_that_pays_grows_with_acceptance_and_shrinks_with_the_batch(tiny_model):
    """`worth`: the proposals verified only while their expected saving exceeds their rows and a
    verification's bookkeeping; every proposal when rows are free."""
    spec = engine_for(tiny_model, "ngram", num_speculative_tokens=6).speculator
    assert [spec.worth(a, 16) for a in (0.1, 0.3, 0.6, 0.9, 0.99)] == sorted(spec.worth(a, 16) for a in
                                                                          (0.1, 0.3, 0.6, 0.9, 0.99))
    assert spec.worth(0.1, 16) == 0 and spec.worth(0.99, 1) == 6
    assert spec.worth(0.7, 1) > spec.worth(0.7, 64) and spec.worth(0.3, 256) == 0
    spec.row_cost = 0.0
    assert spec.worth(0.01, 256) == 6


def test_speculation_switches_itself_off_where_it_does_not_pay(tiny_model, plain):
    """Proposals always wrong: the adaptive rule stops verifying after a few rejections (then probes one
    proposal now and then), where verifying every proposal pays a verification every step; the output
    is plain decoding's either way."""
    batch, want, _ = plain
    expected = {tuple(p): s.tokens for p, s in zip(batch, want)}
    counts = {}
    for row_cost in (0.016, 0.0):
        engine = engine_for(tiny_model, "ngram", speculative_row_cost=row_cost)
        engine.speculator.proposer = Oracle(expected, wrong=True)
        got = generate(engine, batch)
        assert [s.tokens for s in got] == [s.tokens for s in want]
        counts[row_cost] = engine.speculator.num_verifications
    assert counts[0.0] >= 60 and counts[0.016] <= counts[0.0] // 4, counts  # measured: 94 and 13


class Silent(Proposer):
    """Never proposes: every step of a speculative engine runs as plain decoding's."""

    def propose(self, seq, k):
        return []


@pytest.mark.parametrize("how", ["no_proposal", "past_break_even"])
def test_a_step_where_nobody_proposes_leaves_every_kda_state_exactly_as_plain_decoding(tiny_model, plain, how):
    """No sequence verifies in the step (the proposer had nothing, or the batch is past the break-even and
    nobody is asked): the step is plain decoding's, bit for bit: every running sequence's KDA states,
    conv tails and MLA latents after each step equal the plain run's exactly, and so do the logprobs."""
    batch, want, plain_states = plain
    if how == "no_proposal":
        engine = engine_for(tiny_model, "ngram")
        engine.speculator.proposer = Silent()
    else:  # a row costs 1e6 fixed parts: not even proposals always kept pay, at any batch size
        engine = engine_for(tiny_model, "suffix", speculative_row_cost=1e6)
    checked: dict = {}
    got = generate(engine, batch, after_step=snapshots(checked, plain_states))
    assert [s.tokens for s in got] == [s.tokens for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]
    assert checked["checked"] > 0 and checked["worst"] == 0.0, checked  # exactly equal, every entry
    assert engine.speculator.num_verifications == 0
    if how == "past_break_even":  # every step gated: nobody asked, no tree fed
        assert engine.speculator.num_gated_steps == engine.num_steps
        assert not engine.speculator.proposer.trees


def test_suffix_proposals_of_a_later_turn_are_verified_and_only_verified_tokens_are_cached(tiny_model, plain):
    """The suffix proposer with the prefix cache: a next turn (the prompt and 5 of its tokens, the first
    turn's boundary marked) proposes from the first turn's texts; after every step every index entry is
    a recompute of a prefix of what plain decoding produced, and the output is plain decoding's."""
    batch, want, _ = plain
    engine = engine_for(tiny_model, "suffix", prefix=True)
    verify, checked = make_verifier(tiny_model, [p + s.tokens for p, s in zip(batch, want)])
    first = generate(engine, batch, after_step=verify, turns=True)
    trees = engine.speculator.proposer.trees  # every first-turn text whole but its last token (never stepped)
    assert sorted(len(t) for tree in trees.values() for t in tree.texts.values()) == [23] * len(batch)
    spec = engine.speculator
    proposed, accepted = spec.num_proposed, spec.num_accepted
    later = SamplingParams(temperature=0.0, max_new_tokens=19, ignore_eos=True)
    ids = [engine.add_request(p + s.tokens[:5], later, turn_boundaries=[len(p), len(p) + 5]) for p, s in zip(batch, want)]
    outs = {}
    while len(outs) < len(ids):
        outs.update((out.request_id, out) for out in engine.step())
        verify(engine)
    assert [s.tokens for s in first] == [s.tokens for s in want]
    assert [outs[i].samples[0].tokens for i in ids] == [s.tokens[5:] for s in want]
    kept = (spec.num_accepted - accepted) / (spec.num_proposed - proposed)
    assert kept == 1.0  # the first turn's text, greedy: each proposal is what plain decoding emits
    assert engine.cache.prefix.hit_tokens > 0 and checked["mla"] > 0 and checked["kda"] > 0


def test_sampled_tokens_follow_the_target_distribution_with_suffix_proposals(tiny_model):
    """600 forks of one prompt, three tokens at T=1, top-k 3, after an earlier epoch of the same prompt
    (its 64 samples in the suffix tree): the second token is a verification's whenever the tree proposes
    (every proposal verified). Counts of the 9 (t1, t2) outcomes vs p(t1) p(t2 | t1) by the model."""
    from tests.rollout.speculative.test_draft import CHI2_DF8_P9999, top3_chi2  # test_draft imports this module

    prompt = [12, 99, 7, 200, 31]
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 4000, max_model_len=64, max_num_seqs=600,
                                                       max_num_batched_tokens=2048, speculative="suffix",
                                                       speculative_row_cost=0.0))
    engine.generate([prompt], SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, n=64, seed=4, ignore_eos=True))
    before = engine.speculator.num_verifications
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, n=600, seed=5, ignore_eos=True)
    [out] = engine.generate([prompt], params)
    spec = engine.speculator
    assert spec.num_verifications - before >= 500 and 0.1 < spec.acceptance_rate < 0.95
    chi2, total, counts = top3_chi2(tiny_model, prompt, out.samples)
    assert total == 600  # every outcome is one of the 9 the target allows
    assert chi2 < CHI2_DF8_P9999, (chi2, counts)
