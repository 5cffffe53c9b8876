"""PackedMixer (batched training path) against StateMixer (per-sequence reference)."""
import pytest
import torch

from models.config import load_model_config
from models.model import HybridLM, PackedMixer, StateMixer
from models.state import SegmentBatch

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


@pytest.mark.parametrize("lens, max_scores", [([1], 1 << 22), ([5, 1, 9], 1 << 22), ([17, 3, 40, 2], 1 << 22),
                                              ([17, 3, 40, 2, 16, 15], 600)])
def test_outputs_and_gradients_match_the_per_sequence_path(lens, max_scores):
    cfg = load_model_config("configs/model/tiny.yaml", ["mla_use_nope=false", "mla_output_gate=true"])
    model = HybridLM(cfg).init_weights(seed=3, std=0.1)
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(len(lens)))
    batch = SegmentBatch(new_lens=lens, starts=[0] * len(lens))
    weight = torch.randn(sum(lens), cfg.hidden_size, generator=torch.Generator().manual_seed(9))

    def run(mixer):
        model.zero_grad()
        out = model.run_layers(ids, mixer)
        (out * weight).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, ref_grads = run(StateMixer(batch, [None] * len(lens), [[]] * len(lens)))
    mixer = PackedMixer(batch, max_score_elements=max_scores)
    if max_scores < 1000:
        assert len(mixer.buckets) >= 3  # several buckets, rows out of order: the regather is exercised
    got, got_grads = run(mixer)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == ref_grads.keys()
    # A gradient that is exactly 0 in the reference (a 1-token sequence's query: softmax over one key)
    # comes out of flash attention's backward as rounding noise (it recomputes P and rowsum(dO * O)
    # separately): tolerated up to 1e-6 of the largest gradient.
    floor = 1e-6 * max(g.double().norm() for g in ref_grads.values())
    for name in ref_grads:
        a, b = got_grads[name].double(), ref_grads[name].double()
        # Relative to the whole gradient (batched sums round differently; routing amplifies it a little).
        assert (a - b).norm() <= 1e-4 * b.norm() + floor, name

def test_refuses_sequences_that_do_not_start_at_zero():
    with pytest.raises(ValueError, match="starts"):
        PackedMixer(SegmentBatch(new_lens=[2], starts=[3]))


def test_one_long_sequence_does_not_pad_the_short_ones():
    mixer = PackedMixer(SegmentBatch(new_lens=[2] * 50 + [100], starts=[0] * 51))
    assert [b.width for b in mixer.buckets] == [100, 2] and mixer.buckets[0].num <= 2
    assert sum(b.num * b.width for b in mixer.buckets) <= 2 * 200  # padded <= 2x the real tokens


@pytest.mark.triton
def test_triton_kda_training_path_matches_the_torch_twin():
    # The training forward and backward with chunk_kda's Triton kernels (their backward is the
    # autograd) against the torch path run in float64: the output and every parameter's gradient are within the
    # fp32 torch path's own rounding (x2, floor 1e-5 relative), lengths across a 64-token chunk.
    # The gate parameters' gradients (A_log, dt_bias) sum dg over every token, so an fp32 path is a
    # few 1e-5 off there whatever its order of operations (torch's fp32 measured 8e-6 or 6e-5 on
    # two CPUs, the Triton path 7e-5): their floor is 1e-4.
    cfg = load_model_config("configs/model/tiny.yaml")
    lens = [70, 9]
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(4))
    batch = SegmentBatch(new_lens=lens, starts=[0] * len(lens))
    weight = torch.randn(sum(lens), cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    runs = {}
    for impl, dtype in (("naive", torch.float64), ("naive", torch.float32), ("triton", torch.float32)):
        model = HybridLM(cfg).init_weights(seed=5, std=0.1).to(dtype)
        out = model.run_layers(ids, PackedMixer(batch, kda_impl=impl))
        (out * weight.to(dtype)).sum().backward()
        grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
        runs[impl, dtype] = {"output": out.detach().double(), **grads}
    ref = runs["naive", torch.float64]
    assert any("A_log" in n for n in ref), "the KDA gate parameters must be in the loss"
    for name, b in ref.items():
        err = {key: ((run[name] - b).norm() / b.norm()).item() for key, run in runs.items()}
        floor = 1e-4 if name.endswith(("A_log", "dt_bias")) else 1e-5
        assert err["triton", torch.float32] <= max(2 * err["naive", torch.float32], floor), (name, err)
