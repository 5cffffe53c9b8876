"""The auto-throttle with the prefix cache on, on the real tiny engine: multi-turn conversations
whose contexts grow (the workload of benchmarks/throttle.py, small) run without preemptions while
the limit grows; pages only the prefix index holds do not hold the limit; and the resume-point
headroom in the admission projection is what keeps them from preempting (or losing their hits)."""
import torch

from rollout.dispatcher import Dispatcher, Submission, ThrottleConfig
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.request import RequestOutput
from rollout.sampling import SamplingParams

CONVERSATIONS, TURNS, USER_TOKENS, ANSWER_TOKENS = 8, 4, 24, 24
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=ANSWER_TOKENS, ignore_eos=True)


def cached_engine(model, num_pages: int = 32) -> Engine:
    return Engine(model, EngineConfig.for_pages(model, num_pages,
                                                max_model_len=TURNS * (USER_TOKENS + ANSWER_TOKENS) + 1,
                                                check_every_step=True,
                                                prefix_cache=PrefixCacheConfig(hash_block=16, model_id="tiny")))


def user_turns() -> dict[int, list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    return {c: [torch.randint(0, 256, (USER_TOKENS,), generator=gen).tolist() for _ in range(TURNS)]
            for c in range(CONVERSATIONS)}


def conversation(turns: list[list[int]]) -> Submission:
    """The first turn of a conversation: each answer + the next user turn is the next prompt."""

    def follow_up(out: RequestOutput) -> list[Submission]:
        turn = (len(out.prompt) + ANSWER_TOKENS) // (USER_TOKENS + ANSWER_TOKENS)
        if turn >= TURNS:
            return []
        return [Submission(out.prompt + out.samples[0].tokens + turns[turn], PARAMS, follow_up)]

    return Submission(list(turns[0]), PARAMS, follow_up)


def dispatch(engine: Engine, dispatcher: Dispatcher) -> list[RequestOutput]:
    for turns in user_turns().values():
        dispatcher.add(conversation(turns))
    outputs = dispatcher.run()
    assert len(outputs) == CONVERSATIONS * TURNS
    return outputs


def test_multi_turn_with_the_cache_on_grows_the_limit_without_preemptions(tiny_model):
    engine = cached_engine(tiny_model)
    dispatcher = Dispatcher(engine, ThrottleConfig(auto_start=2))
    outputs = dispatch(engine, dispatcher)
    assert engine.stats()["preemptions"] == 0
    assert max(dispatcher.auto.history) > 2
    assert engine.cache.prefix.hit_tokens > 0  # later turns resumed from the earlier ones
    # every page left is one only the index holds (nothing leaked by the run)
    assert engine.pool.num_used == engine.cache.num_evictable_pages
    last_turns = [o for o in outputs if len(o.prompt) > (TURNS - 1) * (USER_TOKENS + ANSWER_TOKENS)]
    plain = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 32, max_model_len=engine.config.max_model_len))
    reference = plain.generate([o.prompt for o in last_turns], PARAMS)
    assert [o.samples[0].tokens for o in last_turns] == [r.samples[0].tokens for r in reference]


def test_pages_only_the_index_holds_do_not_hold_the_limit(tiny_model):
    """A pool the cache has filled (over the watermark) with unrelated prefixes: the throttle's
    utilisation leaves those pages out, so the limit grows from its first update on. Counted as
    used (the engine's own `pool_utilization`), they would hold it at its start."""
    engine = cached_engine(tiny_model)
    config = ThrottleConfig(auto_start=2, high_watermark=0.75)
    one_token = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    for i in range(12):  # one at a time, distinct prompts: each leaves its prefix cached
        engine.generate([[200 + i] * 70], one_token)
    assert engine.cache.num_evictable_pages == engine.pool.num_used
    assert engine.stats()["pool_utilization"] >= config.high_watermark  # the engine's figure counts them
    dispatcher = Dispatcher(engine, config)
    assert dispatcher.signals()["pool_utilization"] == 0
    dispatch(engine, dispatcher)
    assert dispatcher.auto.history[0] > 2  # grew at the first step, over the full pool
    assert max(dispatcher.auto.history) > 2
    assert engine.stats()["preemptions"] == 0


def test_the_resume_headroom_keeps_growth_from_preempting(tiny_model):
    """The same workload admitted on full-length pages alone preempts or loses prefix hits: the
    running sequences' growth takes the pages the cache's checkpoints need."""
    engine = cached_engine(tiny_model)
    dispatch(engine, Dispatcher(engine, ThrottleConfig(auto_start=2)))
    bare = cached_engine(tiny_model)
    dispatch(bare, Dispatcher(bare, ThrottleConfig(auto_start=2, resume_headroom=False)))
    assert engine.stats()["preemptions"] == 0
    assert bare.stats()["preemptions"] > 0 or bare.cache.prefix.hit_tokens < engine.cache.prefix.hit_tokens
