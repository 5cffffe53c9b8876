"""rl.mismatch on the tiny model, real components: the engine samples, the trainer's chunk path
recomputes, the swaps replay the engine's pieces. Bounds are in units of the logprobs' own scale
(the mean -logp of the sampled tokens, ~5.3 nats here: the tiny model's near-uniform 259 tokens)."""
import math

import pytest
import torch

from rl.config.compose import compose_run_config
from rl.mismatch.cli import main, sample
from rl.mismatch.record import check_schedule
from rl.mismatch.replay import EngineMixer
from rl.mismatch.swaps import Figures, diagnose, side_logprobs
from trainer.chunks import ChunkedModel

SIZES = dict(num_seqs=3, prompt_len=8, max_new_tokens=8)


def diagnosis(dtype: str):
    cfg = compose_run_config([f"experiment.dtype={dtype}"])
    engine, rollout, impl = sample(cfg, **SIZES)
    model = engine.model
    trainer = ChunkedModel(model, cfg.trainer.num_chunks).forward_logprobs(
        rollout.token_ids, rollout.seq_lens, rollout.targets)[rollout.policy_rows]
    replay = EngineMixer(model, engine.layout, rollout, impl)
    scale = float(-rollout.behaviour.mean())
    return model, rollout, replay, trainer, diagnose(model, rollout, replay, trainer), scale


@pytest.fixture(scope="module")
def fp32():
    return diagnosis("fp32")


@pytest.fixture(scope="module")
def bf16():
    return diagnosis("bf16")


def test_the_harness_without_a_swap_is_the_trainer_path(fp32):
    model, rollout, _, trainer, _, _ = fp32
    # the same ops on the same inputs in the same order: equal bit for bit
    assert torch.equal(side_logprobs(model, rollout), trainer)


def test_fp32_mismatch_is_rounding_and_every_swap_runs(fp32):
    _, rollout, _, _, results, scale = fp32
    assert rollout.num_tokens == SIZES["num_seqs"] * SIZES["max_new_tokens"]
    full = results["full"][0]
    # fp32: the two sides differ only in summation order (chunked vs recurrent KDA, dense vs absorbed
    # MLA, fused vs separate matmuls), measured ~1e-6 of the scale; a wrong token, position or state
    # moves a logprob by > 1e-2 of it
    assert 0 < full.max_abs <= 1e-5 * scale
    assert full.k3 <= 1e-10
    for name, (fig, _) in results.items():
        assert all(math.isfinite(v) for v in (fig.k3, fig.max_abs, fig.ratio_p1, fig.ratio_p50, fig.ratio_p99)), name
    # the pieces computed differently by the engine change the trainer's logprobs when swapped in
    for name in ("kda", "kda_mix", "mla", "replay"):
        assert results[name][1], f"swapping {name} changed nothing"
    assert not results["head_fp32"][1]  # an fp32 model's head already runs in fp32


def test_bf16_replay_reproduces_the_engine_and_kda_carries_the_mismatch(bf16):
    _, _, _, _, results, scale = bf16
    full, replay, kda = results["full"][0], results["replay"][0], results["kda"][0]
    # bf16 rounding in different places, amplified through the layers: measured max |d| ~0.2 of the scale
    assert full.max_abs >= 1e-2 * scale
    # every piece replayed the engine's way: what is left is the head's log-softmax formula and its
    # batching (measured 4.8e-7 nats, ~1e-7 of the scale), far under the mismatch
    assert replay.max_abs <= 1e-6 * scale
    # the engine's KDA mixing (its decode convolution sums the taps in one reduction) is the largest
    # source in the tiny model: swapping it alone removes most of the k3 (measured 65%)
    assert results["kda"][1] and kda.k3 < 0.6 * full.k3


def test_figures_of_a_known_difference():
    engine = torch.zeros(4)
    trainer = torch.tensor([math.log(2.0), 0.0, 0.0, 0.0])
    fig = Figures.of(trainer, engine)
    assert fig.k3 == pytest.approx((2.0 - math.log(2.0) - 1.0) / 4)
    assert fig.max_abs == pytest.approx(math.log(2.0))
    assert fig.ratio_p50 == 1.0 and fig.ratio_p99 == pytest.approx(1.0 + 0.97 * 1.0)  # linear interpolation


def test_a_schedule_that_recomputes_is_refused():
    check_schedule([[(0, 0, 4), (1, 0, 2)], [(0, 4, 1)]], [5, 2])
    with pytest.raises(RuntimeError, match="recompute"):
        check_schedule([[(0, 0, 4)], [(0, 0, 4)]], [4])
    with pytest.raises(RuntimeError, match="expected"):
        check_schedule([[(0, 0, 3)]], [4])


def test_the_command_prints_the_figures(capsys):
    assert main(["num_seqs=2", "prompt_len=4", "max_new_tokens=3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = dict(item.split("=") for item in last.split())
    for key in ("mismatch_k3", "mismatch_max_abs", "kda_k3", "mla_k3", "mlp_k3", "head_fp32_k3", "replay_k3"):
        assert math.isfinite(float(figures[key])), key
    assert figures["tokens"] == "6"
    assert main(["num_seqs=0"]) == 2
    assert main(["max_new_tokens=100"]) == 2  # past engine.max_model_len
