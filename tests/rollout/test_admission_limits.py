"""Admission limits of the engine: a context it can never run is refused with its numbers and
changes nothing; what it admits runs even in the smallest pool it accepts; a prompt longer than
the step budget is prefilled in chunks."""
import math

import pytest

from rollout import ContextTooLong
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams
from tests.rollout.conftest import greedy_reference

GREEDY = dict(temperature=0.0, ignore_eos=True)


def snapshot(engine: Engine) -> dict:
    """What a refused request must leave as it was."""
    sched = engine.scheduler
    return {"free": engine.pool.num_free, "refcounts": [engine.pool.refcount(p) for p in range(engine.pool.num_pages)],
            "requests": {r: [(s.seq_id, s.status, s.num_computed, len(s.tokens)) for s in req.seqs]
                         for r, req in engine.requests.items()},
            "queues": ([s.seq_id for s in sched.waiting], [s.seq_id for s in sched.running],
                       [s.seq_id for s in sched.paused]),
            "stats": engine.stats(), "computed": engine.num_computed_tokens}


def test_a_prompt_over_max_model_len_is_refused_with_its_numbers_and_changes_nothing(tiny_model):
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 16, max_model_len=40,
                                                       check_every_step=True))
    layout = engine.layout
    running = engine.add_request(list(range(1, 31)), SamplingParams(max_new_tokens=5, **GREEDY))
    paused = engine.add_request(list(range(2, 12)), SamplingParams(max_new_tokens=3, n=2, **GREEDY))
    engine.step()
    engine.pause(paused)
    before = snapshot(engine)
    assert before["free"] < engine.pool.num_pages, "the running requests should hold pages"

    for prompt_len in (40, 41):  # == max_model_len leaves no room for a generated token; > is plainly over
        with pytest.raises(ContextTooLong) as err:
            engine.add_request(list(range(prompt_len)), SamplingParams(max_new_tokens=1))
        needed = len(layout.kda_groups) + len(layout.mla_groups) * math.ceil((prompt_len + 1) / layout.block_tokens)
        message = str(err.value)
        for words in (f"prompt of {prompt_len} tokens", "max_model_len=40", f"{prompt_len + 1} tokens",
                      f"{needed} pages", "the pool has 16 pages", "engine.max_model_len", f">= {prompt_len + 1}"):
            assert words in message, message
        assert "engine.pool_mb" not in message  # these pages fit the pool: only the length limit is in the way
        e = err.value
        assert isinstance(e, ValueError)
        assert (e.num_tokens, e.max_model_len, e.pages_needed, e.pool_pages) == (prompt_len, 40, needed, 16)
        assert snapshot(engine) == before
        engine.check_integrity()

    with pytest.raises(ValueError, match="turn_boundaries"):  # refused after the length check passed: still no id
        engine.add_request([1, 2, 3], turn_boundaries=[7])
    assert snapshot(engine) == before
    third = engine.add_request(list(range(3, 8)), SamplingParams(max_new_tokens=4, **GREEDY))
    assert (running, paused, third) == ("0", "1", "2"), "a refused request must not consume a request id"

    engine.resume(paused)
    outputs = {}
    while engine.has_unfinished:
        outputs |= {o.request_id: o for o in engine.step()}
    assert outputs[running].samples[0].tokens == greedy_reference(tiny_model, list(range(1, 31)), 5)[0]
    assert outputs[third].samples[0].tokens == greedy_reference(tiny_model, list(range(3, 8)), 4)[0]
    assert engine.pool.num_free == engine.pool.num_pages


def test_a_prompt_the_pool_could_not_hold_names_the_pool_that_would(tiny_model):
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 16, max_model_len=40))
    layout, prompt_len = engine.layout, 5000
    needed = len(layout.kda_groups) + len(layout.mla_groups) * math.ceil((prompt_len + 1) / layout.block_tokens)
    mb = math.ceil(needed * layout.page_bytes / (1 << 20))
    assert needed > 16 and layout.pool_mb_for(needed) == mb
    with pytest.raises(ContextTooLong) as err:
        engine.check_context(prompt_len)
    message = str(err.value)
    for words in (f"prompt of {prompt_len} tokens", f"{needed} pages", "the pool has 16 pages",
                  f">= {prompt_len + 1}", f"pool to >= {mb} MiB (engine.pool_mb)"):
        assert words in message, message
    # the figure is the smallest pool, in whole MiB, an engine of that max_model_len is built with
    Engine(tiny_model, EngineConfig(pool_mb=mb, max_model_len=prompt_len + 1))
    with pytest.raises(ValueError, match=f"cannot hold one sequence of {prompt_len + 1} tokens"):
        Engine(tiny_model, EngineConfig(pool_mb=mb - 1, max_model_len=prompt_len + 1))


@pytest.mark.parametrize("max_model_len", [17, 24])
def test_what_the_smallest_accepted_pool_admits_runs_to_max_model_len(tiny_model, max_model_len):
    """The engine refuses only by length: a pool of exactly one max_model_len sequence runs a
    forked request whose samples grow to max_model_len (forks wait their turn, nothing is refused)."""
    cfg = dict(max_model_len=max_model_len, block_tokens=8, check_every_step=True)
    probe = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 64, **cfg))
    pages = probe.cache.pages_for_tokens(max_model_len)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        Engine(tiny_model, EngineConfig.for_pages(tiny_model, pages - 1, **cfg))
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, pages, **cfg))
    prompt = list(range(5, 5 + max_model_len - 6))
    out = engine.generate([prompt], SamplingParams(max_new_tokens=100, n=2, **GREEDY))[0]
    reference = greedy_reference(tiny_model, prompt, 6)[0]
    assert [s.tokens for s in out.samples] == [reference, reference]
    assert [s.finish_reason for s in out.samples] == ["length", "length"]
    assert engine.pool.num_free == pages
    assert not engine.requests and not engine.scheduler.has_work


def test_a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(tiny_model):
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 32, max_model_len=128, max_num_batched_tokens=16,
                                                       check_every_step=True))
    prompt = list(range(7, 57))  # 50 tokens > 16
    engine.add_request(prompt, SamplingParams(max_new_tokens=4, **GREEDY))
    per_step, outputs = [], []
    while engine.has_unfinished:
        before = engine.num_computed_tokens
        outputs += engine.step()
        per_step.append(engine.num_computed_tokens - before)
    assert per_step == [16, 16, 16, 2, 1, 1, 1]  # 50 prompt tokens in chunks of the budget, then decode
    assert outputs[0].samples[0].tokens == greedy_reference(tiny_model, prompt, 4)[0]
