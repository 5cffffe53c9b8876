"""The host KV pool as the prefix cache's second tier: write-back on eviction, prefetch
before reuse, KDA checkpoints moving with their MLA pages, sleep/wake parking paused sequences."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.host_ledger import HostBudgetExceeded, HostLedger
from memory.host_pool import HostPagePool
from memory.layout import CacheLayout
from memory.page_pool import PagePool
from rollout.engine import Engine, EngineConfig
from rollout.kv.page_loc import Loc
from rollout.kv.prefix_cache import PrefixCacheConfig
from rollout.sampling import SamplingParams
from tests.rollout.kv.test_prefix_cache import HB, make_verifier, run, uncached
from tests.bounds import LOGPROB_TOL

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def page_bytes(model) -> int:
    return CacheLayout.for_model(model.config).page_bytes


def engine_with_host(model, num_pages=40, host_pages=40, mode="write_back", budget=256, ledger=None):
    cfg = EngineConfig.for_pages(model, num_pages, host_pages=host_pages, max_model_len=300,
                                 max_num_batched_tokens=budget, check_every_step=True,
                                 prefix_cache=PrefixCacheConfig(hash_block=HB, model_id="tiny", host_mode=mode))
    return Engine(model, cfg, ledger=ledger)


def test_host_pool_round_trip_is_bit_identical_and_checks_groups(tiny_model):
    layout = CacheLayout.for_model(tiny_model.config)
    pool, host = PagePool(layout, 5), HostPagePool(layout.page_bytes, 3)
    pages = pool.allocate(2, ("kda", 1))
    pool.write_pages(pages, torch.randint(0, 256, (2, layout.page_bytes), dtype=torch.uint8))
    before = pool.read_pages(pages)
    slots = host.allocate(2, ("kda", 1))
    host.store(slots, pool, pages)
    back = pool.allocate(2, ("kda", 1))
    host.load(slots, pool, back)
    assert torch.equal(pool.read_pages(back), before)
    assert host.bytes_stored == host.bytes_loaded == 2 * layout.page_bytes
    other = pool.allocate(1, ("mla", 0))
    with pytest.raises(ValueError, match="same group"):
        host.load(slots[:1], pool, other)
    host.free(slots)
    with pytest.raises(ValueError, match="freed twice"):
        host.free(slots[:1])
    host.check_integrity()


def test_host_pool_leases_its_bytes_from_the_ledger(tiny_model):
    pb = page_bytes(tiny_model)
    ledger = HostLedger(budget_bytes=10 * pb)
    host = HostPagePool(pb, 8, ledger=ledger)
    assert ledger.held("kv_pool") == 8 * pb
    with pytest.raises(HostBudgetExceeded):
        HostPagePool(pb, 3, ledger=ledger, consumer="other")
    assert ledger.held("other") == 0  # refused before anything was allocated
    host.close()
    assert ledger.held() == 0


def identity(engine, location):
    """What an index location holds, independent of where: (its MLA keys, its checkpoint's key, group)."""
    index = engine.cache.prefix.index
    group = engine.pool.group_of_page(location.page) if location.on_device else engine.host.tag(location.page)
    return tuple(sorted(index.keys_of(location))), index.checkpoint_of(location), group


def _cached_then_evicted(model, mode="write_back"):
    """Generate A, record its cached pages' bytes, evict everything to the host tier."""
    engine = engine_with_host(model, mode=mode)
    rng = random.Random(1)
    a = [rng.randrange(256) for _ in range(100)]
    engine.generate([a], GREEDY)
    cache = engine.cache.prefix
    before = {identity(engine, Loc.device(p)): engine.pool.read_pages([p])[0].clone() for p in cache.lru}
    cache.evict(engine.pool.num_pages)
    assert not cache.lru and engine.pool.num_used == 0 and len(cache.host_tier.lru) == len(before)
    return engine, a, rng, before


def test_offload_then_prefetch_is_bit_identical_and_decodes_exactly(tiny_model):
    engine, a, rng, before = _cached_then_evicted(tiny_model)
    cache = engine.cache.prefix
    assert len(before) == 5  # two MLA pages + the last checkpoint in 3 KDA groups
    for slot in cache.host_tier.lru:  # on the host: the same bytes, under the same keys
        assert torch.equal(engine.host.page_bytes_view(slot), before[identity(engine, Loc.host(slot))])
    b = a + [rng.randrange(256) for _ in range(20)]
    (out,) = engine.generate([b], GREEDY)
    assert cache.pages_prefetched == 5 and cache.hit_tokens == 96
    restored = [p for p in cache.lru if identity(engine, Loc.device(p)) in before]
    assert len(restored) == 5
    for p in restored:  # back on the device: the same bytes again
        assert torch.equal(engine.pool.read_pages([p])[0], before[identity(engine, Loc.device(p))])
    (expected,) = uncached(tiny_model).generate([b], GREEDY)
    assert out.samples[0].tokens == expected.samples[0].tokens
    # the cached run computes the prompt in other chunks than the uncached one: logprobs within rounding
    assert out.samples[0].logprobs == pytest.approx(expected.samples[0].logprobs, **LOGPROB_TOL)


def test_write_through_copies_at_registration_write_back_only_on_eviction(tiny_model):
    wb, *_ = _cached_then_evicted(tiny_model, "write_back")
    wt, *_ = _cached_then_evicted(tiny_model, "write_through")
    assert wb.host.bytes_stored > 0 and wt.host.bytes_stored > wb.host.bytes_stored
    quiet = engine_with_host(tiny_model)  # nothing evicted: write-back copied nothing
    quiet.generate([[1, 2, 3] * 30], GREEDY)
    assert quiet.host.bytes_stored == 0 and quiet.cache.prefix.lru


def test_a_full_host_pool_drops_least_recently_used_bundles(tiny_model):
    engine = engine_with_host(tiny_model, num_pages=14, host_pages=6)
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(70)] for _ in range(5)]
    for p in prompts:
        engine.generate([p], GREEDY)
        engine.check_integrity()
    cache = engine.cache.prefix
    assert engine.host.num_used <= 6 and cache.pages_written_back > 6  # older bundles were dropped
    (out,) = engine.generate([prompts[-1] + [7, 8, 9]], GREEDY)  # the newest prefix is still cached somewhere
    assert cache.hit_tokens >= 64


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(5, 90), pages=st.sampled_from([24, 32]),
       host=st.sampled_from([8, 40]), mode=st.sampled_from(["write_back", "write_through"]))
def test_random_sessions_with_a_small_device_pool_and_a_host_pool(dense_tiny_model, seed, budget, pages, host,
                                                                  mode):
    """The prefix cache's property test with a second tier: every entry on either tier verified
    against a recompute after every step (check_every_step also checks that no KDA checkpoint sits
    on another tier than its MLA pages), and the output equal to no cache."""
    _, history, _ = run(dense_tiny_model, prefix=False, num_pages=pages, budget=budget, seed=seed)
    engine, cached, finals = run(dense_tiny_model, prefix=True, num_pages=pages, budget=budget, seed=seed,
                                 host_pages=host, host_mode=mode)
    assert cached == history
    verify, checked = make_verifier(dense_tiny_model, finals)
    run(dense_tiny_model, prefix=True, num_pages=pages, budget=budget, seed=seed, host_pages=host, host_mode=mode,
        verify=verify)
    assert checked["mla"] > 0


def test_host_entries_are_verified_and_hit(tiny_model):
    """A fixed small case of the property test where the host tier certainly serves hits."""
    _, history, _ = run(tiny_model, prefix=False, num_pages=24, budget=40)
    engine, cached, finals = run(tiny_model, prefix=True, num_pages=24, budget=40, host_pages=40)
    assert cached == history
    assert engine.cache.prefix.pages_prefetched > 0 and engine.cache.prefix.pages_written_back > 0
    verify, checked = make_verifier(tiny_model, finals)
    run(tiny_model, prefix=True, num_pages=24, budget=40, host_pages=40, verify=verify)
    assert checked["host"] > 0


def test_sleep_parks_paused_sequences_on_the_host_and_wake_restores_them(tiny_model):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, n=3)
    prompt = list(range(40, 90))

    def generate(sleep_midway: bool):
        engine = engine_with_host(tiny_model, budget=64)
        rid = engine.add_request(prompt, params)
        for _ in range(6):
            engine.step()
        if sleep_midway:
            engine.pause(rid)
            computed = [s.num_computed for s in engine.requests[rid].seqs]
            engine.sleep()
            assert engine.pool.num_used == 0 and engine.host.num_used > 0
            engine.wake()
            assert [s.num_computed for s in engine.requests[rid].seqs] == computed  # nothing recomputed
            engine.check_integrity()
            engine.resume(rid)
        done = []
        while not done:
            done = engine.step()
        return done[0], engine

    plain, _ = generate(False)
    parked, engine = generate(True)
    assert [s.tokens for s in parked.samples] == [s.tokens for s in plain.samples]
    assert [s.logprobs for s in parked.samples] == [s.logprobs for s in plain.samples]  # bit for bit
    assert engine.host.num_used == 0 or engine.cache.prefix.host_tier.lru
