"""Reference MLA (multi-head latent attention) over one sequence's latent cache, plain fp32 torch.

MLA (DeepSeek-V2, arXiv:2405.04434, Sec. 2.1) caches per token only a compressed latent
c_kv (Dc) and one RoPE key k_rope (Dr) shared by all heads; Dr = 0 is the NoPE variant
Kimi Linear uses in its MLA layers (arXiv:2510.26692). Per head h:
    k_h = [W_uk[h] c_kv, k_rope]        v_h = W_uv[h] c_kv        q_h = [q_nope_h, q_rope_h]

Two equivalent forms:
- `naive_mla_attention` expands keys and values for every cached token (what prefill does).
- `naive_mla_attention_absorbed` folds W_uk into the query and W_uv into the output
  ("weight absorption", DeepSeek-V2 Sec. 2.1.2), so attention runs in the Dc-dim latent
  space and per-head keys are never built (what decode does).

Causality: the cache holds tokens 0..S-1; query i is token q_start + i and attends cache
positions 0..q_start + i. This covers prefill (q_start = 0), chunked prefill after a cached
prefix (q_start > 0) and single-token decode (T = 1, q_start = S - 1).
"""

import operator

import torch
from torch import Tensor


def _check_inputs(q_nope, q_rope, kv_latent, w_uk, w_uv, q_start) -> tuple[int, ...]:
    """Validates shapes and q_start; returns (T, H, Dn, Dr, Dc, Dv, S, q_start)."""
    if q_nope.dim() != 3:
        raise ValueError(f"q_nope must be [T, H, Dn], got shape {tuple(q_nope.shape)}")
    T, H, Dn = q_nope.shape
    if q_rope.dim() != 3 or tuple(q_rope.shape[:2]) != (T, H):
        raise ValueError(f"q_rope shape {tuple(q_rope.shape)} must be [T, H, Dr] = [{T}, {H}, Dr]")
    Dr = q_rope.shape[2]
    if w_uk.dim() != 3 or tuple(w_uk.shape[:2]) != (H, Dn):
        raise ValueError(f"w_uk shape {tuple(w_uk.shape)} must be [H, Dn, Dc] = [{H}, {Dn}, Dc]")
    Dc = w_uk.shape[2]
    if w_uv.dim() != 3 or w_uv.shape[0] != H or w_uv.shape[2] != Dc:
        raise ValueError(f"w_uv shape {tuple(w_uv.shape)} must be [H, Dv, Dc] = [{H}, Dv, {Dc}]")
    Dv = w_uv.shape[1]
    if kv_latent.dim() != 2 or kv_latent.shape[1] != Dc + Dr:
        raise ValueError(
            f"kv_latent shape {tuple(kv_latent.shape)} must be [S, Dc + Dr] = [S, {Dc + Dr}]"
        )
    S = kv_latent.shape[0]
    try:
        q_start = operator.index(q_start)
    except TypeError:
        raise ValueError(f"q_start must be an int, got {q_start!r}") from None
    if q_start < 0:
        raise ValueError(f"q_start must be >= 0, got {q_start}")
    if S < q_start + T:
        raise ValueError(
            f"cache holds S={S} tokens but queries reach position q_start + T = {q_start + T}"
        )
    return T, H, Dn, Dr, Dc, Dv, S, q_start


def _causal_mask(T: int, S: int, q_start: int, device) -> Tensor:
    """[T, S] bool, True where query i (token q_start + i) may attend cache position j."""
    query_pos = torch.arange(T, device=device).unsqueeze(1) + q_start  # [T, 1]
    cache_pos = torch.arange(S, device=device).unsqueeze(0)  # [1, S]
    return cache_pos <= query_pos  # [T, S]


def naive_mla_attention(
    q_nope: Tensor,
    q_rope: Tensor,
    kv_latent: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    *,
    scale: float,
    q_start: int,
) -> Tensor:
    """MLA with keys and values expanded per head for all S cached tokens.

    Args:
        q_nope: [T, H, Dn] query part that meets W_uk c_kv.
        q_rope: [T, H, Dr] query part that meets the shared k_rope (Dr may be 0).
        kv_latent: [S, Dc + Dr] the cache, [c_kv, k_rope] per token. Not mutated.
        w_uk: [H, Dn, Dc] key up-projection; Dc is read from here.
        w_uv: [H, Dv, Dc] value up-projection.
        scale: softmax scale applied to q . k.
        q_start: absolute position of query 0; requires S >= q_start + T.

    Returns:
        o: [T, H, Dv] in q_nope's dtype (math in fp32).
    """
    T, H, Dn, Dr, Dc, Dv, S, q_start = _check_inputs(q_nope, q_rope, kv_latent, w_uk, w_uv, q_start)
    f32 = torch.float32
    c_kv = kv_latent[:, :Dc].to(f32)  # [S, Dc]
    k_rope = kv_latent[:, Dc:].to(f32)  # [S, Dr]
    k_nope = torch.einsum("hnc,sc->hsn", w_uk.to(f32), c_kv)  # [H, S, Dn]
    k = torch.cat([k_nope, k_rope.expand(H, S, Dr)], dim=-1)  # [H, S, Dn + Dr]
    v = torch.einsum("hvc,sc->hsv", w_uv.to(f32), c_kv)  # [H, S, Dv]
    q = torch.cat([q_nope.to(f32), q_rope.to(f32)], dim=-1).transpose(0, 1)  # [H, T, Dn + Dr]
    scores = (q @ k.transpose(-1, -2)) * scale  # [H, T, S]
    scores = scores.masked_fill(~_causal_mask(T, S, q_start, q.device), float("-inf"))
    o = scores.softmax(dim=-1) @ v  # [H, T, Dv]
    return o.transpose(0, 1).to(q_nope.dtype)  # [T, H, Dv]


def naive_mla_attention_absorbed(
    q_nope: Tensor,
    q_rope: Tensor,
    kv_latent: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    *,
    scale: float,
    q_start: int,
) -> Tensor:
    """MLA with W_uk absorbed into the query and W_uv into the output; same contract as
    `naive_mla_attention`.

    q_nope_h . (W_uk[h] c) = (W_uk[h]^T q_nope_h) . c, so scores need only the latent c_kv;
    and sum_j p_j W_uv[h] c_j = W_uv[h] (sum_j p_j c_j), so values stay latent until the end.
    Per-head keys ([H, S, Dn]) are never formed, which is the point for long caches at decode.
    """
    T, H, Dn, Dr, Dc, Dv, S, q_start = _check_inputs(q_nope, q_rope, kv_latent, w_uk, w_uv, q_start)
    f32 = torch.float32
    c_kv = kv_latent[:, :Dc].to(f32)  # [S, Dc]
    k_rope = kv_latent[:, Dc:].to(f32)  # [S, Dr]
    q_lat = torch.einsum("thn,hnc->thc", q_nope.to(f32), w_uk.to(f32))  # [T, H, Dc]
    scores = torch.einsum("thc,sc->hts", q_lat, c_kv)  # [H, T, S]
    scores = scores + torch.einsum("thr,sr->hts", q_rope.to(f32), k_rope)
    scores = (scores * scale).masked_fill(~_causal_mask(T, S, q_start, c_kv.device), float("-inf"))
    o_lat = scores.softmax(dim=-1) @ c_kv  # [H, T, Dc]
    o = torch.einsum("htc,hvc->thv", o_lat, w_uv.to(f32))  # [T, H, Dv]
    return o.to(q_nope.dtype)
