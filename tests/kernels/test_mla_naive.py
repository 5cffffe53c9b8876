"""The absorbed MLA form must equal the expanded one, and both must equal a per-head
computation with torch's own scaled_dot_product_attention and an explicit causal mask."""

import pytest
import torch
import torch.nn.functional as F

from kernels.mla.naive import naive_mla_attention, naive_mla_attention_absorbed

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)

TOL = 1e-5
FORMS = [naive_mla_attention, naive_mla_attention_absorbed]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_inputs(T=5, H=3, S=12, Dn=8, Dr=4, Dc=16, Dv=6, *, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(T, H, Dn, generator=gen)  # [T, H, Dn]
    q_rope = torch.randn(T, H, Dr, generator=gen)  # [T, H, Dr]
    kv_latent = torch.randn(S, Dc + Dr, generator=gen)  # [S, Dc + Dr]
    w_uk = torch.randn(H, Dn, Dc, generator=gen) / Dc**0.5  # [H, Dn, Dc]
    w_uv = torch.randn(H, Dv, Dc, generator=gen) / Dc**0.5  # [H, Dv, Dc]
    return q_nope, q_rope, kv_latent, w_uk, w_uv


def reference_per_head(q_nope, q_rope, kv_latent, w_uk, w_uv, *, scale, q_start):
    """One head at a time, with F.scaled_dot_product_attention and a mask built by loops."""
    T, H, _ = q_nope.shape
    S, Dc = kv_latent.shape[0], w_uk.shape[-1]
    allowed = torch.zeros(T, S, dtype=torch.bool)  # [T, S]
    for i in range(T):
        for j in range(S):
            allowed[i, j] = j <= q_start + i
    outs = []
    for h in range(H):
        c, k_rope = kv_latent[:, :Dc], kv_latent[:, Dc:]
        k = torch.cat([c @ w_uk[h].T, k_rope], dim=-1)  # [S, Dn + Dr]
        v = c @ w_uv[h].T  # [S, Dv]
        q = torch.cat([q_nope[:, h], q_rope[:, h]], dim=-1)  # [T, Dn + Dr]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale))
    return torch.stack(outs, dim=1)  # [T, H, Dv]


CASES = [
    # (T, S, q_start, Dr): prefill, chunked prefill after a cached prefix, decode, cache
    # longer than the queries reach, NoPE.
    (6, 6, 0, 4),
    (5, 12, 7, 4),
    (1, 12, 11, 4),
    (1, 12, 3, 4),
    (6, 6, 0, 0),
    (4, 9, 5, 0),
    (1, 1, 0, 0),
]


@pytest.mark.parametrize("T, S, q_start, Dr", CASES)
def test_forms_match_reference(T, S, q_start, Dr):
    inputs = make_inputs(T=T, S=S, Dr=Dr)
    scale = 0.3
    ref = reference_per_head(*inputs, scale=scale, q_start=q_start)
    plain = naive_mla_attention(*inputs, scale=scale, q_start=q_start)
    absorbed = naive_mla_attention_absorbed(*inputs, scale=scale, q_start=q_start)
    assert plain.shape == (T, 3, 6)
    assert rel_err(plain, ref) <= TOL
    assert rel_err(absorbed, plain) <= TOL


@pytest.mark.parametrize("form", FORMS)
def test_rope_part_contributes(form):
    q_nope, q_rope, kv, w_uk, w_uv = make_inputs(T=3, S=8)
    o = form(q_nope, q_rope, kv, w_uk, w_uv, scale=0.5, q_start=5)
    o_no_rope = form(q_nope, 0 * q_rope, kv, w_uk, w_uv, scale=0.5, q_start=5)
    assert rel_err(o, o_no_rope) > 1e-2


@pytest.mark.parametrize("form", FORMS)
def test_causal_future_cache_entries_do_not_matter(form):
    q_nope, q_rope, kv, w_uk, w_uv = make_inputs(T=4, S=10)
    q_start = 3  # query i sits at position 3 + i
    o = form(q_nope, q_rope, kv, w_uk, w_uv, scale=0.4, q_start=q_start)
    for pos in range(10):
        kv2 = kv.clone()
        kv2[pos] += 5.0
        o2 = form(q_nope, q_rope, kv2, w_uk, w_uv, scale=0.4, q_start=q_start)
        for i in range(4):
            if pos > q_start + i:
                assert torch.equal(o2[i], o[i]), (pos, i)
            else:
                assert not torch.allclose(o2[i], o[i]), (pos, i)


@pytest.mark.parametrize("form", FORMS)
def test_chunked_prefill_equals_full_prefill(form):
    inputs = make_inputs(T=9, S=9)
    q_nope, q_rope, kv, w_uk, w_uv = inputs
    full = form(*inputs, scale=0.35, q_start=0)
    for a, b in [(0, 4), (4, 8), (8, 9)]:
        part = form(q_nope[a:b], q_rope[a:b], kv[:b], w_uk, w_uv, scale=0.35, q_start=a)
        assert rel_err(part, full[a:b]) <= TOL


@pytest.mark.parametrize("form", FORMS)
def test_dtype_and_empty(form):
    q_nope, q_rope, kv, w_uk, w_uv = make_inputs(T=2, S=4)
    o = form(q_nope.bfloat16(), q_rope.bfloat16(), kv.bfloat16(), w_uk, w_uv, scale=0.3, q_start=1)
    assert o.dtype == torch.bfloat16
    empty = form(q_nope[:0], q_rope[:0], kv, w_uk, w_uv, scale=0.3, q_start=4)
    assert empty.shape == (0, 3, 6)


@pytest.mark.parametrize("form", FORMS)
def test_bad_input_raises(form):
    q_nope, q_rope, kv, w_uk, w_uv = make_inputs(T=3, S=8)
    ok = dict(scale=0.3, q_start=5)
    with pytest.raises(ValueError, match=r"S=8 .* q_start \+ T = 9"):
        form(q_nope, q_rope, kv, w_uk, w_uv, scale=0.3, q_start=6)
    with pytest.raises(ValueError, match="q_start must be >= 0, got -1"):
        form(q_nope, q_rope, kv, w_uk, w_uv, scale=0.3, q_start=-1)
    with pytest.raises(ValueError, match=r"kv_latent shape \(8, 19\)"):
        form(q_nope, q_rope, kv[:, :19], w_uk, w_uv, **ok)
    with pytest.raises(ValueError, match=r"q_rope shape \(3, 2, 4\)"):
        form(q_nope, q_rope[:, :2], kv, w_uk, w_uv, **ok)
    with pytest.raises(ValueError, match=r"w_uk shape \(3, 7, 16\)"):
        form(q_nope, q_rope, kv, w_uk[:, :7], w_uv, **ok)
    with pytest.raises(ValueError, match=r"w_uv shape \(3, 6, 15\)"):
        form(q_nope, q_rope, kv, w_uk, w_uv[..., :15], **ok)
    with pytest.raises(ValueError, match=r"q_nope must be \[T, H, Dn\]"):
        form(q_nope[0], q_rope, kv, w_uk, w_uv, **ok)
