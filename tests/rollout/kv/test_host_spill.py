"""The host KV pool time-multiplexed with the training states: its lease is returned
between rollouts, its live contents (parked partial rollouts, prefix entries) go to NVMe and come back
bit for bit; stale KV is dropped by policy, or reused and tagged with its version."""
import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.host_ledger import HostLedger
from memory.host_pool import HostPagePool
from memory.nvme_store import CorruptSpill, NvmeStore, NvmeStoreConfig
from memory.page_pool import OutOfPages
from rollout.engine import Engine, EngineConfig
from rollout.kv.host_spill import GROUP, slot_runs
from rollout.kv.page_loc import Loc
from rollout.kv.prefix_cache import PrefixCacheConfig
from rollout.kv.prefix_index import chain_hashes
from rollout.sampling import SamplingParams
from tests.rollout.kv.test_prefix_cache import GREEDY, HB, page_at, reference, sessions

STORE = NvmeStoreConfig(backend="buffered", chunk_bytes=1 << 20, fsync=False)
MiB = 1 << 20


def test_slot_runs_are_maximal_consecutive_ranges():
    assert slot_runs([]) == []
    assert slot_runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]


def test_a_suspended_pool_returns_its_lease_keeps_its_books_and_resumes_at_any_size_holding_them():
    ledger = HostLedger(budget_bytes=64 * 1024)
    pool = HostPagePool(1024, 8, ledger=ledger)
    a = pool.allocate(3, ("mla", 0))
    pool.buffer_rows(0, 3).fill_(7)
    pool.suspend()
    assert ledger.held("kv_pool") == 0 and pool.pool_bytes == 0 and pool.num_free == 0
    assert pool.used_slots() == a and pool.tag(a[0]) == ("mla", 0)
    with pytest.raises(RuntimeError, match="suspended"):
        pool.allocate(1, ("mla", 0))
    with pytest.raises(ValueError, match="slot 2 is in use"):
        pool.resume(2)
    pool.resume(20)  # larger than before: the DRAM the spill freed
    assert ledger.held("kv_pool") == 20 * 1024 and pool.num_pages == 20 and pool.num_free == 17
    assert pool.allocate(1, ("kda", 0)) == [3]  # the free list is the other slots, lowest first
    pool.check_integrity()
    ledger.check_integrity()
    unleased = HostPagePool.unleased(1024, ledger=ledger)
    assert unleased.is_suspended and unleased.num_pages == 0 and unleased.pool_bytes == 0
    with pytest.raises(Exception, match="kv_pool"):  # the ledger refuses what it does not have
        unleased.resume(100)
    assert unleased.is_suspended


def engine(model, ledger=None, host_pages=40, reuse_stale=False, prefix=True):
    cache = PrefixCacheConfig(hash_block=HB, model_id="tiny", reuse_stale=reuse_stale) if prefix else None
    cfg = EngineConfig.for_pages(model, 40, host_pages=host_pages, max_model_len=300, max_num_batched_tokens=64,
                                 check_every_step=True, prefix_cache=cache)
    return Engine(model, cfg, ledger=ledger)


def between_rollouts(eng, store, next_version, max_staleness=None, pages=40):
    """What the orchestrator does between two rollouts: sleep, host_out, (train), host_in, wake."""
    eng.sleep()
    paused = eng.scheduler.paused
    written = eng.cache.spill_host(store, paused, next_version=next_version, max_staleness=max_staleness)
    assert eng.host.is_suspended and eng.host.pool_bytes == 0
    read = eng.cache.restore_host(store, paused, pages)
    eng.wake()
    return written, read


def partial_rollout(model, tmp_path, spill: bool, max_staleness=None, pages=40, next_version=1):
    """Sample 3 forks, pause them midway, (round-trip the host pool through NVMe), finish them."""
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, n=3)
    ledger = HostLedger(budget_bytes=64 * MiB)
    eng = engine(model, ledger=ledger)
    rid = eng.add_request(list(range(40, 90)), params)
    for _ in range(6):
        eng.step()
    figures = {}
    if spill:
        eng.pause(rid)
        computed = [s.num_computed for s in eng.requests[rid].seqs]
        with NvmeStore(tmp_path / "kv", STORE) as store:
            figures["written"], figures["read"] = between_rollouts(eng, store, next_version=next_version,
                                                                   max_staleness=max_staleness, pages=pages)
            assert GROUP not in store.names()  # read back, then dropped
        figures["recomputed"] = [s.num_computed for s in eng.requests[rid].seqs] != computed
        eng.check_integrity()
        eng.resume(rid)
    done = []
    while not done:
        done = eng.step()
    assert ledger.held("kv_pool") == eng.host.pool_bytes
    return done[0], figures


def test_parked_rollouts_survive_the_nvme_round_trip_bit_for_bit(tiny_model, tmp_path):
    plain, _ = partial_rollout(tiny_model, tmp_path, spill=False)
    spilled, figures = partial_rollout(tiny_model, tmp_path, spill=True)
    assert figures["written"] == figures["read"] > 0 and not figures["recomputed"]
    assert [s.tokens for s in spilled.samples] == [s.tokens for s in plain.samples]
    assert [s.logprobs for s in spilled.samples] == [s.logprobs for s in plain.samples]  # bit for bit


def test_stale_or_unplaceable_parked_rollouts_are_recomputed(tiny_model, tmp_path):
    # KV computed under version 0, next rollout at version 2: older than max_staleness=1 allows
    out, figures = partial_rollout(tiny_model, tmp_path, spill=True, max_staleness=1, next_version=2)
    assert figures["written"] == 0 and figures["recomputed"] and len(out.samples) == 3
    # a lease too small for the kept slots drops them (documented), the rollouts go on by recompute
    out, figures = partial_rollout(tiny_model, tmp_path, spill=True, pages=1)
    assert figures["written"] > 0 == figures["read"] and figures["recomputed"] and len(out.samples) == 3


def test_a_corrupted_spill_is_refused(tiny_model, tmp_path):
    eng = engine(tiny_model)
    rid = eng.add_request(list(range(40, 90)), SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.pause(rid)
    eng.sleep()
    with NvmeStore(tmp_path / "kv", STORE) as store:
        assert eng.cache.spill_host(store, eng.scheduler.paused, next_version=1) > 0
        path = store.path(GROUP)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte inside the pages
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptSpill):
            eng.cache.restore_host(store, eng.scheduler.paused, 40)


def versioned_verifier(models: dict[int, torch.nn.Module], finals: list[list[int]]):
    """Checks every index entry against a recompute of its prefix under the weights of the version
    that computed it (`PrefixCache.key_version`), on whichever tier it lies. An entry computed by
    newer weights on top of a stale hit is tagged with the stale version and not recomputable by
    one model: those (`mixed`: keys registered since the last version change yet tagged older than
    it) are counted, not compared; call it once right after each weight update."""
    keys = {}
    for tokens in finals:
        for i, h in enumerate(chain_hashes(tokens, HB, b"tiny|v0"), start=1):
            keys.setdefault(h, (tuple(tokens), i))
    refs, checked = {}, {"entries": 0, "stale": 0, "host": 0, "mixed": 0}
    seen = {"version": None, "old_keys": set()}

    def verify(eng):
        cache, bt = eng.cache.prefix, eng.layout.block_tokens
        if seen["version"] != cache.version:  # new weights: what the index holds now predates them
            seen["version"], seen["old_keys"] = cache.version, set(cache.index.mla)
        for h, pages in cache.index.mla.items():
            tokens, i = keys[h]
            version = cache.key_version(h)
            if h not in seen["old_keys"] and version < cache.version:
                checked["mixed"] += 1
                continue
            if (tokens, version) not in refs:
                refs[tokens, version] = reference(models[version], list(tokens))
            mla, _ = refs[tokens, version]
            block = (i - 1) // (bt // HB)
            for g, layers in enumerate(eng.layout.mla_groups):
                for layer in layers:
                    where, page = page_at(eng, pages[g])
                    got, want = where.mla_view(layer)[page, :i * HB - block * bt], mla[layer][block * bt:i * HB]
                    assert ((got - want).norm() / want.norm()).item() <= 1e-5, (h.hex()[:8], version, layer)
            checked["entries"] += 1
            checked["stale"] += version < cache.version
            checked["host"] += not pages[0].on_device

    return verify, checked


def generate(eng, prompts, params, boundary):
    """Each prompt as one request whose first turn ends at `boundary` (the prefix the sleep keeps)."""
    ids = [eng.add_request(p, params, turn_boundaries=[boundary]) for p in prompts]
    outs = {}
    while eng.has_unfinished:
        outs.update((o.request_id, o) for o in eng.step())
    return [outs[i] for i in ids]


def test_stale_prefixes_hit_across_a_weight_update_and_an_nvme_round_trip(tiny_model, tmp_path):
    """Iteration 1 (version 1) fills the cache; the host pool goes to NVMe and back; the weights
    change (version 2); with reuse_stale, iteration 2's prompts hit the version-1 prefixes, count
    them as stale hits and tag what they sample with version 1. Every entry, on either tier, equals
    a recompute under the weights that produced it."""
    new = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    models = {1: tiny_model, 2: new}
    system = list(range(30, 30 + 3 * HB))
    prompts1 = [system + [100 + i] * 5 for i in range(3)]
    prompts2 = [system + [200 + i] * 5 for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    finals = prompts1 + prompts2
    verify, checked = versioned_verifier(models, finals)
    eng = engine(copy.deepcopy(tiny_model), reuse_stale=True)
    eng.weights_updated(1)
    out1 = generate(eng, prompts1, greedy, len(system))
    verify(eng)
    with NvmeStore(tmp_path / "kv", STORE) as store:
        written, read = between_rollouts(eng, store, next_version=2, max_staleness=1)
    assert written == read > 0
    verify(eng)
    assert checked["host"] > 0, "the version-1 entries should have crossed the round trip on the host"
    eng.load_weights(new.state_dict(), version=2)
    hits = eng.cache.prefix.stale_hit_tokens
    out2 = generate(eng, prompts2, greedy, len(system))
    verify(eng)
    assert eng.cache.prefix.stale_hit_tokens - hits >= 3 * HB
    assert all(v == 1 for o in out2 for v in o.samples[0].versions), "sampled on version-1 KV: tagged 1"
    assert all(v == 1 for o in out1 for v in o.samples[0].versions)
    assert checked["stale"] > 0
    # without reuse, nothing of version 1 survives the round trip
    eng = engine(copy.deepcopy(tiny_model))
    eng.weights_updated(1)
    generate(eng, prompts1, greedy, len(system))
    with NvmeStore(tmp_path / "kv2", STORE) as store:
        written, _ = between_rollouts(eng, store, next_version=2)
    assert written == 0 and eng.host.num_used == 0


def perturbed(model, seed=0, scale=0.01):
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    return new


def two_iterations(models, seed, pages, host, staleness, store_dir, verify=None):
    """Random sessions: iteration 1 (version 1) runs their first two turns, the host pool crosses
    the update on NVMe, iteration 2 (version 2) runs each session's third turn."""
    cfg = EngineConfig.for_pages(models[1], pages, host_pages=host, max_model_len=400, max_num_batched_tokens=40,
                                 check_every_step=True,
                                 prefix_cache=PrefixCacheConfig(hash_block=HB, model_id="tiny", reuse_stale=True))
    eng = Engine(copy.deepcopy(models[1]), cfg)
    eng.weights_updated(1)
    system, users = sessions(num_sessions=3, turns=3, seed=seed)
    history, finals, arrivals = [list(system) for _ in users], [], random.Random(seed + 1)

    def turn(t):
        ids, done = {}, {}
        for s in arrivals.sample(range(len(users)), len(users)):
            history[s] += users[s][t]
            ids[s] = eng.add_request(history[s], GREEDY, turn_boundaries=[len(history[s])])
        while any(rid not in done for rid in ids.values()):
            done.update((o.request_id, o) for o in eng.step())
            if verify is not None:
                verify(eng)
        for s in range(len(users)):
            history[s] += done[ids[s]].samples[0].tokens
            finals.append(list(history[s]))

    turn(0)
    turn(1)
    with NvmeStore(store_dir, STORE) as store:
        between_rollouts(eng, store, next_version=2, max_staleness=staleness, pages=host)
    eng.load_weights(models[2].state_dict(), version=2)
    if verify is not None:
        verify(eng)
    turn(2)
    return eng, finals


@pytest.mark.slow
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), pages=st.sampled_from([24, 40]), host=st.sampled_from([8, 40]),
       staleness=st.sampled_from([None, 1]))
def test_random_sessions_across_an_update_with_stale_reuse(dense_tiny_model, tmp_path_factory, seed, pages, host,
                                                           staleness):
    """The prefix property test across iterations: random sessions, a small device pool, a host pool
    crossing the update on NVMe; after every step every entry (either tier) equals a recompute
    under the weights that computed it; stale hits happen and are tagged."""
    models = {1: dense_tiny_model, 2: perturbed(dense_tiny_model, seed)}
    _, finals = two_iterations(models, seed, pages, host, staleness, tmp_path_factory.mktemp("dry"))
    verify, checked = versioned_verifier(models, finals)
    eng, _ = two_iterations(models, seed, pages, host, staleness, tmp_path_factory.mktemp("kv"), verify=verify)
    assert checked["entries"] > 0 and checked["host"] > 0
    assert checked["stale"] > 0, "version-1 entries should be checked under version-2 weights"
    if host == 40:  # room on the host for the turn-boundary bundles: the third turns hit them, stale
        assert eng.cache.prefix.stale_hit_tokens > 0
