"""Paged absorbed MLA prefill in tiles: the torch path must equal plain causal attention over each
sequence's gathered cache whatever the tile size, never reading (or leaking) slots past a sequence's
end; its second pass must give exactly the softmax probabilities summed over heads and real rows;
the Triton kernel must equal the torch path."""

import pytest
import torch

from kernels.mla.naive import naive_mla_attention_absorbed
from kernels.mla.prefill import (attend_rows, attend_rows_weights, paged_mla_prefill, paged_mla_prefill_weights,
                                 tile_slots_for)
from kernels.mla.weights import dense_attention
from tests.kernels.test_mla_paged import DEVICE, make_paged, rel_err

TOL = 1e-5


def make_prefill(starts, lens, *, H=3, Dc=24, Dr=8, block_tokens=5, seed=0, **kw):
    """Pages holding each sequence's kv_starts + lens rows (everything else NaN) and right-padded
    queries. Returns (q_lat [B, Lq, H, Dc], q_rope [B, Lq, H, Dr], cache, tables, starts, lens,
    kv_per_seq)."""
    ends = [s + n for s, n in zip(starts, lens)]
    _, _, cache, tables, _, kv = make_paged(ends, H=H, Dc=Dc, Dr=Dr, block_tokens=block_tokens, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed + 100)
    width = max(lens)
    q_lat = torch.randn(len(lens), width, H, Dc, generator=gen).to(DEVICE)  # [B, Lq, H, Dc]
    q_rope = torch.randn(len(lens), width, H, Dr, generator=gen).to(DEVICE)  # [B, Lq, H, Dr]
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return q_lat, q_rope, cache, tables, as_t(starts), as_t(lens), kv


def reference(q_lat, q_rope, kv, start, num, scale):
    """Plain causal absorbed attention of one sequence's real rows: (o [num, H, Dc], lse [num, H],
    probs [num, H, S])."""
    Dc = q_lat.shape[-1]
    eye = torch.eye(Dc).expand(q_lat.shape[1], Dc, Dc)  # W_uk = W_uv = I: q_nope is q_lat, o is o_lat
    o = naive_mla_attention_absorbed(q_lat[:num].cpu(), q_rope[:num].cpu(), kv, eye, eye, scale=scale, q_start=start)
    q = torch.cat([q_lat[:num], q_rope[:num]], dim=-1).cpu()  # [num, H, W]
    scores = torch.einsum("thw,sw->ths", q, kv[:start + num]) * scale
    causal = torch.arange(start + num)[None, :] <= start + torch.arange(num)[:, None]  # [num, S]
    scores = scores.masked_fill(~causal[:, None, :], float("-inf"))
    return o, scores.logsumexp(-1), scores.softmax(-1)


LAYOUTS = [  # (kv_starts, lens): 1-token chunks, chunks after long contexts, one long chunk
    ([0, 7, 30, 3], [5, 1, 8, 1]),
    ([0], [23]),
    ([12, 0, 29], [1, 1, 11]),
]


@pytest.mark.parametrize("starts, lens", LAYOUTS)
@pytest.mark.parametrize("Dr, block_tokens", [(0, 4), (8, 5), (8, 16)])
@pytest.mark.parametrize("tile_slots", [1, 3, 8, 1024])
def test_tiles_equal_plain_causal_attention(starts, lens, Dr, block_tokens, tile_slots):
    scale = 0.37
    q_lat, q_rope, cache, tables, st, ln, kv = make_prefill(starts, lens, Dr=Dr, block_tokens=block_tokens)
    o, lse = paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln, scale=scale, tile_slots=tile_slots)
    assert o.shape == q_lat.shape and lse.shape == q_lat.shape[:3]
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()  # NaN pages past every end never leak
    for b, (start, num) in enumerate(zip(starts, lens)):
        ref_o, ref_lse, _ = reference(q_lat[b], q_rope[b], kv[b], start, num, scale)
        assert rel_err(o[b, :num].cpu(), ref_o) <= TOL, b
        assert rel_err(lse[b, :num].cpu(), ref_lse) <= TOL, b
    o_again, _ = paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln, scale=scale, tile_slots=tile_slots,
                                   check=False, max_end=max(s + n for s, n in zip(starts, lens)))
    assert torch.equal(o, o_again)  # the host-known max_end changes nothing


def test_tile_sizes_round_to_the_page():
    assert tile_slots_for(1024, 16) == 1024 and tile_slots_for(1000, 16) == 992
    assert tile_slots_for(2048, 6144) == 2048 and tile_slots_for(4, 6) == 3 and tile_slots_for(5, 7) == 1
    with pytest.raises(ValueError, match="tile_slots must be >= 1, got 0"):
        tile_slots_for(0, 16)


@pytest.mark.parametrize("tile_slots", [2, 5, 64])
def test_weights_are_the_softmax_summed_over_heads_and_real_rows(tile_slots):
    starts, lens, scale, H = [0, 7, 30, 3], [5, 1, 8, 2], 0.37, 3
    q_lat, q_rope, cache, tables, st, ln, kv = make_prefill(starts, lens, H=H, block_tokens=5)
    _, lse = paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln, scale=scale, tile_slots=tile_slots)
    max_end = max(s + n for s, n in zip(starts, lens))
    w = paged_mla_prefill_weights(q_lat, q_rope, cache, tables, st, ln, lse, scale=scale, max_end=max_end,
                                  tile_slots=tile_slots)
    assert w.shape == (4, 40)  # whole pages: ceil(38 / 5) * 5
    for b, (start, num) in enumerate(zip(starts, lens)):
        ref = reference(q_lat[b], q_rope[b], kv[b], start, num, scale)[2].sum(dim=(0, 1))  # [S]
        assert rel_err(w[b, :start + num].cpu(), ref) <= TOL, b
        assert torch.all(w[b, start + num:] == 0)
        assert abs(float(w[b].sum()) - H * num) <= 1e-4 * H * num  # each real row and head sums to 1


def test_rows_in_tiles_equal_dense_attention():
    gen = torch.Generator().manual_seed(4)
    B, R, M, W, Dc = 3, 10, 11, 12, 8
    q, kv = torch.randn(B, R, W, generator=gen), torch.randn(B, M, W, generator=gen)
    valid = torch.rand(B, M, generator=gen) < 0.6
    valid[2] = False  # nothing valid: o = 0, lse = -inf
    ref_o, ref_lse, scores = dense_attention(q, kv, valid, scale=0.5, value_dim=Dc)
    kv[~valid] = float("nan")  # invalid rows never leak
    row_weights = (torch.arange(R) < 7).float().expand(B, R)
    for tile in (1, 4, 64):
        o, lse = attend_rows(q, kv, valid, scale=0.5, value_dim=Dc, tile_slots=tile)
        assert rel_err(o[:2], ref_o[:2]) <= TOL and torch.all(o[2] == 0)
        assert torch.equal(lse.isinf(), ref_lse.isinf()) and rel_err(lse[:2], ref_lse[:2]) <= TOL
        w = attend_rows_weights(q, kv, valid, ref_lse.clamp_min(0.0), row_weights, scale=0.5, tile_slots=tile)
        ref_w = torch.einsum("brm,br->bm", (scores - ref_lse.clamp_min(0.0)[..., None]).exp(), row_weights)
        assert rel_err(w, ref_w) <= TOL and torch.all(w[~valid] == 0)


def test_bad_inputs_raise():
    q_lat, q_rope, cache, tables, st, ln, _ = make_prefill([0, 7], [5, 2], H=3, Dc=24, Dr=8, block_tokens=5)
    kw = dict(scale=0.5)
    with pytest.raises(ValueError, match=r"q_lat must be \[B, Lq, H, Dc\]"):
        paged_mla_prefill(q_lat[0], q_rope, cache, tables, st, ln, **kw)
    with pytest.raises(ValueError, match="q_rope shape"):
        paged_mla_prefill(q_lat, q_rope[:, :, :2], cache, tables, st, ln, **kw)
    with pytest.raises(ValueError, match=r"cache shape .* \[num_pages, block_tokens, 32\]"):
        paged_mla_prefill(q_lat, q_rope, cache[..., :31], tables, st, ln, **kw)
    with pytest.raises(ValueError, match="lens dtype must be int32 or int64, got torch.float32"):
        paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln.float(), **kw)
    with pytest.raises(ValueError, match="kv_starts shape"):
        paged_mla_prefill(q_lat, q_rope, cache, tables, st[:1], ln, **kw)
    with pytest.raises(ValueError, match="lens must be >= 1 .* got 0"):
        paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln * 0, **kw)
    with pytest.raises(ValueError, match="lens must be <= Lq = 5 .* got 6"):
        paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln + 1, **kw)
    with pytest.raises(ValueError, match="kv_starts must be >= 0, got -1"):
        paged_mla_prefill(q_lat, q_rope, cache, tables, st - 1, ln, **kw)
    capacity = tables.shape[1] * 5
    with pytest.raises(ValueError, match=f"kv_starts \\+ lens = {capacity + 2} exceeds .* = {capacity}"):
        paged_mla_prefill(q_lat, q_rope, cache, tables, st + capacity - 7, ln, **kw)
    holes = tables.clone()
    holes[1, 1] = -1
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = -1 is not a page id"):
        paged_mla_prefill(q_lat, q_rope, cache, holes, st, ln, **kw)
    with pytest.raises(ValueError, match="impl must be one of .* got 'fast'"):
        paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln, impl="fast", **kw)


@pytest.mark.triton
@pytest.mark.parametrize("starts, lens, H, Dc, Dr, block_tokens", [
    ([0, 7, 30, 3], [5, 1, 8, 1], 3, 24, 8, 5),  # rows of several positions share a program
    ([12, 0], [1, 3], 2, 16, 0, 4),  # NoPE
    ([0, 18], [4, 2], 17, 20, 4, 16),  # H > 16: a program's rows straddle positions; odd Dc, Dr
])
def test_triton_matches_torch(starts, lens, H, Dc, Dr, block_tokens):
    q_lat, q_rope, cache, tables, st, ln, _ = make_prefill(starts, lens, H=H, Dc=Dc, Dr=Dr,
                                                            block_tokens=block_tokens, seed=1)
    o_n, lse_n = paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln, scale=0.3, tile_slots=3)
    o_t, lse_t = paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln, scale=0.3, impl="triton")
    assert o_t.dtype == o_n.dtype and torch.isfinite(o_t).all()
    assert rel_err(o_t, o_n) <= TOL and rel_err(lse_t, lse_n) <= TOL  # padded rows included


@pytest.mark.triton
def test_triton_peaked_softmax():
    # Large scores: the online softmax must rescale without overflow as the max moves.
    q_lat, q_rope, cache, tables, st, ln, _ = make_prefill([25, 0], [6, 3], H=2, seed=2)
    o_n, _ = paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln, scale=4.0, tile_slots=4)
    o_t, _ = paged_mla_prefill(q_lat, q_rope, cache, tables, st, ln, scale=4.0, impl="triton")
    assert torch.isfinite(o_t).all() and rel_err(o_t, o_n) <= TOL
