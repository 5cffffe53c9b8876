"""Paged absorbed MLA decode: the naive path must equal the reference absorbed attention on
each sequence's gathered cache, and the Triton kernel must equal the naive path, reading the
pool only through the block table (poisoned slots and table entries past a sequence stay
unread)."""

import pytest
import torch

from kernels.impl import IMPLS, check_impl, default_impl
from kernels.mla.naive import naive_mla_attention_absorbed
from kernels.mla.paged import paged_mla_decode

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

TOL = 1e-5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_paged(
    seq_lens, *, H=3, Dc=24, Dr=8, block_tokens=5, spare_pages=3, seed=0, table_dtype=torch.int32,
    fill=float("nan"),
):
    """A page pool holding each sequence's latent rows on shuffled pages.

    Returns (q_lat, q_rope, cache, block_tables, seq_lens, kv_per_seq). The cache is a
    non-contiguous view into a flat buffer whose page stride exceeds a page's rows; every
    element no sequence needs (tail slots, spare pages, page padding) is `fill` (NaN unless told
    otherwise), and block-table
    entries past a sequence's pages are -1 or a huge id, so reading any of them shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    L = Dc + Dr
    num_blocks = [-(-s // block_tokens) for s in seq_lens]
    num_pages = sum(num_blocks) + spare_pages
    page_elems = block_tokens * L + 11  # page stride larger than the layer's rows
    offset = 3  # the layer does not start at the page start
    buf = torch.full((num_pages, page_elems + offset), fill)  # [num_pages, page_elems]
    cache = buf[:, offset : offset + block_tokens * L].view(num_pages, block_tokens, L)
    max_blocks = max(num_blocks) + 2
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int64)
    block_tables[:, -1] = 10**6 if table_dtype == torch.int64 else 2**31 - 1  # never read
    pages = torch.randperm(num_pages, generator=gen).tolist()
    kv_per_seq = []
    for b, (seq_len, n) in enumerate(zip(seq_lens, num_blocks)):
        kv = torch.randn(seq_len, L, generator=gen)  # [S, Dc + Dr]
        kv_per_seq.append(kv)
        own, pages = pages[:n], pages[n:]
        block_tables[b, :n] = torch.tensor(own)
        for t in range(seq_len):
            cache[own[t // block_tokens], t % block_tokens] = kv[t]
    q_lat = torch.randn(len(seq_lens), H, Dc, generator=gen)  # [B, H, Dc]
    q_rope = torch.randn(len(seq_lens), H, Dr, generator=gen)  # [B, H, Dr]
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)  # [B]
    buf = buf.to(DEVICE)  # move the buffer, not the view: .to() would compact the view
    cache = buf[:, offset : offset + block_tokens * L].view(num_pages, block_tokens, L)
    assert not cache.is_contiguous()
    block_tables = block_tables.to(table_dtype)
    moved = (x.to(DEVICE) for x in (q_lat, q_rope, block_tables, seq_lens_t))
    q_lat, q_rope, block_tables, seq_lens_t = moved
    return q_lat, q_rope, cache, block_tables, seq_lens_t, kv_per_seq


@pytest.mark.parametrize("Dr", [0, 8])
@pytest.mark.parametrize("block_tokens", [4, 5])
def test_naive_matches_reference_on_gathered_cache(Dr, block_tokens):
    seq_lens = [1, 5, 17, 30, 8]
    Dc, H, scale = 24, 3, 0.37
    q_lat, q_rope, cache, tables, lens, kv_per_seq = make_paged(
        seq_lens, H=H, Dc=Dc, Dr=Dr, block_tokens=block_tokens
    )
    o = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale)
    assert o.shape == (len(seq_lens), H, Dc) and o.dtype == q_lat.dtype
    eye = torch.eye(Dc).expand(H, Dc, Dc)  # W_uk = W_uv = I: q_nope is q_lat, o is o_lat
    for b, seq_len in enumerate(seq_lens):
        ref = naive_mla_attention_absorbed(
            q_lat[b : b + 1].cpu(),
            q_rope[b : b + 1].cpu(),
            kv_per_seq[b],
            eye,
            eye,
            scale=scale,
            q_start=seq_len - 1,
        )  # [1, H, Dc]
        assert rel_err(o[b : b + 1].cpu(), ref) <= TOL, b


@pytest.mark.parametrize("fill", [1e30, -3.0, float("inf")])
def test_garbage_past_seq_len_never_leaks(fill):
    # The naive path skips clearing unused slots when everything it gathered is finite (huge or
    # not); with an inf it clears them. Either way the output is the NaN-garbage one.
    args = dict(H=2, Dc=16, Dr=4, block_tokens=4, seed=3)
    expected = paged_mla_decode(*make_paged([3, 9, 1], **args)[:5], scale=0.4)
    got = paged_mla_decode(*make_paged([3, 9, 1], fill=fill, **args)[:5], scale=0.4)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_nan_in_a_real_slot_reaches_the_output():
    q_lat, q_rope, cache, tables, lens, _ = make_paged([6, 4], H=2, fill=0.0)
    cache[tables[1, 0], 2, 0] = float("nan")  # a cached token of sequence 1
    o = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.5)
    assert torch.isfinite(o[0]).all() and torch.isnan(o[1]).all()


@pytest.mark.triton
@pytest.mark.parametrize(
    "Dr, Dc, H, block_tokens, table_dtype",
    [
        (0, 16, 2, 4, torch.int32),
        (8, 24, 3, 5, torch.int64),
        (4, 20, 17, 16, torch.int32),  # H > 16: two head blocks; Dr, Dc not powers of two
    ],
)
def test_triton_matches_naive(Dr, Dc, H, block_tokens, table_dtype):
    seq_lens = [1, 5, 17, 30]
    q_lat, q_rope, cache, tables, lens, _ = make_paged(
        seq_lens, H=H, Dc=Dc, Dr=Dr, block_tokens=block_tokens, table_dtype=table_dtype, seed=1
    )
    expected = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3, impl="naive")
    got = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3, impl="triton")
    assert got.dtype == expected.dtype
    assert rel_err(got, expected) <= TOL


@pytest.mark.triton
def test_triton_peaked_softmax():
    # Large scores: the online softmax must rescale without overflow as the max moves.
    q_lat, q_rope, cache, tables, lens, _ = make_paged([30, 17], H=2, seed=2)
    expected = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=4.0)
    got = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=4.0, impl="triton")
    assert torch.isfinite(got).all()
    assert rel_err(got, expected) <= TOL


# Split-KV decode (one program per sequence x split x 64-head tile, 64-token tiles): odd head
# counts (3 -> one 16-head tile, 20 -> one 32-head tile, 70 -> two 64-head tiles), mixed lengths
# around the tile size, pages shorter than, equal to and longer than a tile, forced split counts
# whose trailing splits hold no token of the shorter (or of any) sequence.
SPLIT_LENS = [1, 17, 63, 65, 200]


@pytest.mark.triton
@pytest.mark.parametrize(
    "H, block_tokens, num_splits, max_seq_len",
    [
        (3, 16, None, None), (3, 64, 1, 200), (3, 64, 5, 200), (3, 32, 5, None),
        (20, 16, 2, 200), (20, 64, None, 200), (20, 16, 5, None), (20, 128, 2, 200),
        (70, 64, 2, 200), (70, 16, 1, None), (70, 64, 5, None), (70, 16, None, 200),
    ],
)
def test_triton_split_kv_matches_naive(H, block_tokens, num_splits, max_seq_len):
    q_lat, q_rope, cache, tables, lens, _ = make_paged(
        SPLIT_LENS, H=H, Dc=32, Dr=16, block_tokens=block_tokens, seed=H + block_tokens
    )  # every slot no sequence owns is NaN: reading one would poison its heads
    o_n, lse_n = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3, return_lse=True)
    o_t, lse_t = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3, return_lse=True, impl="triton",
                                  check=False, max_seq_len=max_seq_len, num_splits=num_splits)
    assert o_t.dtype == o_n.dtype and lse_t.shape == lse_n.shape == (len(SPLIT_LENS), H)
    assert torch.isfinite(o_t).all() and torch.isfinite(lse_t).all()
    err_o, err_lse = rel_err(o_t, o_n), rel_err(lse_t, lse_n)
    print(f"H={H} block_tokens={block_tokens} num_splits={num_splits}: rel err o {err_o:.2e}, lse {err_lse:.2e}")
    assert err_o <= TOL and err_lse <= TOL


@pytest.mark.triton
def test_split_partials_past_the_end_weigh_nothing():
    # Forced 5 splits of 64 tokens over lengths up to 200: split s holds tokens [64 s, 64 s + 64).
    # Splits at or past a sequence's end must give o = 0, lse = -inf; merging all partials with
    # the combine's torch twin (merge_attention) must give the naive result.
    from kernels.mla.paged import _decode_partials
    from kernels.mla.split_kv import combine_splits_naive, plan_splits

    H, Dc = 3, 32
    q_lat, q_rope, cache, tables, lens, _ = make_paged(SPLIT_LENS, H=H, Dc=Dc, Dr=16, block_tokens=16, seed=4)
    plan = plan_splits(len(SPLIT_LENS), H, 200, 16, num_splits=5)
    assert plan.split_len == 64
    part_o = torch.full((len(SPLIT_LENS), 5, H, Dc), float("nan"))  # [B, S, H, Dc]: all must be written
    part_lse = torch.full((len(SPLIT_LENS), 5, H), float("nan"))  # [B, S, H]
    _decode_partials(q_lat, q_rope, cache, tables, lens, 0.3, plan, part_o, part_lse)
    for b, seq_len in enumerate(SPLIT_LENS):
        used = -(-seq_len // 64)
        assert torch.isfinite(part_lse[b, :used]).all() and torch.isfinite(part_o[b, :used]).all(), b
        assert torch.all(part_lse[b, used:] == float("-inf")) and torch.all(part_o[b, used:] == 0), b
    o, lse = combine_splits_naive(part_o, part_lse)
    o_n, lse_n = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3, return_lse=True)
    assert rel_err(o, o_n) <= TOL and rel_err(lse, lse_n) <= TOL


@pytest.mark.triton
def test_triton_short_max_seq_len_still_covers_every_token():
    # The splits are planned from max_seq_len; a value below the true longest length must not
    # drop tokens (the last split runs to each sequence's end). check=True rejects it outright.
    q_lat, q_rope, cache, tables, lens, _ = make_paged([65, 200], H=3, Dc=32, Dr=16, block_tokens=16, seed=5)
    expected = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3)
    got = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3, impl="triton", check=False,
                           max_seq_len=70, num_splits=2)
    assert rel_err(got, expected) <= TOL
    with pytest.raises(ValueError, match="seq_len 200 exceeds the max_seq_len=70 given"):
        paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3, impl="triton", max_seq_len=70)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_bf16_cache_on_gpu_without_host_sync():
    # The bf16 path (bf16 x bf16 dots, fp32 accumulation) cannot be checked under the interpreter
    # (its bf16 tl.dot is wrong). Reference: the naive path on the same bf16 cache and queries
    # rounded to bf16 as the kernel rounds them; the gap left is p rounded to bf16 in p @ c_kv.
    # At 64 heads x 512 + 64 (the real width); no host sync with check=False and max_seq_len.
    q_lat, q_rope, cache, tables, lens, _ = make_paged(
        [1, 63, 65, 200, 1000], H=64, Dc=512, Dr=64, block_tokens=64, fill=0.0
    )
    cache = cache.to(torch.bfloat16)
    q_lat, q_rope = q_lat / 8, q_rope / 8  # keep the softmax from collapsing onto one token
    expected = paged_mla_decode(q_lat.bfloat16().float(), q_rope.bfloat16().float(), cache, tables, lens,
                                scale=0.3)
    for num_splits in (None, 1, 3):
        # The first launch per shape autotunes (it times configs: host syncs); later ones must not.
        paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3, impl="triton", num_splits=num_splits)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.3, impl="triton", check=False,
                                   max_seq_len=1000, num_splits=num_splits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert rel_err(got, expected) <= 1e-2, num_splits


def test_inputs_not_mutated():
    q_lat, q_rope, cache, tables, lens, _ = make_paged([5, 9])
    before = [x.clone() for x in (q_lat, q_rope, cache, tables, lens)]
    for impl in IMPLS:
        paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.5, impl=impl)
        for x, y in zip((q_lat, q_rope, cache, tables, lens), before):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_bad_inputs_raise():
    q_lat, q_rope, cache, tables, lens, _ = make_paged([5, 9], H=3, Dc=24, Dr=8, block_tokens=5)
    kw = dict(scale=0.5)
    with pytest.raises(ValueError, match=r"q_lat must be \[B, H, Dc\]"):
        paged_mla_decode(q_lat[0], q_rope, cache, tables, lens, **kw)
    with pytest.raises(ValueError, match="q_rope shape"):
        paged_mla_decode(q_lat, q_rope[:, :2], cache, tables, lens, **kw)
    with pytest.raises(ValueError, match=r"cache shape .* \[num_pages, block_tokens, 32\]"):
        paged_mla_decode(q_lat, q_rope, cache[..., :31], tables, lens, **kw)
    with pytest.raises(ValueError, match="block_tables dtype .* torch.float32"):
        paged_mla_decode(q_lat, q_rope, cache, tables.float(), lens, **kw)
    with pytest.raises(ValueError, match="block_tables shape"):
        paged_mla_decode(q_lat, q_rope, cache, tables[:1], lens, **kw)
    with pytest.raises(ValueError, match="seq_lens shape"):
        paged_mla_decode(q_lat, q_rope, cache, tables, lens[:1], **kw)
    with pytest.raises(ValueError, match="seq_lens must be >= 1.* got 0"):
        paged_mla_decode(q_lat, q_rope, cache, tables, torch.zeros_like(lens), **kw)
    capacity = tables.shape[1] * 5
    too_long = torch.full_like(lens, capacity + 1)
    with pytest.raises(ValueError, match=f"seq_len {capacity + 1} exceeds .* = {capacity}"):
        paged_mla_decode(q_lat, q_rope, cache, tables, too_long, **kw)
    holes = tables.clone()
    holes[1, 0] = -1
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = -1 is not a page id"):
        paged_mla_decode(q_lat, q_rope, cache, holes, lens, **kw)
    with pytest.raises(ValueError, match="impl must be one of .* got 'cuda'"):
        paged_mla_decode(q_lat, q_rope, cache, tables, lens, impl="cuda", **kw)


def test_impl_switch():
    assert check_impl("naive") == "naive" and check_impl("triton") == "triton" and check_impl("cpu") == "cpu"
    with pytest.raises(ValueError, match=r"impl must be one of \('naive', 'triton', 'cpu'\), got 'fast'"):
        check_impl("fast")
    # CPU: the fused C++ kernels build on this machine (g++ is part of the set-up).
    assert default_impl() == ("triton" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_without_interpreter_raises(monkeypatch):
    q_lat, q_rope, cache, tables, lens, _ = make_paged([5])
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=0.5, impl="triton")
