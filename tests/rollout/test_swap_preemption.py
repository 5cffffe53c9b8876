"""Preemption by swapping to the host tier: a victim's pages go to host slots and come back bit for
bit when it is rescheduled (`num_computed` kept); with too little host room it is recomputed.

Bit-exact comparisons need the same batches step for step: a CPU matmul's row depends on how many
rows share it (M=1..3 vs 40 differ by ~1e-5 here), so two engines whose pools batch differently
agree on tokens and on logprobs to 1e-5, not to the bit. The pause scenario below keeps the batches
equal in both engines, and there the swapped engine is bit-identical to one that never preempts.
"""
import pytest
import torch

from rollout.engine import Engine, EngineConfig
from rollout.kv import KVBudgetConfig, PrefixCacheConfig
from rollout.request import SeqStatus
from rollout.sampling import SamplingParams
from tests.rollout.conftest import greedy_reference


def prompts(lens: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]


def engine(model, num_pages: int, host_pages: int = 0, **kw) -> Engine:
    return Engine(model, EngineConfig.for_pages(model, num_pages, host_pages=host_pages, max_model_len=256,
                                                max_num_batched_tokens=512, check_every_step=True, **kw))


def check(eng: Engine) -> None:
    """Every manager's invariants (the engine's own check runs too: check_every_step)."""
    eng.check_integrity()
    if eng.host is not None:
        eng.cache.host_tier.check_integrity()
        eng.host.check_integrity()


def step(eng: Engine, outs: dict) -> None:
    outs.update((o.request_id, o) for o in eng.step())
    check(eng)


def samples(outs: dict, ids: list[str]) -> list[tuple[list[int], list[float]]]:
    return [(s.tokens, s.logprobs) for r in ids for s in outs[r].samples]


def pause_scenario(eng: Engine) -> tuple[list, Engine]:
    """P (2 seeded forks) and G (greedy) run together; P is paused holding its pages; G runs alone
    (in a small pool G outgrows it: G, the only candidate, is preempted and waits); P is resumed and
    both finish. Batches: [P, G] / [G, P1, P2], then G alone, then P alone, then G alone if it
    waited: each sequence sees the same batch mates in a pool of any size."""
    p_prompt, g_prompt = prompts([70, 50], seed=3)
    p = eng.add_request(p_prompt, SamplingParams(temperature=1.0, top_p=0.9, n=2, seed=5, max_new_tokens=30,
                                                 ignore_eos=True))
    g = eng.add_request(g_prompt, SamplingParams(temperature=0.0, max_new_tokens=150, ignore_eos=True))
    outs: dict = {}
    for _ in range(8):
        step(eng, outs)
    eng.pause(p)
    for _ in range(200):
        if g in outs or eng.cache.is_swapped(eng.requests[g].seqs[0]) or not eng.scheduler.running:
            break
        step(eng, outs)
    eng.resume(p)
    while eng.has_unfinished:
        step(eng, outs)
    return samples(outs, [p, g]), eng


def test_a_swapped_sequence_comes_back_bit_identical(tiny_model):
    reference, big = pause_scenario(engine(tiny_model, num_pages=200))
    assert big.stats()["preemptions"] == 0
    got, eng = pause_scenario(engine(tiny_model, num_pages=14, host_pages=20))
    stats = eng.stats()
    assert stats["swapped_out"] == stats["swapped_in"] == stats["preemptions"] >= 1 and stats["recomputed"] == 0
    assert got == reference  # tokens and logprobs, to the bit
    assert eng.host.num_free == eng.host.num_pages and stats["swapped_pages"] == 0
    assert len(eng.host.copier.unsettled) <= 1  # no prefix cache, no flush: waited copies do not pile up
    assert eng.pool.num_free == eng.pool.num_pages


def test_a_swapped_sequence_keeps_its_computed_tokens(tiny_model):
    eng = engine(tiny_model, num_pages=14, host_pages=20)
    p_prompt, g_prompt = prompts([70, 50], seed=3)
    p = eng.add_request(p_prompt, SamplingParams(temperature=0.0, n=2, max_new_tokens=30, ignore_eos=True))
    g = eng.add_request(g_prompt, SamplingParams(temperature=0.0, max_new_tokens=150, ignore_eos=True))
    for _ in range(8):
        eng.step()
    eng.pause(p)
    (seq,) = eng.requests[g].seqs
    while not eng.cache.is_swapped(seq):
        eng.step()
    # Preempted at a page boundary: it holds nothing on the device, its computed tokens on the host.
    assert seq.status is SeqStatus.WAITING and not seq.holds_pages and seq.num_computed == seq.num_tokens - 1
    slots = eng.cache.host_tier.num_swapped_pages(seq)
    assert slots == eng.cache.num_kda_groups + eng.layout.mla_pages_for(seq.num_computed)
    assert eng.stats()["swapped_pages"] == slots
    eng.abort(g)  # a swapped sequence that goes frees its slots
    assert eng.host.num_free == eng.host.num_pages
    check(eng)


def test_a_host_pool_too_small_recomputes_the_victim(tiny_model):
    reference, _ = pause_scenario(engine(tiny_model, num_pages=200))
    got, eng = pause_scenario(engine(tiny_model, num_pages=14, host_pages=2))
    stats = eng.stats()
    assert stats["recomputed"] == stats["preemptions"] >= 1 and stats["swapped_out"] == 0
    assert_close(got, reference)  # recomputed in other chunks: the same tokens, logprobs to 1e-5


def assert_close(got: list, want: list) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        a, b = torch.tensor(a), torch.tensor(b)
        assert ((a - b).norm() / b.norm()).item() <= 1e-5


def batch(eng: Engine) -> tuple[list, Engine]:
    """Greedy and seeded stochastic requests, some forked, generated together."""
    ps = prompts([30, 45, 20, 60, 38, 50, 25, 41], seed=0)
    params = [SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=20, max_new_tokens=40, seed=10 + i, n=2, ignore_eos=True)
              for i in range(len(ps))]
    ids = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    outs: dict = {}
    while eng.has_unfinished:
        step(eng, outs)
    return samples(outs, ids), eng


def test_a_small_pool_swapping_generates_what_a_large_pool_does(tiny_model):
    reference, big = batch(engine(tiny_model, num_pages=400))
    assert big.stats()["preemptions"] == 0
    got, eng = batch(engine(tiny_model, num_pages=14, host_pages=40))
    stats = eng.stats()
    assert stats["swapped_out"] >= 1 and stats["swapped_in"] == stats["swapped_out"]
    assert stats["preemptions"] == stats["swapped_out"] + stats["recomputed"]
    assert_close(got, reference)
    assert eng.host.num_free == eng.host.num_pages and eng.pool.num_free == eng.pool.num_pages
    small, eng = batch(engine(tiny_model, num_pages=14, host_pages=3))  # no victim fits: recomputed
    assert eng.stats()["recomputed"] >= 1 and eng.stats()["swapped_out"] == 0
    assert_close(small, reference)


def test_swapping_with_the_prefix_cache_keeps_its_entries_consistent(tiny_model):
    reference, _ = batch(engine(tiny_model, num_pages=400))
    cfg = PrefixCacheConfig(hash_block=16, model_id="tiny")
    got, eng = batch(engine(tiny_model, num_pages=16, host_pages=40, prefix_cache=cfg, block_tokens=32))
    assert eng.stats()["swapped_out"] >= 1
    assert_close(got, reference)
    assert eng.cache.host_tier.num_swapped_slots == 0


def forks_swapped_while_paused(model, swap: bool, kv_budget: KVBudgetConfig | None,
                               sleep: bool = False) -> tuple[list, Engine]:
    """A request of 2 seeded forks runs alone, is paused, (swapped out through the cache manager's
    `preempt`,) (the engine sleeps and wakes,) resumed, and runs to the end: the same batches with
    or without the swap."""
    eng = engine(model, num_pages=40, host_pages=20, kv_budget=kv_budget, block_tokens=16)
    (prompt,) = prompts([50], seed=4)
    r = eng.add_request(prompt, SamplingParams(temperature=1.0, top_p=0.9, n=2, seed=9, max_new_tokens=60,
                                               ignore_eos=True))
    outs: dict = {}
    for _ in range(25):
        step(eng, outs)
    eng.pause(r)
    forks = eng.requests[r].seqs
    if swap:
        shared = set(forks[0].mla_pages[0]) & set(forks[1].mla_pages[0])
        assert shared, "the forks were meant to share their prompt's pages"
        states = [(s.num_computed, s.kv) for s in forks]
        assert [eng.cache.preempt(s) for s in forks] == ["swap", "swap"]
        assert not any(s.holds_pages for s in forks) and [(s.num_computed, s.kv) for s in forks] == states
        if kv_budget is not None:
            assert all(s.kv_pruned for s in forks), "the forks were meant to have evicted tokens before the swap"
        check(eng)
    if sleep:  # paused forks on the device are parked, swapped ones become parked as they are
        eng.sleep()
        assert eng.cache.num_parked_pages > 0 and not eng.cache.host_tier.swapped
        eng.wake()
        assert all(s.holds_pages for s in forks)
    eng.resume(r)
    while eng.has_unfinished:
        step(eng, outs)
    assert eng.host.num_free == eng.host.num_pages
    return samples(outs, [r]), eng


@pytest.mark.parametrize("kv_budget", [None, KVBudgetConfig(budget_tokens=48, policy="h2o", sink_tokens=4,
                                                               recent_tokens=16)], ids=["full_kv", "h2o"])
def test_forks_sharing_pages_and_their_evictor_state_survive_a_swap(tiny_model, kv_budget):
    """Every fork's pages are stored (a shared page once per fork) and come back private; with a KV
    budget the compacted slots and `seq.kv` (positions, scores) carry on where they were."""
    reference, _ = forks_swapped_while_paused(tiny_model, swap=False, kv_budget=kv_budget)
    got, eng = forks_swapped_while_paused(tiny_model, swap=True, kv_budget=kv_budget)
    assert got == reference
    assert eng.stats()["swapped_in"] == 2 and eng.cache.host_tier.pages_swapped_in == \
        eng.cache.host_tier.pages_swapped_out


@pytest.mark.parametrize("num_pages", [24, 16], ids=["prefetches", "swaps"])
def test_no_sequence_reads_a_page_before_its_host_copy_is_waited_on(tiny_model, num_pages):
    """Multi-turn sessions over a small pool with a host tier (24 pages: write-backs and prefetched
    hits; 16: a swap): after every step no sequence holds a page whose load no device stream waited
    on; a prefetch issued right before a forward stays in flight through it (the overlap), read a
    step later."""
    from tests.rollout.kv.test_prefix_cache import run
    seen = {"in_flight": 0}

    def ordering(eng: Engine) -> None:
        unsettled = eng.cache.host_tier.copies.unsettled_loads()
        held = {p for r in eng.requests.values() for s in r.seqs
                for p in s.kda_pages + [q for group in s.mla_pages for q in group]}
        assert not held & unsettled, f"pages {sorted(held & unsettled)} are read before their copy is waited on"
        seen["in_flight"] += bool(unsettled)
        check(eng)

    _, plain, _ = run(tiny_model, prefix=False, num_pages=num_pages, budget=40)
    eng, cached, _ = run(tiny_model, prefix=True, num_pages=num_pages, budget=40, host_pages=40, verify=ordering)
    assert cached == plain
    if num_pages == 24:
        assert eng.cache.prefix.pages_prefetched > 0 and seen["in_flight"] > 0
    else:
        assert eng.stats()["swapped_in"] == eng.stats()["swapped_out"] >= 1


def test_swapped_forks_are_parked_over_a_sleep_and_come_back_bit_identical(tiny_model):
    reference, _ = forks_swapped_while_paused(tiny_model, swap=False, kv_budget=None, sleep=True)
    got, _ = forks_swapped_while_paused(tiny_model, swap=True, kv_budget=None, sleep=True)
    assert got == reference


def test_a_sleep_recomputes_waiting_swapped_sequences_and_frees_their_slots(tiny_model):
    eng = engine(tiny_model, num_pages=14, host_pages=20)
    p_prompt, g_prompt = prompts([70, 50], seed=3)
    p = eng.add_request(p_prompt, SamplingParams(temperature=0.0, n=2, max_new_tokens=30, ignore_eos=True))
    g = eng.add_request(g_prompt, SamplingParams(temperature=0.0, max_new_tokens=150, ignore_eos=True))
    for _ in range(8):
        eng.step()
    eng.pause(p)
    (seq,) = eng.requests[g].seqs
    while not eng.cache.is_swapped(seq):
        eng.step()
    eng.sleep()  # like the running ones, it restarts from token 0; the paused forks are parked
    assert not eng.cache.is_swapped(seq) and seq.num_computed == 0 and eng.cache.host_tier.num_swapped_slots == 0
    eng.wake()
    eng.resume(p)
    outs: dict = {}
    while eng.has_unfinished:
        step(eng, outs)
    assert outs[g].samples[0].tokens == greedy_reference(tiny_model, g_prompt, 150)[0]
    assert eng.host.num_free == eng.host.num_pages
