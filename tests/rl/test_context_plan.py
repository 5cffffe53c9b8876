"""The planner under context parallelism: the long-sequence probe, a rank's share, the 1M plan.

The affine probe (rl/plan/affine_probe.py) must give the direct probe's chunk peaks to the byte
at lengths off its lattice's base (same ops, extrapolated on a lattice where every piece is affine
in the length). A context-parallel rank's planned peak must bound what the trainer's meter reads
on a real 2-process step and stay close to it (the plan adds the exchange buffers of a whole chunk
on top of the layer peaks: an upper bound by construction)."""
import pytest
import torch

from models.config import load_model_config
from rl.plan.activation import probe_activations
from rl.plan.affine_probe import AFFINE_MIN_PERIODS, affine_activations, affine_period
from rl.plan.context_memory import check_context, context_buffers, local_lens
from tests.rl.test_config import CONFIGS

TINY = load_model_config(f"{CONFIGS}/model/tiny.yaml")
MID = load_model_config(f"{CONFIGS}/model/kimi_linear_mid.yaml")


@pytest.mark.parametrize("context_parallel", [False, True])
@pytest.mark.parametrize("config, seq_len, chunk_len, num_chunks, dtype", [
    (TINY, 1000, 128, 2, torch.float32),    # period 128: probes at 360 and 488 tokens, 1000 = 104 + 7 periods
    (MID, 1333, 128, 27, torch.bfloat16),   # the 48B's layer pattern, one layer per chunk, grouped routed MoE
    (TINY, 5000, 1024, 3, torch.float32)])  # the planner's default logprob chunk (period 1024)
def test_the_affine_probe_equals_the_direct_probe_off_its_lattice_base(config, seq_len, chunk_len, num_chunks, dtype,
                                                                       context_parallel):
    period = affine_period(chunk_len)
    assert seq_len > seq_len % period + (AFFINE_MIN_PERIODS + 1) * period  # extrapolated, not probed directly
    kwargs = dict(logprob_chunk_len=chunk_len, grouped_mm=True, context_parallel=context_parallel)
    direct = probe_activations(config, [[seq_len]], num_chunks, dtype, **kwargs)
    affine = affine_activations(config, seq_len, num_chunks, dtype, **kwargs)
    assert affine.method == "affine" and affine.chunk_peaks == direct.chunk_peaks
    assert min(direct.chunk_peaks) > 0


def test_routed_experts_in_the_padded_form_are_probed_directly():
    """Each expert's rows padded to a block are not affine in the tokens (measured: 4.9 MB off in the
    mid model's second chunk at 1333 tokens): that form falls back to the direct probe."""
    direct = probe_activations(MID, [[1333]], 27, torch.bfloat16, logprob_chunk_len=128)
    fallback = affine_activations(MID, 1333, 27, torch.bfloat16, logprob_chunk_len=128)
    assert fallback.method == "compose" and fallback.chunk_peaks == direct.chunk_peaks


def test_the_context_parallel_kernel_form_saves_more_than_the_plain_one():
    """KDA under the split carries K extra value columns (the transition M): a KDA layer's saved
    bytes grow, so the two forms must differ (the patch reaches the probed layers)."""
    plain = probe_activations(TINY, [[512]], 1, context_parallel=False).chunk_peaks
    split = probe_activations(TINY, [[512]], 1, context_parallel=True).chunk_peaks
    assert split[0] > plain[0]


def test_a_context_rank_plan_bounds_the_trainers_meter_on_a_two_process_step():
    """benchmarks.context_parallel's step (tiny model, fp32, 2 VPP chunks, one sequence) at C = 2 on
    two gloo processes: each rank's measured peak <= the planned one <= 1.25 x it (the plan adds
    every layer's exchange buffers of a chunk to the chunk's peak; the meter sees them alive only
    from their layer on)."""
    from benchmarks.context_parallel import _run

    length = 2048
    measured = max(r["peak"] for r in _run(2, length, []))
    local = local_lens(TINY, [length], 2)
    peaks = probe_activations(TINY, [local], 2, torch.float32, context_parallel=True).chunk_peaks
    buffers = context_buffers(TINY, [length], 2, 4)
    half = TINY.num_hidden_layers // 2
    types = [TINY.layer_types[:half], TINY.layer_types[half:]]
    planned = max(p + buffers.saved(t) for p, t in zip(peaks, types))
    print(f"C = 2 at {length} tokens: measured {measured}, planned {planned} ({planned / measured:.3f})")
    assert measured <= planned <= 1.25 * measured, (measured, planned)


def test_bad_context_values_are_refused_by_name():
    with pytest.raises(ValueError, match="context=3 does not divide the 8 GPUs"):
        check_context(3, 8, 1, "h200x8")
    with pytest.raises(ValueError, match="context=0"):
        check_context(0, 8, 1, "h200x8")
    with pytest.raises(ValueError, match="parallel.expert=16 does not divide DP x context"):
        check_context(2, 8, 16, "h200x8")
    assert check_context(4, 16, 8, "h200x8x2") == 4


def test_the_1m_plan_fits_the_48b_only_when_the_split_brings_a_rank_under_its_gpu():
    """The 48B at 1,048,576 tokens on 8 x H200: whole sequences (C = 1) need ~0.5 TiB of activations
    per GPU and do not fit; C = 8 does. Activations scale as 1 / C (local tokens), and the KDA states
    and gathered MLA latents do not grow with C."""
    from rl.plan.long_context import plan_layout

    one, two, eight = (plan_layout("h200x8", c, 8) for c in (1, 2, 8))
    assert not one.fits and eight.fits and eight.train_device_gib <= eight.device_gib
    assert one.cp_saved_gib == 0 and eight.cp_saved_gib == pytest.approx(two.cp_saved_gib)
    # the share of 1 / C, plus KDA's wider value columns and the buffers (a few percent)
    assert one.activation_gib / 8 < eight.activation_gib < 1.2 * one.activation_gib / 8
    assert eight.pool_sequences >= 1
