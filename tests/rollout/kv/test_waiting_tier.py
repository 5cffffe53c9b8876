"""Conversations waiting on their tools: their KV leaves a short device pool for the host tier in resume
order (the one resuming last first) and comes back by a prefetch issued when the next request queues,
before its admission; it continues exactly as it left (bytes, a recompute of every entry, the output)."""
import random
import time

import pytest
import torch

from rollout.engine import Engine, EngineConfig
from rollout.kv.prefix_cache import PrefixCacheConfig
from rollout.kv.resume_order import ResumeOrder
from rollout.sampling import SamplingParams
from tests.bounds import LOGPROB_TOL
from tests.rollout.kv.test_host_tier import identity
from tests.rollout.kv.test_prefix_cache import HB, make_verifier, uncached

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def entries_of(engine, tokens):
    """Index locations a hit on `tokens` reads (its MLA pages and last complete checkpoint), either tier."""
    cache = engine.cache.prefix
    chain = cache.hashes_of(tokens)
    n = cache._checkpointed(chain)
    assert n, "the conversation has no checkpoint in the cache"
    match = cache.index.match(chain[:n], n * cache.config.hash_block + 1, has_mla=True)
    return [loc for pages in match.mla_pages for loc in pages] + list(match.kda_pages)


def test_eviction_order_puts_the_soonest_to_resume_last():
    order = ResumeOrder()
    resume = {10: 5.0, 11: 1.0, 12: 9.0}  # page -> expected resume
    lru = [12, 3, 11, 4, 10, 5]
    assert order.eviction_order(lru, protected={4}, resume=resume) == [3, 5, 4, 12, 10, 11]
    # for a conversation resuming at 5.0: only what resumes strictly later may go
    assert order.eviction_order(lru, protected={4}, resume=resume, sooner_than=5.0) == [3, 5, 4, 12]


def test_a_conversation_evicted_while_its_tool_runs_resumes_with_its_exact_state(tiny_model):
    rng = random.Random(3)
    a = [rng.randrange(256) for _ in range(100)]
    b = [rng.randrange(256) for _ in range(230)]
    obs = [rng.randrange(256) for _ in range(9)]
    # one sequence at a time: the next turn queues behind the running one, its prefix has a step to come back
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 14, host_pages=40, max_model_len=300, max_num_seqs=1,
                                                       max_num_batched_tokens=256, check_every_step=True,
                                                       prefix_cache=PrefixCacheConfig(hash_block=HB, model_id="tiny")))
    (turn1,) = engine.generate([a], GREEDY)
    conv = a + turn1.samples[0].tokens
    long = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    plain = uncached(tiny_model)
    (expected,) = plain.generate([conv + obs], GREEDY)
    (b_out,) = plain.generate([b], long)
    engine.expect_resume(conv, at=time.monotonic() + 60.0)  # its tool runs about a minute
    before = {identity(engine, loc): engine.pool.read_pages([loc.page])[0].clone() for loc in entries_of(engine, conv)}
    assert before and all(loc.on_device for loc in entries_of(engine, conv))
    # another conversation fills the pool while the tool runs: the waiting one's KV goes to the host
    verify, checked = make_verifier(tiny_model, [conv + obs + expected.samples[0].tokens, b + b_out.samples[0].tokens])
    engine.add_request(b, long, request_id="b")
    while any(loc.on_device for loc in entries_of(engine, conv)):
        assert engine.has_unfinished, "the waiting conversation was never evicted"
        engine.step()
        verify(engine)
    assert not any(loc.on_device for loc in entries_of(engine, conv))
    for loc in entries_of(engine, conv):  # on the host: the bytes it left with, under the same keys
        assert torch.equal(engine.host.page_bytes_view(loc.page), before[identity(engine, loc)])
    # the tool returns while the other still runs: the next turn queues, its prefix is prefetched at once
    engine.add_request(conv + obs, GREEDY, request_id="a2", turn_boundaries=[len(conv) + len(obs)])
    engine.step()
    prefix = engine.cache.prefix
    assert prefix.prefetched_ahead == len(before)  # the whole bundle, ahead of its admission
    assert engine.cache.prefix.copies.unsettled_loads()  # its copy is in flight past the step (no one reads it yet)
    assert engine.requests["a2"].seqs[0].status.value == "waiting" and engine.pool.num_free <= 1
    verify(engine)
    done = {}
    while engine.has_unfinished:
        for out in engine.step():
            done[out.request_id] = out
        verify(engine)
    assert checked["host"] > 0 and checked["kda"] > 0  # entries on the host tier were checked too
    assert prefix.host_hit_tokens > 0 and prefix.deferred_admissions == 0
    assert done["b"].samples[0].tokens == b_out.samples[0].tokens
    assert done["a2"].samples[0].tokens == expected.samples[0].tokens
    assert done["a2"].samples[0].logprobs == pytest.approx(expected.samples[0].logprobs, **LOGPROB_TOL)
