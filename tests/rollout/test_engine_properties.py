"""Property test of the engine's cache machinery: random prompts, budgets, pool sizes, aborts and
pauses; checked by recomputation with the plain model, never by trusting the cache."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams
from tests.rollout.conftest import greedy_reference


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_workloads_match_the_plain_model(tiny_model, data):
    num = data.draw(st.integers(1, 6), label="num_requests")
    prompts = [data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=140), label=f"prompt{i}")
               for i in range(num)]
    new = [data.draw(st.integers(1, 6), label=f"new{i}") for i in range(num)]
    budget = data.draw(st.integers(1, 96), label="budget")
    # at least one max-length sequence must fit; beyond that, any pool size (preemption covers the rest)
    num_pages = data.draw(st.integers(3 + 3, 40), label="num_pages")
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, num_pages, max_model_len=150,
                                                       max_num_batched_tokens=budget, check_every_step=True))
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
           for p, n in zip(prompts, new)]
    aborted = set(data.draw(st.sets(st.sampled_from(ids), max_size=max(0, num - 1)), label="aborted"))
    paused = data.draw(st.sets(st.sampled_from(ids), max_size=2), label="paused") - aborted
    outputs, step = {}, 0
    while engine.has_unfinished or any(r in engine.requests for r in paused):
        if step == 2:
            for r in aborted & set(engine.requests):
                engine.abort(r)
            for r in paused & set(engine.requests):
                engine.pause(r)
        if step == 5:
            for r in paused & set(engine.requests):
                engine.resume(r)
        outputs.update({o.request_id: o for o in engine.step()})
        step += 1
        assert step < 2000, "engine made no progress"
    assert engine.pool.num_free == engine.pool.num_pages
    for rid, prompt, n in zip(ids, prompts, new):
        if rid in aborted and rid not in outputs:
            continue
        assert outputs[rid].samples[0].tokens == greedy_reference(tiny_model, prompt, n)[0], rid
