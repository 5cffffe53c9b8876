"""Token eviction for the MLA layers (rollout/kv/kv_eviction.py): H2O drops, InfiniGen offloads.

Invariants checked after every step by the engine (`check_every_step`): each sequence holds at
most its budget of MLA slots and no more pages than that needs; sink and recent tokens are always
resident; resident + offloaded + dropped tokens account for every computed token; page refcounts
match what sequences and the prefix cache hold."""
import math

import pytest
import torch

from rollout.engine import Engine, EngineConfig
from rollout.kv.kv_eviction import KVBudgetConfig, SeqKV, heavy_hitters, lookup_policy, register_policy
from rollout.kv.prefix_cache import PrefixCacheConfig
from rollout.sampling import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)


def prompts(lengths=(20, 70, 100, 9), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def engine(model, kv=None, num_pages=None, **kw):
    config = dict(max_model_len=256, max_num_batched_tokens=96, check_every_step=True, block_tokens=BLOCK, kv_budget=kv)
    config.update(kw)
    return Engine(model, EngineConfig(**config) if num_pages is None
                  else EngineConfig.for_pages(model, num_pages, **config))


def run(model, kv=None, params=GREEDY, batch=None, **kw):
    eng = engine(model, kv, **kw)
    outs = eng.generate(batch or prompts(), params)
    assert eng.pool.num_used == 0  # every page back on the free list
    if eng.evictor is not None and eng.evictor.store is not None:
        assert eng.evictor.store.num_used == 0  # every host row freed
        eng.evictor.store.check_integrity()
    return eng, outs


def same(a, b):
    return [x.samples[0].tokens == y.samples[0].tokens for x, y in zip(a, b)]


@pytest.fixture(scope="module")
def full(tiny_model):
    return run(tiny_model)[1]


@pytest.mark.parametrize("policy", ["h2o", "infinigen"])
def test_a_budget_at_least_the_length_is_exactly_full_kv(tiny_model, full, policy):
    eng, outs = run(tiny_model, KVBudgetConfig(budget_tokens=200, policy=policy))
    assert eng.evictor.stats["evicted"] == 0
    for a, b in zip(full, outs):
        assert a.samples[0].tokens == b.samples[0].tokens
        assert a.samples[0].logprobs == b.samples[0].logprobs  # bit for bit: same kernels, same order


@pytest.mark.parametrize("policy", ["h2o", "infinigen"])
def test_budget_holds_and_pages_are_freed(tiny_model, full, policy):
    budget = 48
    kv = KVBudgetConfig(budget_tokens=budget, policy=policy, sink_tokens=4, recent_tokens=12)
    eng = engine(tiny_model, kv)
    for p in prompts():
        eng.add_request(p, GREEDY)
    most_pages = 0
    while eng.has_unfinished:
        eng.step()  # check_every_step: budget, sinks, recent window, accounting, refcounts
        for seq in eng.scheduler.running:
            assert seq.kv_len <= budget
            assert len(seq.mla_pages[0]) <= math.ceil(budget / BLOCK)
            positions = set(seq.kv.positions.tolist())
            assert set(range(4)) <= positions
            assert set(range(max(0, seq.num_computed - 12), seq.num_computed)) <= positions
            most_pages = max(most_pages, len(seq.mla_pages[0]))
    stats = eng.evictor.stats
    assert stats["evicted"] > 0 and most_pages == math.ceil(budget / BLOCK)
    assert eng.pool.num_used == 0
    if policy == "h2o":
        assert stats["dropped"] == stats["evicted"] and stats["offloaded"] == 0
    else:
        assert stats["offloaded"] == stats["evicted"] and stats["dropped"] == 0 and stats["fetched"] > 0
    # The 9-token prompt never reaches the budget: untouched, equal to full KV.
    assert eng.requests == {} and stats["compactions"] > 0


def test_perfect_infinigen_predictor_equals_full_kv(tiny_model, full):
    # All latent channels (no rotation: exact partial scores) and no cut-off: every offloaded
    # token the attention would weigh is fetched, so the split softmax is the full one.
    kv = KVBudgetConfig(budget_tokens=48, policy="infinigen", sink_tokens=4, recent_tokens=12,
                        partial_channels=10 ** 6, alpha=math.inf, max_fetch=None)
    eng, outs = run(tiny_model, kv)
    assert eng.evictor.stats["offloaded"] > 0 and eng.evictor.predictor.exact
    assert all(same(full, outs))
    for a, b in zip(full, outs):
        torch.testing.assert_close(torch.tensor(b.samples[0].logprobs), torch.tensor(a.samples[0].logprobs),
                                   rtol=1e-5, atol=1e-5)


def test_h2o_changes_long_sequences_only(tiny_model, full):
    _, outs = run(tiny_model, KVBudgetConfig(budget_tokens=48, sink_tokens=4, recent_tokens=12))
    assert not all(same(full, outs))  # dropping most of a 100-token context changes something


def test_pruned_sequences_register_nothing_and_shared_pages_survive(tiny_model):
    model = tiny_model
    kv = KVBudgetConfig(budget_tokens=48, sink_tokens=4, recent_tokens=12)
    eng = engine(model, kv, prefix_cache=PrefixCacheConfig(hash_block=8))
    prefix = eng.cache.prefix
    calls = []
    register = prefix.register

    def watched(seq, *speculated):
        before = (dict(prefix.index.mla), {h: dict(g) for h, g in prefix.index.kda.items()})
        register(seq, *speculated)
        after = (dict(prefix.index.mla), {h: dict(g) for h, g in prefix.index.kda.items()})
        calls.append((seq.kv_pruned, before != after))

    prefix.register = watched
    long_prompt = prompts((100,), seed=3)[0]
    eng.generate([long_prompt], GREEDY)
    assert any(pruned for pruned, _ in calls) and any(changed for pruned, changed in calls if not pruned)
    assert not any(changed for pruned, changed in calls if pruned)
    # What it registered before its first eviction is a true prefix, intact after the compactions
    # that followed (copy on write): a request over those tokens hits and equals a cold engine.
    follow = long_prompt[:40] + [1, 2, 3]  # + 4 new tokens: within the budget, nothing evicted
    hit_before = prefix.hit_tokens
    out = eng.generate([follow], SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert prefix.hit_tokens - hit_before >= 32
    cold = engine(model).generate([follow], SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert out.samples[0].tokens == cold.samples[0].tokens
    torch.testing.assert_close(torch.tensor(out.samples[0].logprobs), torch.tensor(cold.samples[0].logprobs),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["h2o", "infinigen"])
def test_forks_evict_on_their_own_without_touching_siblings(tiny_model, policy):
    # n=4 forks share the prompt's pages; each one's compaction copies a shared page before
    # writing (copy on write). Each fork must equal an independent request with its seed.
    kv = KVBudgetConfig(budget_tokens=48, policy=policy, sink_tokens=4, recent_tokens=12)
    prompt = prompts((40,), seed=5)[0]
    params = SamplingParams(temperature=0.8, max_new_tokens=40, n=4, seed=11, ignore_eos=True)
    eng, (forked,) = run(tiny_model, kv, params=params, batch=[prompt])
    assert eng.evictor.stats["cow_pages"] > 0
    for i, sample in enumerate(forked.samples):
        single = SamplingParams(temperature=0.8, max_new_tokens=40, seed=11 + i, ignore_eos=True)
        _, (alone,) = run(tiny_model, kv, params=single, batch=[prompt])
        assert sample.tokens == alone.samples[0].tokens, i


def test_preemption_with_eviction_recomputes_cleanly(tiny_model):
    kv = KVBudgetConfig(budget_tokens=48, policy="infinigen", sink_tokens=4, recent_tokens=12)
    eng, outs = run(tiny_model, kv, num_pages=20, max_num_batched_tokens=160,
                    batch=prompts((60, 70, 80, 90, 50)))
    assert eng.scheduler.num_preemptions > 0
    assert all(len(o.samples[0].tokens) == 60 for o in outs)


def test_heavy_hitters_matches_a_plain_reference():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        scores = torch.randint(0, 5, (n,), generator=gen).double()  # ties on purpose
        positions = torch.randperm(100, generator=gen)[:n]
        protected = torch.rand(n, generator=gen) < 0.3
        keep = int(torch.randint(int(protected.sum()), n + 1, (1,), generator=gen))
        stay = heavy_hitters(scores, positions, protected, keep)
        free = sorted((i for i in range(n) if not protected[i]),
                      key=lambda i: (-float(scores[i]), -int(positions[i])))
        expected = set(i for i in range(n) if protected[i]) | set(free[:keep - int(protected.sum())])
        assert set(stay.nonzero().flatten().tolist()) == expected, trial


def test_policy_registry_and_config_errors():
    assert lookup_policy("h2o").offload is False and lookup_policy("infinigen").offload is True
    with pytest.raises(ValueError, match="unknown eviction policy 'lru'.*'h2o', 'infinigen'"):
        lookup_policy("lru")
    with pytest.raises(ValueError, match="already registered"):
        register_policy("h2o", offload=False)(heavy_hitters)
    with pytest.raises(ValueError, match="budget_tokens=16 must exceed sink_tokens \\+ recent_tokens = 4 \\+ 12"):
        KVBudgetConfig(budget_tokens=16, sink_tokens=4, recent_tokens=12)
    with pytest.raises(ValueError, match="budget_tokens=0, expected a positive integer"):
        KVBudgetConfig(budget_tokens=0)
    with pytest.raises(ValueError, match="unknown eviction policy 'drop'"):
        KVBudgetConfig(budget_tokens=64, policy="drop")
    with pytest.raises(ValueError, match="alpha=0"):
        KVBudgetConfig(budget_tokens=64, alpha=0)
    with pytest.raises(ValueError, match="max_fetch=0"):
        KVBudgetConfig(budget_tokens=64, max_fetch=0)
    assert KVBudgetConfig(budget_tokens=64, sink_tokens=4, recent_tokens=12).max_chunk == 48


def test_partial_key_predictor(tiny_model):
    eng = engine(tiny_model, KVBudgetConfig(budget_tokens=48, policy="infinigen", partial_channels=8))
    pred = eng.evictor.predictor
    width = tiny_model.config.mla_latent_dim
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, width, generator=gen), torch.randn(7, width, generator=gen)
    for layer, proj in pred.proj.items():
        assert proj.shape == (width, 8)
        torch.testing.assert_close(proj.T @ proj, torch.eye(8), atol=1e-5, rtol=0)  # orthonormal columns
        assert pred.keys(layer, k).shape == (7, 8) and pred.queries(layer, q).shape == (5, 8)
    exact = engine(tiny_model, KVBudgetConfig(budget_tokens=48, policy="infinigen",
                                              partial_channels=width)).evictor.predictor
    layer = tiny_model.config.mla_layers[0]
    assert exact.exact and torch.equal(exact.queries(layer, q) @ exact.keys(layer, k).T, q @ k.T)


def test_seqkv_fresh_accounts_every_token():
    kv = SeqKV.fresh(5)
    assert kv.length == 5 and kv.num_offloaded == 0 and not kv.pruned
    assert kv.positions.tolist() == [0, 1, 2, 3, 4] and kv.scores.dtype == torch.float64


def test_engine_rejects_a_budget_the_pool_cannot_hold(tiny_model):
    # 3 KDA pages + ceil(200 / 16) = 13 MLA pages > 8: a clear error naming the sequence length.
    with pytest.raises(ValueError, match="cannot hold one sequence of 200 tokens"):
        engine(tiny_model, KVBudgetConfig(budget_tokens=200), num_pages=8)


def test_compaction_right_after_a_prefix_hit_keeps_the_true_rows(tiny_model):
    # A hit whose partially covered last page is still waiting for its copy (the prefix cache's
    # deferred copies run at flush, after scheduling) and a chunk that needs eviction at once:
    # compaction must move the copied rows, not the page's old bytes. Checked against the plain
    # model's latents for the resident positions (all computed before any eviction).
    model = tiny_model
    kv = KVBudgetConfig(budget_tokens=48, sink_tokens=4, recent_tokens=12)
    eng = engine(model, kv, prefix_cache=PrefixCacheConfig(hash_block=8))
    prefix = prompts((40,), seed=9)[0]
    eng.generate([prefix], SamplingParams(temperature=0.0, max_new_tokens=1))
    with torch.no_grad():
        state = model.forward_with_state([torch.tensor(prefix)]).states[0]
    checked = []
    run_step = eng.runner.run

    def run_checked(step, *args):
        for seq in step.seqs:
            if seq.kv is not None and seq.kv.pruned and not checked:
                rows = eng.evictor._gather(seq, torch.arange(seq.kv_len))  # [n, mla layers, W]
                for i, layer in enumerate(eng.evictor.mla_layers):
                    torch.testing.assert_close(rows[:, i], state.mla[layer][seq.kv.positions], rtol=1e-5, atol=1e-5)
                checked.append(seq.kv.positions.tolist())
        return run_step(step, *args)

    eng.runner.run = run_checked
    hits = eng.cache.prefix.hit_tokens
    eng.generate([prefix + list(range(100, 120))], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert eng.cache.prefix.hit_tokens - hits == 40 and checked and max(checked[0]) >= 32


def test_page_estimates_respect_the_budget(tiny_model):
    # What the dispatcher's full-length admission and the engine's pool check count per sequence.
    plain = engine(tiny_model)
    budgeted = engine(tiny_model, KVBudgetConfig(budget_tokens=48, sink_tokens=4, recent_tokens=12))
    kda = len(plain.layout.kda_groups)
    assert plain.cache.pages_for_tokens(200) == kda + math.ceil(200 / BLOCK)
    assert budgeted.cache.pages_for_tokens(200) == kda + math.ceil(48 / BLOCK)
    assert budgeted.cache.pages_for_tokens(20) == plain.cache.pages_for_tokens(20)
