"""The engine's MLA prefill in tiles of slots (`PagedMixer._mla_prefill`) against its dense twin, the
full-score softmax it replaced: random steps of several sequences (prefill chunks at random starts,
1-token chunks, decodes mixed in) over pages poisoned with NaN, tiles far smaller than the contexts.
The layer output must agree to 1e-5, and token eviction's observer must receive the same attention
mass per slot and per extra row."""
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import models.paged
from models.config import load_model_config
from models.mla import MLALayer
from models.paged import PagedCaches, PagedMixer, PagedStep, _Bucket, _pad
from models.state import SegmentBatch

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

MLA_INDEX = 3  # an MLA layer index of the tiny config


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class DenseMixer(PagedMixer):
    """The reference twin: the prefill that gathered every page of a bucket and built full scores
    [Bp, Lq, H, S] (the code `_mla_prefill` had before it was tiled)."""

    def _mla_prefill(self, index: int, layer: MLALayer, bucket: _Bucket, q_nope: torch.Tensor,
                     q_rope: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, out: torch.Tensor) -> None:
        block_tokens, width_kv = cache.shape[1], cache.shape[2]
        seqs, num, width, src, dst = bucket.seqs, len(bucket.seqs), bucket.width, bucket.src, bucket.dst
        heads, d_c = layer.num_heads, layer.kv_lora_rank
        w_uk, w_uv = (w.float() for w in layer.up_projections())
        starts, lens = bucket.kv_starts, bucket.lens  # [Bp]
        ends = starts + lens  # [Bp]
        num_blocks = -(-bucket.max_end // block_tokens)
        span = num_blocks * block_tokens
        needed = torch.arange(num_blocks) * block_tokens < ends[:, None]  # [Bp, nb]
        pages = tables.index_select(0, bucket.index)[:, :num_blocks].masked_fill(~needed, 0)  # [Bp, nb]
        kv = cache.index_select(0, pages.reshape(-1)).view(num, span, width_kv).float()  # [Bp, S, W]
        kv_pos = torch.arange(span)
        kv = kv.masked_fill((kv_pos >= ends[:, None])[..., None], 0.0)
        q_pos = starts[:, None] + torch.arange(width)  # [Bp, Lq]
        allowed = (kv_pos <= q_pos[..., None]) & (kv_pos < ends[:, None, None])  # [Bp, Lq, S]
        obs = self.step.kv_observer
        extra = obs.extra_kv(index, seqs, None) if obs is not None else None
        if extra is not None:
            kv = torch.cat([kv, extra[0].float()], dim=1)  # [Bp, S + M, W]
            allowed = torch.cat([allowed, extra[1][:, None, :].expand(num, width, -1)], dim=-1)
        qn = _pad(q_nope, src, dst, num, width).float().view(num * width, heads, -1)
        q_lat = torch.bmm(qn.transpose(0, 1), w_uk).transpose(0, 1)  # [Bp*Lq, H, d_c]
        qr = _pad(q_rope, src, dst, num, width).float().view(num * width, heads, -1)
        q = torch.cat([q_lat, qr], dim=-1).view(num, width * heads, width_kv)  # [Bp, Lq*H, W]
        total = kv.shape[1]
        scores = (q @ kv.transpose(1, 2)).mul_(layer.scale).view(num, width, heads, total)
        scores.masked_fill_(~allowed[:, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        if obs is not None:
            real = (torch.arange(width) < lens[:, None]).to(probs.dtype)  # [Bp, Lq]
            received = torch.einsum("bqhs,bq->bs", probs, real)  # [Bp, S + M]
            obs.observe(index, seqs, received[:, :span], received[:, span:] if extra is not None else None)
        o_lat = (probs.view(num, width * heads, total) @ kv)[..., :d_c]  # [Bp, Lq*H, d_c]
        o = torch.bmm(o_lat.reshape(num * width, heads, d_c).transpose(0, 1), w_uv.transpose(1, 2))
        out.index_copy_(0, src, o.transpose(0, 1).index_select(0, dst).to(out.dtype))


class RecordingObserver:
    """A `KVObserver` that serves the same random extra rows to every mixer (seeded by the call),
    finite garbage in the invalid ones, and records what it is told."""

    def __init__(self, num_extra: int, width: int, seed: int) -> None:
        self.num_extra, self.width, self.seed = num_extra, width, seed
        self.calls: list[tuple[int, list[int], torch.Tensor, torch.Tensor | None]] = []

    def extra_kv(self, layer, seqs, q):
        if not self.num_extra:
            return None
        gen = torch.Generator().manual_seed(self.seed + 1000 * len(seqs) + sum(seqs) + (q is None))
        kv = torch.randn(len(seqs), self.num_extra, self.width, generator=gen)  # [Bp, M, W]
        valid = torch.rand(len(seqs), self.num_extra, generator=gen) < 0.7  # [Bp, M]
        valid[0] = False  # a sequence with nothing fetched
        return kv, valid

    def observe(self, layer, seqs, resident, extra):
        self.calls.append((layer, list(seqs), resident.clone(), None if extra is None else extra.clone()))


@functools.cache
def layer(rope: bool) -> MLALayer:
    config = load_model_config("configs/model/tiny.yaml", [f"mla_use_nope={not rope}"])
    torch.manual_seed(5)
    mla = MLALayer(config).eval()
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0.0, 0.3)
    return mla


def run_step(mixer_cls, mla, cache, tables, starts, lens, kv_starts, x, observer):
    batch = SegmentBatch(new_lens=lens, starts=starts)
    step = PagedStep(batch=batch, state_pages={}, block_tables={MLA_INDEX: tables}, kv_starts=kv_starts,
                     kv_observer=observer)
    caches = PagedCaches(kda_state={}, kda_conv={}, mla_latent={MLA_INDEX: cache})
    with torch.no_grad():
        return mixer_cls(caches, step).mla(MLA_INDEX, mla, x)


def build(seed, block_tokens, layout, evicted):
    """A pool whose pages hold each sequence's context rows (kv_start slots, random) and NaN
    everywhere else, shuffled; block tables with room for the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    width = 32 + 8
    kv_starts = [k for k, _ in layout]
    lens = [n for _, n in layout]
    num_blocks = [-(-(k + n) // block_tokens) for k, n in layout]
    num_pages = sum(num_blocks) + 2
    cache = torch.full((num_pages, block_tokens, width), float("nan"))  # [P, bt, W]
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = []
    for k, nb in zip(kv_starts, num_blocks):
        own, order = order[:nb], order[nb:]
        tables.append(own)
        for s in range(k):
            cache[own[s // block_tokens], s % block_tokens] = torch.randn(width, generator=gen)
    starts = [k + (evicted if k else 0) for k in kv_starts]  # token positions: RoPE only
    x = torch.randn(sum(lens), 64, generator=gen)  # [N, hidden]
    return cache, tables, starts, lens, kv_starts, x


def check_step(seed, block_tokens, layout, tile_slots, num_extra, rope, evicted, monkeypatch):
    monkeypatch.setattr(models.paged, "PREFILL_TILE_SLOTS", tile_slots)
    mla = layer(rope)
    cache, tables, starts, lens, kv_starts, x = build(seed, block_tokens, layout, evicted)
    results = {}
    for cls in (DenseMixer, PagedMixer):
        obs = RecordingObserver(num_extra, cache.shape[2], seed) if num_extra >= 0 else None
        work = cache.clone()
        results[cls] = run_step(cls, mla, work, tables, starts, lens, kv_starts, x, obs), work, obs
    (ref, ref_cache, ref_obs), (got, got_cache, got_obs) = results[DenseMixer], results[PagedMixer]
    assert torch.isfinite(got).all()  # NaN pages never leak
    assert torch.equal(got_cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))  # the same rows written
    assert rel_err(got, ref) <= 1e-5
    if ref_obs is not None:
        assert len(got_obs.calls) == len(ref_obs.calls) >= 1
        for (l_a, s_a, r_a, e_a), (l_b, s_b, r_b, e_b) in zip(got_obs.calls, ref_obs.calls):
            assert (l_a, s_a) == (l_b, s_b) and r_a.shape == r_b.shape
            assert rel_err(r_a, r_b) <= 1e-5
            assert (e_a is None) == (e_b is None)
            if e_a is not None:
                assert e_a.shape == e_b.shape and rel_err(e_a, e_b) <= 1e-5
    return got


layouts = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), block_tokens=st.sampled_from([3, 4, 8]), layout=layouts,
       tile_slots=st.sampled_from([1, 2, 3, 5, 8, 16]), num_extra=st.sampled_from([-1, 0, 5]),
       rope=st.booleans(), evicted=st.sampled_from([0, 6]))
def test_tiled_prefill_equals_the_dense_twin(seed, block_tokens, layout, tile_slots, num_extra, rope, evicted,
                                             monkeypatch):
    # num_extra: -1 no observer, 0 an observer without extra rows, 5 offloaded rows to merge.
    check_step(seed, block_tokens, layout, tile_slots, num_extra, rope, evicted, monkeypatch)


@pytest.mark.parametrize("tile_slots", [2, 1024])
def test_an_observer_without_extra_rows_leaves_the_output_bit_for_bit(tile_slots, monkeypatch):
    layout = [(0, 7), (13, 5), (29, 1), (4, 1), (0, 1)]  # two decodes, a 1-token prefill
    plain = check_step(3, 4, layout, tile_slots, -1, True, 0, monkeypatch)
    observed = check_step(3, 4, layout, tile_slots, 0, True, 0, monkeypatch)
    assert torch.equal(plain, observed)


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any op allocates (outputs that share no storage with an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.numel = max(self.numel, t.numel())
        return out


def largest_allocation(mixer_cls, context: int) -> int:
    """Largest tensor allocated by one MLA layer prefilling 4 tokens after `context` cached ones."""
    mla = layer(True)
    cache, tables, starts, lens, kv_starts, x = build(0, 4, [(context, 4)], 0)
    with LargestAllocation() as probe:
        run_step(mixer_cls, mla, cache, tables, starts, lens, kv_starts, x, None)
    return probe.numel


def test_the_peak_does_not_grow_with_the_context(monkeypatch):
    monkeypatch.setattr(models.paged, "PREFILL_TILE_SLOTS", 8)
    tiled = [largest_allocation(PagedMixer, n) for n in (100, 1000)]
    dense = [largest_allocation(DenseMixer, n) for n in (100, 1000)]
    assert tiled[0] == tiled[1] < dense[0] < dense[1]
    assert dense[1] >= 4 * 4 * 1000  # the probe sees the dense scores [1, Lq * H, S]
