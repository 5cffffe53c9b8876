"""rl/plan/activation.py: the composed activation probe (one forward per distinct layer kind) against
the full one (the trainer's forward/backward of every chunk), and what each costs.

The composed figure must equal the full meter's chunk by chunk, to the byte: the peak is reached in
a chunk's recompute (its backward only releases), layers of one kind save the same bytes whatever
their index, and the storages alive across chunks are read off the pack hook. Costs are compared by
work done (layer forwards, aten ops dispatched on the meta device), never by seconds: machines are
noisy; planning seconds are the benchmarks' business (benchmarks/expert_parallel.py)."""
import dataclasses

import pytest
import torch

from models.config import load_model_config
from rl.plan.activation import METHODS, probe_activations
from tests.rl.test_config import CONFIGS

TINY = load_model_config(f"{CONFIGS}/model/tiny.yaml")
ROUTED = dataclasses.replace(TINY, num_experts=32, num_expert_group=1)  # the routed MoE path, not run-every-expert
MID = load_model_config(f"{CONFIGS}/model/kimi_linear_mid.yaml")
UNEVEN = [[40, 30, 50], [7]]  # buckets, padding, two micro-batches of different lengths


def both(config, micro_batches, num_chunks, dtype, split, grouped_mm=False):
    return [probe_activations(config, micro_batches, num_chunks, dtype, split=split, grouped_mm=grouped_mm, method=m)
            for m in ("full", "compose")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split, num_chunks", [("layers", 1), ("layers", 3), ("params", 10)])
def test_composed_equals_full_on_the_tiny_model(dtype, split, num_chunks):
    """One chunk, several, and embedding / head chunks of their own (params split, 8 + 2 chunks)."""
    full, fast = both(TINY, UNEVEN, num_chunks, dtype, split)
    assert fast.chunk_peaks == full.chunk_peaks and min(full.chunk_peaks) > 0


@pytest.mark.parametrize("grouped_mm", [False, True])
def test_composed_equals_full_with_routed_experts_in_either_moe_form(grouped_mm):
    full, fast = both(ROUTED, UNEVEN, 6, torch.bfloat16, "params", grouped_mm)
    assert fast.chunk_peaks == full.chunk_peaks


@pytest.mark.parametrize("dtype, split, num_chunks", [(torch.float32, "layers", 3), (torch.bfloat16, "params", 29)])
def test_composed_equals_full_on_the_mid_model(dtype, split, num_chunks):
    """The 48B's layer pattern (27 layers, 20 KDA + 7 MLA, a dense first layer, routed top-8 MoE)."""
    full, fast = both(MID, [[70, 5, 5, 64], [20, 20]], num_chunks, dtype, split)
    assert fast.chunk_peaks == full.chunk_peaks


def test_the_composed_probe_meters_fewer_layers_and_ops():
    """The mid model's 27 layers come in three kinds (KDA + dense, KDA + MoE, MLA + MoE): the composed
    probe runs each once per distinct micro-batch, the full one every layer but the last chunk's in the
    graph-free forward and every layer again in the recompute, besides the backward (a repeated
    micro-batch is metered once by both)."""
    full, fast = both(MID, [[64, 63], [64, 63]], 27, torch.bfloat16, "layers")
    assert fast.chunk_peaks == full.chunk_peaks
    assert fast.layer_runs == 3
    assert full.layer_runs == 26 + 27
    assert fast.num_ops * 10 < full.num_ops


def test_the_probe_names_a_bad_method():
    with pytest.raises(ValueError, match="method='fast'"):
        probe_activations(TINY, [[8]], 2, method="fast")
    assert METHODS == ("compose", "full")
