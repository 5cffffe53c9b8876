"""Speculation with a draft model (rollout/speculative/draft.py): greedy equals plain decoding with a draft unlike the
target and with the target itself as its draft (then every proposal is kept); sampled with a draft that
disagrees with the target, the first two emitted tokens follow the target's distribution (a chi-square
bound over the 9 outcomes of top-k 3 at a fixed seed); the draft's states roll back to the kept tokens
(its next catch-up reads only what the target accepted); config errors name the knob."""
import dataclasses

import pytest
import torch

from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams
from tests.rollout.speculative.test_speculation import GREEDY, engine_for, generate, prompts
from tests.bounds import LOGPROB_TOL

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

CHI2_DF8_P9999 = 31.83
"""The 99.99% quantile of chi-square with 8 degrees of freedom (tables)."""


def small_draft(seed: int) -> HybridLM:
    """A 4-layer hybrid (3 KDA : 1 MLA) with the tiny model's vocabulary: weights of its own."""
    config = dataclasses.replace(load_model_config("configs/model/tiny.yaml"), num_hidden_layers=4,
                                 layer_types=["kda", "kda", "kda", "mla"], mlp_layer_types=["dense"] * 4)
    return HybridLM(config).init_weights(seed=seed, std=0.15).eval()


def noisy_copy(model: HybridLM, noise: float, seed: int) -> HybridLM:
    """The model with Gaussian noise added to every weight: a draft that agrees with it only in part."""
    copy = HybridLM(model.config)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    return copy.eval()


@pytest.fixture(scope="module")
def plain(tiny_model):
    batch = prompts(5, seed=4)
    return batch, generate(engine_for(tiny_model), batch)


@pytest.mark.parametrize("draft", ["other", "itself"])
def test_greedy_with_a_draft_emits_plain_decodings_tokens(tiny_model, plain, draft):
    batch, want = plain
    model = small_draft(3) if draft == "other" else tiny_model
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 80, max_model_len=200, check_every_step=True,
                                                       speculative="draft", speculative_row_cost=0.0), draft=model)
    got = generate(engine, batch)
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, **LOGPROB_TOL)  # verification chunks vs decode steps
    spec = engine.speculator
    assert spec.num_verifications > 0 and engine.pool.num_used == 0
    if draft == "itself":  # the draft's argmax is the target's: every proposal kept, far fewer steps
        assert spec.acceptance_rate == 1.0 and engine.num_steps < GREEDY.max_new_tokens * 2
    else:
        assert spec.acceptance_rate < 0.5


def top3_chi2(model, prompt: list[int], samples) -> tuple[float, int, dict]:
    """Chi-square of the samples' first two tokens against p(t1) p(t2 | t1) of `model` under top-k 3
    (9 outcomes; the samples' count is the expected total); also how many samples fell among the 9
    and the counts."""
    def top3(tokens: list[int]) -> tuple[list[int], torch.Tensor]:
        with torch.no_grad():
            p = torch.softmax(model(torch.tensor([tokens]))[0, -1].double(), dim=-1)
        values, ids = p.topk(3)
        return ids.tolist(), values / values.sum()

    counts: dict[tuple[int, int], int] = {}
    for sample in samples:
        key = (sample.tokens[0], sample.tokens[1])
        counts[key] = counts.get(key, 0) + 1
    firsts, p1 = top3(prompt)
    chi2, total = 0.0, 0
    for a, pa in zip(firsts, p1.tolist()):
        seconds, p2 = top3(prompt + [a])
        for b, pb in zip(seconds, p2.tolist()):
            want = len(samples) * pa * pb
            got = counts.get((a, b), 0)
            chi2 += (got - want) ** 2 / want
            total += got
    return chi2, total, counts


def test_sampled_tokens_follow_the_target_distribution_with_a_draft_that_agrees_in_part(tiny_model):
    """600 samples (forks of one request, seeded) of three tokens at T=1, top-k 3: the second is always a
    verification's (an accepted draft token or the residual's draw; one proposal fits before the third).
    Counts of the 9 (t1, t2) outcomes vs p(t1) p(t2 | t1) by the reference model."""
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, n=600, seed=5, ignore_eos=True)
    prompt = [12, 99, 7, 200, 31]
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 4000, max_model_len=64, max_num_seqs=600, max_num_batched_tokens=2048,
                                                       speculative="draft", speculative_row_cost=0.0),
                    draft=noisy_copy(tiny_model, 0.002, seed=11))
    [out] = engine.generate([prompt], params)
    assert engine.speculator.num_verifications >= 500 and 0.1 < engine.speculator.acceptance_rate < 0.9

    chi2, total, counts = top3_chi2(tiny_model, prompt, out.samples)
    assert total == 600  # every outcome is one of the 9 the target allows
    assert chi2 < CHI2_DF8_P9999, (chi2, counts)


def test_the_draft_state_rolls_back_to_the_kept_tokens(tiny_model):
    """After each step, the draft state of a running sequence equals a fresh draft run over the tokens it
    claims to have read, which are all tokens the target accepted."""
    draft = small_draft(3)
    engine = Engine(tiny_model, EngineConfig.for_pages(tiny_model, 80, max_model_len=200, speculative="draft",
                                                       speculative_row_cost=0.0), draft=draft)
    proposer = engine.speculator.proposer
    for p in prompts(3, seed=9):
        engine.add_request(p, GREEDY)
    checked = 0
    while engine.has_unfinished:
        engine.step()
        for seq in engine.scheduler.running:
            entry = proposer._seqs.get(seq)
            if entry is None or entry.state is None:
                continue
            assert entry.fed <= seq.num_tokens
            fresh = draft.forward_with_state([torch.tensor(seq.tokens[:entry.fed])]).states[0]
            for layer, mine in entry.state.kda.items():
                assert torch.allclose(mine.recurrent, fresh.kda[layer].recurrent, atol=1e-5)
            for layer, latents in entry.state.mla.items():
                assert latents.shape == fresh.mla[layer].shape and torch.allclose(latents, fresh.mla[layer], atol=1e-5)
            checked += 1
    assert checked > 0


def test_draft_config_errors_name_the_knob(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="engine.draft_model"):
        Engine(tiny_model, EngineConfig(speculative="draft"))
    with pytest.raises(ValueError, match="draft_model='x' with speculative='ngram'"):
        EngineConfig(speculative="ngram", draft_model="x")
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a model config"):
        Engine(tiny_model, EngineConfig(speculative="draft", draft_model=str(tmp_path / "missing")))
    wrong_vocab = dataclasses.replace(load_model_config("configs/model/tiny.yaml"), vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size=300 but the target's is 259"):
        Engine(tiny_model, EngineConfig(speculative="draft"), draft=HybridLM(wrong_vocab).init_weights(seed=0))
    engine = Engine(tiny_model, EngineConfig(speculative="draft", draft_model="configs/model/tiny.yaml"))
    assert engine.speculator.proposer.model.config.vocab_size == 259
