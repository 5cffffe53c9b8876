"""The engine against the plain model: continuous batching, chunked prefill, preemption, forks."""
import pytest
import torch

from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams
from tests.rollout.conftest import greedy_reference


def make_prompts(num: int, seed: int, lo: int = 1, hi: int = 150) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (num,), generator=gen).tolist()
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]


def test_greedy_batch_with_chunked_prefill_and_preemption_equals_plain_model(tiny_model):
    prompts = make_prompts(32, seed=0)
    num_new = 12
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 24, max_model_len=256, max_num_batched_tokens=48,
                                                       check_every_step=True))
    assert max(map(len, prompts)) > 48  # prompts longer than a step's budget: chunked prefill
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=num_new, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for all 32 at once"
    stats = engine.stats()
    assert stats["preemptions"] == engine.scheduler.num_preemptions and stats["pool_pages_used"] == 0
    assert stats["running"] == stats["waiting"] == 0 and 0 < stats["peak_pages_used"] <= 24
    assert engine.pool.num_free == engine.pool.num_pages and not engine.requests
    engine.check_integrity()
    for prompt, out in zip(prompts, outputs):
        expected_tokens, expected_logprobs = greedy_reference(tiny_model, prompt, num_new)
        (sample,) = out.samples
        assert sample.tokens == expected_tokens
        got, want = torch.tensor(sample.logprobs), torch.tensor(expected_logprobs)
        assert ((got - want).norm() / want.norm()).item() <= 1e-5
        assert sample.finish_reason == "length" and sample.versions == [0] * num_new


def test_parallel_sampling_shares_prompt_pages_and_matches_independent_requests(tiny_model):
    prompt = make_prompts(1, seed=1, lo=2000, hi=2001)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=123, n=8, ignore_eos=True)
    # A budget that admits all 8 independent prompts in one step, so both runs hold 8 live samples.
    cfg = EngineConfig.for_pages(tiny_model, 400, max_model_len=2100, max_num_batched_tokens=16384,
                                 check_every_step=True)
    forked = Engine(tiny_model, cfg)
    (out,) = forked.generate([prompt], params)
    independent = Engine(tiny_model, cfg)
    singles = independent.generate([prompt] * 8, [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8,
                                                                 seed=123 + i, ignore_eos=True) for i in range(8)])
    assert [s.tokens for s in out.samples] == [o.samples[0].tokens for o in singles]
    assert len({tuple(s.tokens) for s in out.samples}) > 1  # the forks really sample differently
    bt = forked.layout.block_tokens
    prompt_pages = -(-len(prompt) // bt)
    kda = forked.cache.num_kda_groups
    # independent: 8 private copies of everything; forked: the prompt's pages once, + per extra fork
    # its KDA state pages and a copy of the partially filled tail page
    assert independent.peak_pages_used == 8 * (prompt_pages + kda)
    assert forked.peak_pages_used == prompt_pages + kda + 7 * (kda + 1)
    print(f"pages: forked {forked.peak_pages_used} vs independent {independent.peak_pages_used}; MLA block-tokens "
          f"{(prompt_pages + 7) * bt} vs {8 * prompt_pages * bt}")
    assert forked.pool.num_free == forked.pool.num_pages


def test_aborting_one_fork_request_leaves_others_running(tiny_model):
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 64, max_model_len=256,
                                                       check_every_step=True))
    a = engine.add_request(list(range(40)), SamplingParams(temperature=1.0, n=4, max_new_tokens=20, seed=5,
                                                            ignore_eos=True))
    b = engine.add_request(list(range(30)), SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort(a)
    done = []
    while engine.has_unfinished:
        done += engine.step()
    assert [o.request_id for o in done] == [b]
    assert done[0].samples[0].tokens == greedy_reference(tiny_model, list(range(30)), 6)[0]
    assert engine.pool.num_free == engine.pool.num_pages


def test_bad_requests_are_rejected_and_the_engine_keeps_serving(tiny_model):
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 32, max_model_len=64))
    good = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="prompt of 64 tokens does not fit max_model_len=64"):
        engine.add_request(list(range(64)))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"prompt token ids \[300\] out of range \[0, 259\)"):
        engine.add_request([1, 300])
    for bad, message in [(dict(temperature=-1.0), "temperature=-1.0"), (dict(top_p=0.0), "top_p=0.0"),
                         (dict(top_k=-2), "top_k=-2"), (dict(max_new_tokens=0), "max_new_tokens=0"),
                         (dict(n=0), "n=0")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request([1, 2], SamplingParams(**bad))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], request_id=good)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    assert [o.request_id for o in outputs] == [good] and len(outputs[0].samples[0].tokens) == 4


def test_generation_stops_at_max_model_len_and_eos(tiny_model):
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 32, max_model_len=20))
    (out,) = engine.generate([list(range(15))], SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True))
    assert len(out.samples[0].tokens) == 5 and out.samples[0].finish_reason == "length"
    first = greedy_reference(tiny_model, [7, 8, 9], 1)[0][0]
    (out,) = engine.generate([[7, 8, 9]], SamplingParams(temperature=0.0, stop_token_ids=(first,)))
    assert out.samples[0].tokens == [first] and out.samples[0].finish_reason == "stop"


def test_stop_strings_end_generation_at_the_token_that_completes_them(tiny_model):
    letters = "abcdefghij"  # a toy detokenizer: id -> one letter, so the greedy text is known exactly

    def detokenize(ids):
        return "".join(letters[i % 10] for i in ids)

    prompts = [[7, 8, 9], [3, 1, 4, 1, 5]]
    free = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    expected = []
    for prompt in prompts:
        tokens = greedy_reference(tiny_model, prompt, 24)[0]
        text = detokenize(tokens)
        stop = text[5:8]  # a 3-letter stop string: generation ends at its first completion
        end = text.index(stop) + len(stop)
        expected.append((stop, tokens[:end]))
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 64, max_model_len=64),
                    detokenize=detokenize)
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True,
                                                    stop_strings=(stop, "zz")) for stop, _ in expected])
    for out, (_, tokens) in zip(outs, expected):
        assert out.samples[0].tokens == tokens and out.samples[0].finish_reason == "stop"
    # only generated tokens are looked at: a stop string spanning the prompt's end and the first
    # generated token (absent from the generated text) does not stop the request
    across = detokenize(prompts[0])[-1] + detokenize(expected[0][1])[0]
    assert across not in detokenize(greedy_reference(tiny_model, prompts[0], 24)[0])
    (out,) = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True,
                                                          stop_strings=(across,)))
    assert len(out.samples[0].tokens) == 4 and out.samples[0].finish_reason == "length"
    with pytest.raises(ValueError, match="stop_strings=\\['x'\\] need text"):
        Engine(tiny_model, EngineConfig.for_pages(tiny_model, 16, max_model_len=64)).add_request(
            [1, 2], SamplingParams(stop_strings=("x",)))
    with pytest.raises(ValueError, match="stop_strings=.*expected non-empty strings"):
        SamplingParams(stop_strings=("",))
    assert free.stop_strings == ()


def test_pause_resume_sleep_wake_and_weight_update(tiny_model):
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 32, max_model_len=128,
                                                       check_every_step=True))
    prompt = list(range(50, 90))
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.pause(rid)
    used = engine.pool.num_used
    engine.step()
    assert engine.pool.num_used == used  # paused: pages kept, nothing computed
    engine.resume(rid)
    engine.step()
    engine.sleep()
    assert engine.pool.is_released
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    engine.wake()
    engine.load_weights(tiny_model.state_dict(), version=3)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    sample = outputs[0].samples[0]
    assert sample.tokens == greedy_reference(tiny_model, prompt, 10)[0]  # recomputed after sleep, same tokens
    assert sample.versions[0] == 0 and sample.versions[-1] == 3
    assert engine.pool.num_free == engine.pool.num_pages


def test_fork_without_room_for_copies_recomputes_each_sample(tiny_model):
    """A pool that holds the prompt once but not 8 private copies: the samples are recomputed
    one by one instead, with the same tokens as independent seeded requests."""
    prompt = list(range(100, 110))
    cfg = EngineConfig.for_pages(tiny_model, 10, max_model_len=32, check_every_step=True)
    engine = Engine(tiny_model, cfg)
    pages_per_sample = engine.cache.pages_for_tokens(len(prompt) + 4)
    assert 8 * pages_per_sample > engine.pool.num_pages  # no room for 8 live copies
    (out,) = engine.generate([prompt], SamplingParams(temperature=1.0, n=8, seed=9, max_new_tokens=4,
                                                      ignore_eos=True))
    singles = Engine(tiny_model, cfg).generate([prompt] * 8, [SamplingParams(temperature=1.0, seed=9 + i,
                                                                             max_new_tokens=4, ignore_eos=True)
                                                              for i in range(8)])
    assert [s.tokens for s in out.samples] == [o.samples[0].tokens for o in singles]
    assert engine.pool.num_free == engine.pool.num_pages


def test_a_kda_only_model_runs_without_mla_pages():
    import dataclasses

    from models.config import hybrid_layer_types, load_model_config
    from models.model import HybridLM

    cfg = dataclasses.replace(load_model_config("configs/model/tiny.yaml"), num_hidden_layers=4,
                              layer_types=hybrid_layer_types(4, "K"), mlp_layer_types=["dense"] * 4)
    model = HybridLM(cfg).init_weights(seed=1, std=0.15).eval()
    engine = Engine(model, EngineConfig.for_pages(model, 8, max_model_len=64, check_every_step=True))
    (out,) = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    assert out.samples[0].tokens == greedy_reference(model, [1, 2, 3, 4, 5], 6)[0]
    assert engine.pool.num_free == engine.pool.num_pages


def test_forks_that_fall_back_to_recompute_sample_what_forking_would(tiny_model, monkeypatch):
    """The sampler's rows are drawn before the forward pass (their draws ride in the step's metadata
    copy); forks that cannot get private pages are recomputed later and must draw their first token
    afresh: a pool too small to fork gives the same seeded samples as a large one."""
    import rollout.engine

    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=3, seed=7, ignore_eos=True)
    prompt = list(range(10, 40))
    forked = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 64, max_model_len=64))
    expected = [s.tokens for s in forked.generate([prompt], params)[0].samples]
    resets = []
    reset = rollout.engine.CacheManager.reset
    monkeypatch.setattr(rollout.engine.CacheManager, "reset", lambda self, seq: (resets.append(seq), reset(self, seq)))
    small = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 4, max_model_len=64))
    assert [s.tokens for s in small.generate([prompt], params)[0].samples] == expected
    assert resets, "the small pool was meant to refuse the forks' private pages"
