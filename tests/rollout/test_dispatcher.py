"""The dispatcher: auto limit reacts to engine signals; multi-turn follow-ups; outputs unchanged."""
import pytest

from rollout.dispatcher import AutoLimit, Dispatcher, Submission, ThrottleConfig
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.sampling import SamplingParams
from tests.rollout.conftest import greedy_reference


def signals(preemptions=0, waiting=0, util=0.1):
    return {"preemptions": preemptions, "waiting": waiting, "pool_utilization": util}


def test_auto_limit_grows_holds_and_backs_off():
    auto = AutoLimit(ThrottleConfig(auto_start=8))
    assert auto.update(signals()) == 10  # room: +25%
    assert auto.update(signals(util=0.95)) == 10  # pool nearly full: hold
    assert auto.update(signals(waiting=3)) == 10  # engine queue not empty: hold
    assert auto.update(signals(preemptions=1)) == 5  # preemption: back off
    assert auto.update(signals(preemptions=1)) == 6  # no new preemption: grow again
    with pytest.raises(ValueError, match="max_concurrency=0"):
        ThrottleConfig(max_concurrency=0)


@pytest.mark.parametrize("max_concurrency", [None, 1, 3])
def test_multi_turn_follow_ups_complete_with_the_plain_models_tokens(tiny_model, max_concurrency):
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 24, max_model_len=96,
                                                       check_every_step=True))
    dispatcher = Dispatcher(engine, ThrottleConfig(max_concurrency=max_concurrency))
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    peak = []

    def follow_up(out):
        peak.append(len(dispatcher.in_flight))
        if len(out.prompt) > 40:
            return []
        return [Submission(out.prompt + out.samples[0].tokens + [7, 8, 9], params, follow_up)]

    for c in range(4):
        dispatcher.add(Submission([10 + c] * (3 + c), params, follow_up))
    outputs = dispatcher.run()
    # each conversation (prompt 3..6 tokens, +8 per turn) ran until its prompt passed 40 tokens: 6 turns
    assert len(outputs) == 4 * 6
    for out in outputs:
        assert out.samples[0].tokens == greedy_reference(tiny_model, out.prompt, 5)[0]
    if max_concurrency is not None:
        assert max(peak) < max_concurrency + 1
    assert engine.pool.num_free == engine.pool.num_pages


def cached_engine(model, num_pages: int) -> Engine:
    return Engine(model, EngineConfig.for_pages(model, num_pages, max_model_len=160,
                                                check_every_step=True,
                                                prefix_cache=PrefixCacheConfig(hash_block=16, model_id="tiny")))


def test_the_engine_reports_the_pages_only_the_prefix_cache_holds(tiny_model):
    """Finished requests leave their prefixes cached: the pool fills with pages only the index holds,
    counted by `cache.num_evictable_pages` (they still count in `pool_utilization`)."""
    engine = cached_engine(tiny_model, num_pages=24)
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    for i in range(12):  # one at a time, distinct prompts: each leaves its prefix cached
        engine.generate([[3 + i] * 70], params)
    stats = engine.stats()
    assert engine.pool.num_used >= 0.75 * engine.pool.num_pages  # the cache filled the pool
    assert engine.cache.num_evictable_pages == engine.pool.num_used
    assert stats["pool_utilization"] == engine.pool.num_used / engine.pool.num_pages


def test_with_the_prefix_cache_on_the_auto_limit_grows_without_preemptions(tiny_model):
    """Multi-turn conversations sharing a system prompt through the dispatcher's auto-throttle, cache
    on: the limit grows past its start and nothing is preempted."""
    engine = cached_engine(tiny_model, num_pages=48)
    dispatcher = Dispatcher(engine, ThrottleConfig(auto_start=2))
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    system = [5] * 32

    def follow_up(out):
        if len(out.prompt) > 90:
            return []
        return [Submission(out.prompt + out.samples[0].tokens + [9] * 12, params, follow_up)]

    for c in range(12):
        dispatcher.add(Submission(system + [20 + c] * 8, params, follow_up))
    outputs = dispatcher.run()
    assert len(outputs) == 12 * 5
    assert engine.cache.prefix.hit_tokens > 0
    assert engine.stats()["preemptions"] == 0
    assert max(dispatcher.auto.history) > 2


def test_on_step_follows_every_engine_step_and_the_end_while_should_stop_only_decides(tiny_model):
    """`on_step` is called after each engine step and once when the run ends; `should_stop` (checked
    before each step) ends the run early, the rest left in flight."""
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 24, max_model_len=96))
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    for stop_after in (None, 3):
        dispatcher, steps = Dispatcher(engine, ThrottleConfig(max_concurrency=2)), []
        for c in range(4):
            dispatcher.add(Submission([10 + c] * 4, params))
        start = engine.num_steps

        def should_stop() -> bool:
            return stop_after is not None and engine.num_steps - start >= stop_after

        outputs = dispatcher.run(on_step=lambda: steps.append(engine.num_steps - start), should_stop=should_stop)
        ran = engine.num_steps - start
        assert steps == [*range(1, ran + 1), ran], "after each step, then once at the end"
        if stop_after is None:
            assert len(outputs) == 4 and not dispatcher.in_flight
        else:
            assert ran == stop_after and dispatcher.in_flight
            in_flight, _ = dispatcher.clear()
            for request_id, _ in in_flight:
                engine.abort(request_id)
