"""Kernel sections of the GPU check: each Triton kernel against its torch reference (impl="naive")
in fp32 and bf16 at Kimi-Linear-48B shapes (KDA: 32 heads, K = V = 128; MLA: 32 heads, latent 512 +
rope 64, 64-token pages), with its time, GB/s or TFLOP/s and the fraction of the H200 roofline.
Small shapes (--small, the CPU test) keep heads odd and lengths off the chunk grid.

Figure names: err_<what>_<dtype>[_<case>] (relative error vs the reference), ms_* (median time of
ours), torch_ms_* (the reference's), speedup_vs_torch_*, gb_s_*, hbm_fraction_*, tflop_s_*,
peak_fraction_* (docs/gpu_check.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tools.check_common import (Ctx, Parts, gb_s, hbm_fraction, kda_chunk_flops, kda_decode_bytes, mla_decode_bytes,
                                mla_decode_flops, peak_fraction, rel_err, tflop_s)

KIMI_KDA = (32, 128, 128)
"""(heads, K, V) of Kimi-Linear-48B's KDA layers."""
KIMI_MLA = (32, 512, 64, 128)
"""(heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim) of its MLA layers."""
PAGE_TOKENS = 64
"""Tokens per MLA page (FlashMLA's page size)."""


def kda_dims(ctx: Ctx) -> tuple[int, int, int]:
    return (3, 32, 32) if ctx.small else KIMI_KDA


def mla_dims(ctx: Ctx) -> tuple[int, int, int, int]:
    return (3, 64, 16, 16) if ctx.small else KIMI_MLA


def kda_inputs(ctx: Ctx, gen, B: int, T: int, dt: torch.dtype):
    """q, k [B, T, H, K] (L2-normalised), v [B, T, H, V] in dt; g [B, T, H, K] fp32 log-decay;
    beta [B, T, H] in dt; h0 [B, H, K, V] fp32."""
    H, K, V = kda_dims(ctx)
    q = F.normalize(ctx.randn(gen, B, T, H, K), dim=-1).to(dt)
    k = F.normalize(ctx.randn(gen, B, T, H, K), dim=-1).to(dt)
    v = ctx.randn(gen, B, T, H, V, dtype=dt)
    g = F.logsigmoid(ctx.randn(gen, B, T, H, K))
    beta = torch.sigmoid(ctx.randn(gen, B, T, H)).to(dt)
    h0 = ctx.randn(gen, B, H, K, V) * 0.1
    return q, k, v, g, beta, h0


def mla_inputs(ctx: Ctx, gen, B: int, max_len: int, fixed: bool, dt: torch.dtype):
    """(q_lat [B, H, Dc], q_rope [B, H, Dr], cache [pages, 64, Dc + Dr], tables [B, blocks] int32 in a
    random page order, seq_lens [B] int32 (all max_len if fixed, else in [max_len / 2, max_len]))."""
    H, Dc, Dr, _ = mla_dims(ctx)
    blocks = -(-max_len // PAGE_TOKENS)
    num_pages = B * blocks + 1
    cache = ctx.randn(gen, num_pages, PAGE_TOKENS, Dc + Dr, dtype=dt)
    perm = torch.randperm(num_pages, generator=gen, device=ctx.device)
    tables = perm[:B * blocks].view(B, blocks).to(torch.int32)
    if fixed:
        lens = torch.full((B,), max_len, dtype=torch.int32, device=ctx.device)
    else:
        lens = torch.randint(max(1, max_len // 2), max_len + 1, (B,), generator=gen, device=ctx.device,
                             dtype=torch.int32)
    return ctx.randn(gen, B, H, Dc, dtype=dt), ctx.randn(gen, B, H, Dr, dtype=dt), cache, tables, lens


def mla_scale(ctx: Ctx) -> float:
    """Softmax scale of absorbed MLA: the head dim before absorption, (nope + rope) ** -0.5."""
    _, _, Dr, nope = mla_dims(ctx)
    return (nope + Dr) ** -0.5


def _timed(ctx: Ctx, figures, suffix: str, ours, reference) -> float:
    """Times ours and the torch reference; records ms_, torch_ms_ and speedup_vs_torch_; returns ms."""
    ms = ctx.bench_ms(ours)
    torch_ms = ctx.bench_ms(reference, rep_ms=50)
    figures[f"ms_{suffix}"] = ms
    figures[f"torch_ms_{suffix}"] = torch_ms
    figures[f"speedup_vs_torch_{suffix}"] = torch_ms / ms
    return ms


def per_dtype(ctx: Ctx, figures, seed: int, body) -> None:
    """`body(ctx, figures, gen, dtype, tag)` once per dtype of the run, each guarded on its own (Parts)."""
    gen, parts = ctx.generator(seed), Parts(figures)
    for dt, tag in ctx.dtypes:
        parts.run(tag, lambda: body(ctx, figures, gen, dt, tag))
    parts.done()


def kda_decode(ctx: Ctx, figures) -> None:
    """KDA decode step (kernels.kda.decode): B sequences' states updated in their pool pages."""
    per_dtype(ctx, figures, 1, _kda_decode)


def _kda_decode(ctx: Ctx, figures, gen, dt: torch.dtype, tag: str) -> None:
    from kernels.kda.decode import kda_decode_step

    H, K, V = kda_dims(ctx)
    B, num_pages = (5, 11) if ctx.small else (256, 512)
    state = ctx.randn(gen, num_pages, H, K, V) * 0.1  # [num_pages, H, K, V] fp32
    pages = torch.randperm(num_pages, generator=gen, device=ctx.device)[:B]
    q, k = (F.normalize(ctx.randn(gen, B, H, K), dim=-1).to(dt) for _ in range(2))
    v, g = ctx.randn(gen, B, H, V, dtype=dt), F.logsigmoid(ctx.randn(gen, B, H, K))
    beta = torch.sigmoid(ctx.randn(gen, B, H)).to(dt)
    s_ref, s_out = state.clone(), state.clone()
    o_ref = kda_decode_step(q, k, v, g, beta, s_ref, pages, impl="naive")
    o = kda_decode_step(q, k, v, g, beta, s_out, pages, impl="triton", check=False)
    figures[f"err_o_{tag}"] = rel_err(o, o_ref)
    figures[f"err_state_{tag}"] = rel_err(s_out[pages], s_ref[pages])
    others = torch.ones(num_pages, dtype=torch.bool, device=ctx.device)
    others[pages] = False
    figures[f"other_pages_untouched_{tag}"] = bool(torch.equal(s_out[others], state[others]))
    ms = _timed(ctx, figures, tag, lambda: kda_decode_step(q, k, v, g, beta, s_out, pages, impl="triton", check=False),
                lambda: kda_decode_step(q, k, v, g, beta, s_ref, pages, impl="naive", check=False))
    num_bytes = kda_decode_bytes(B, H, K, V, q.element_size())
    figures[f"gb_s_{tag}"] = gb_s(num_bytes, ms)
    figures[f"hbm_fraction_{tag}"] = hbm_fraction(num_bytes, ms)


def _mla_cases(ctx: Ctx) -> tuple[tuple[str, int, int, bool], ...]:
    """(case, B, max_len, fixed lengths): the acceptance shape, then few sequences of long context."""
    if ctx.small:
        return (("B5_ctx200", 5, 200, False),)
    return (("B64_ctx8192", 64, 8192, True), ("B4_ctx32768", 4, 32768, False))


def mla_decode(ctx: Ctx, figures) -> None:
    """Paged MLA decode (kernels.mla.paged): one token per sequence over its paged latent cache."""
    gen, parts = ctx.generator(2), Parts(figures)
    for dt, tag in ctx.dtypes:
        for case in _mla_cases(ctx):
            parts.run(f"{tag}_{case[0]}", lambda: _mla_decode(ctx, figures, gen, dt, tag, *case))
    parts.done()


def _mla_decode(ctx: Ctx, figures, gen, dt: torch.dtype, tag: str, case: str, B: int, max_len: int,
                fixed: bool) -> None:
    from kernels.mla.paged import paged_mla_decode

    H, Dc, Dr, _ = mla_dims(ctx)
    scale = mla_scale(ctx)
    q_lat, q_rope, cache, tables, lens = args = mla_inputs(ctx, gen, B, max_len, fixed, dt)
    ref, lse_ref = paged_mla_decode(*args, scale=scale, impl="naive", return_lse=True)
    out, lse = paged_mla_decode(*args, scale=scale, impl="triton", check=False, return_lse=True)
    suffix = f"{tag}_{case}"
    figures[f"err_o_{suffix}"] = rel_err(out, ref)
    figures[f"err_lse_{suffix}"] = rel_err(lse, lse_ref)
    ms = _timed(ctx, figures, suffix, lambda: paged_mla_decode(*args, scale=scale, impl="triton", check=False),
                lambda: paged_mla_decode(*args, scale=scale, impl="naive", check=False, max_seq_len=max_len))
    total = int(lens.sum())
    num_bytes = mla_decode_bytes(total, B, H, Dc, Dr, cache.element_size(), q_lat.element_size())
    figures[f"gb_s_{suffix}"] = gb_s(num_bytes, ms)
    figures[f"hbm_fraction_{suffix}"] = hbm_fraction(num_bytes, ms)
    figures[f"tflop_s_{suffix}"] = tflop_s(mla_decode_flops(total, H, Dc, Dr), ms)


def mla_weights(ctx: Ctx, figures) -> None:
    """Attention weight per cached token (kernels.mla.weights), from the decode's lse."""
    per_dtype(ctx, figures, 3, _mla_weights)


def _mla_weights(ctx: Ctx, figures, gen, dt: torch.dtype, tag: str) -> None:
    from kernels.mla.paged import paged_mla_decode
    from kernels.mla.weights import paged_mla_weights

    H, Dc, Dr, _ = mla_dims(ctx)
    scale = mla_scale(ctx)
    case, B, max_len, fixed = _mla_cases(ctx)[0]
    q_lat, _, cache, _, lens = args = mla_inputs(ctx, gen, B, max_len, fixed, dt)
    _, lse = paged_mla_decode(*args, scale=scale, impl="naive", return_lse=True)
    width = int(lens.max())
    ref = paged_mla_weights(*args, lse, scale=scale, width=width, impl="naive")
    out = paged_mla_weights(*args, lse, scale=scale, width=width, impl="triton")
    suffix = f"{tag}_{case}"
    figures[f"err_weights_{suffix}"] = rel_err(out, ref)
    ms = _timed(ctx, figures, suffix, lambda: paged_mla_weights(*args, lse, scale=scale, width=width, impl="triton"),
                lambda: paged_mla_weights(*args, lse, scale=scale, width=width, impl="naive"))
    num_bytes = mla_decode_bytes(int(lens.sum()), B, H, Dc, Dr, cache.element_size(), q_lat.element_size())
    num_bytes += B * width * 4  # the [B, width] fp32 result
    figures[f"gb_s_{suffix}"] = gb_s(num_bytes, ms)
    figures[f"hbm_fraction_{suffix}"] = hbm_fraction(num_bytes, ms)


def mla_prefill(ctx: Ctx, figures) -> None:
    """Paged MLA prefill (kernels.mla.prefill): a chunk of new tokens per sequence over its cache."""
    per_dtype(ctx, figures, 4, _mla_prefill)


def _mla_prefill(ctx: Ctx, figures, gen, dt: torch.dtype, tag: str) -> None:
    from kernels.mla.prefill import paged_mla_prefill

    H, Dc, Dr, _ = mla_dims(ctx)
    B, Lq, start = (2, 21, 37) if ctx.small else (4, 1024, 7168)
    scale = mla_scale(ctx)
    _, _, cache, tables, _ = mla_inputs(ctx, gen, B, start + Lq, True, dt)
    q_lat, q_rope = ctx.randn(gen, B, Lq, H, Dc, dtype=dt), ctx.randn(gen, B, Lq, H, Dr, dtype=dt)
    kv_starts = torch.full((B,), start, dtype=torch.int32, device=ctx.device)
    lens = torch.full((B,), Lq, dtype=torch.int32, device=ctx.device)
    args = (q_lat, q_rope, cache, tables, kv_starts, lens)
    o_ref, lse_ref = paged_mla_prefill(*args, scale=scale, impl="naive")
    o, lse = paged_mla_prefill(*args, scale=scale, impl="triton", check=False)
    figures[f"err_o_{tag}"] = rel_err(o, o_ref)
    figures[f"err_lse_{tag}"] = rel_err(lse, lse_ref)
    ms = _timed(ctx, figures, tag, lambda: paged_mla_prefill(*args, scale=scale, impl="triton", check=False),
                lambda: paged_mla_prefill(*args, scale=scale, impl="naive", check=False, max_end=start + Lq))
    attended = B * (Lq * start + Lq * (Lq + 1) // 2)  # causal: row t sees start + t + 1 slots
    flops = mla_decode_flops(attended, H, Dc, Dr)
    figures[f"tflop_s_{tag}"] = tflop_s(flops, ms)
    figures[f"peak_fraction_{tag}"] = peak_fraction(flops, ms)


def _kda_chunk_cases(ctx: Ctx) -> tuple[tuple[str, int, int, tuple[int, ...]], ...]:
    """(case, B, T, state positions)."""
    if ctx.small:
        return (("B2_T40", 2, 40, (0, 17, 40)),)
    return tuple((f"B{B}_T{T}", B, T, tuple(range(0, T + 1, 1024))) for B, T in ((1, 8192), (8, 2048)))


def kda_chunk(ctx: Ctx, figures) -> None:
    """KDA chunked prefill forward (kernels.kda.chunk), states emitted at requested positions."""
    gen, parts = ctx.generator(5), Parts(figures)
    for dt, tag in ctx.dtypes:
        for case in _kda_chunk_cases(ctx):
            parts.run(f"{tag}_{case[0]}", lambda: _kda_chunk(ctx, figures, gen, dt, tag, *case))
    parts.done()


def _kda_chunk(ctx: Ctx, figures, gen, dt: torch.dtype, tag: str, case: str, B: int, T: int,
               positions: tuple[int, ...]) -> None:
    from kernels.kda.chunk import chunk_kda

    H, K, V = kda_dims(ctx)
    q, k, v, g, beta, h0 = kda_inputs(ctx, gen, B, T, dt)
    kw = dict(initial_state=h0, state_positions=positions)
    o_ref, s_ref, p_ref = chunk_kda(q, k, v, g, beta, impl="naive", **kw)
    o, s, p = chunk_kda(q, k, v, g, beta, impl="triton", **kw)
    suffix = f"{tag}_{case}"
    figures[f"err_o_{suffix}"] = rel_err(o, o_ref)
    figures[f"err_final_state_{suffix}"] = rel_err(s, s_ref)
    figures[f"err_position_states_{suffix}"] = rel_err(p, p_ref)
    ms = _timed(ctx, figures, suffix, lambda: chunk_kda(q, k, v, g, beta, impl="triton", **kw),
                lambda: chunk_kda(q, k, v, g, beta, impl="naive", **kw))
    flops = kda_chunk_flops(B, T, H, K, V)
    figures[f"tflop_s_{suffix}"] = tflop_s(flops, ms)
    figures[f"peak_fraction_{suffix}"] = peak_fraction(flops, ms)


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def kda_grads(chunk, leaves, d_o: torch.Tensor, d_final: torch.Tensor, **kw) -> tuple[torch.Tensor, ...]:
    """Gradients of <o, d_o> + <final_state, d_final> wrt (q, k, v, g, beta, h0) through `chunk`
    (a chunk_kda-like callable returning (o, final_state, ...))."""
    q, k, v, g, beta, h0 = leaves
    out = chunk(q, k, v, g, beta, initial_state=h0, **kw)
    o, final = out[0], out[1]
    if o.grad_fn is None:
        raise RuntimeError("the forward returned an output without grad_fn: no backward is wired for it")
    loss = (o.float() * d_o).sum() + (final.float() * d_final).sum()
    return torch.autograd.grad(loss, leaves)


def kda_backward(ctx: Ctx, figures) -> None:
    """KDA chunk forward + backward (impl="triton" autograd) vs autograd through the torch reference."""
    per_dtype(ctx, figures, 6, _kda_backward)


def _kda_backward(ctx: Ctx, figures, gen, dt: torch.dtype, tag: str) -> None:
    from kernels.kda.chunk import chunk_kda

    H, K, V = kda_dims(ctx)
    B, T = (1, 37) if ctx.small else (1, 8192)
    leaves = tuple(x.detach().requires_grad_() for x in kda_inputs(ctx, gen, B, T, dt))
    d_o = ctx.randn(gen, B, T, H, V)
    d_final = ctx.randn(gen, B, H, K, V) * 0.1
    ref = kda_grads(chunk_kda, leaves, d_o, d_final, impl="naive")
    ours = kda_grads(chunk_kda, leaves, d_o, d_final, impl="triton")
    for name, a, b in zip(GRAD_NAMES, ours, ref):
        figures[f"err_{name}_{tag}"] = rel_err(a, b)
    fwd_ms = ctx.bench_ms(lambda: chunk_kda(*leaves[:5], initial_state=leaves[5], impl="triton"))
    both_ms = ctx.bench_ms(lambda: kda_grads(chunk_kda, leaves, d_o, d_final, impl="triton"))
    torch_ms = ctx.bench_ms(lambda: kda_grads(chunk_kda, leaves, d_o, d_final, impl="naive"), rep_ms=50)
    figures[f"fwd_ms_{tag}"], figures[f"fwd_bwd_ms_{tag}"] = fwd_ms, both_ms
    figures[f"bwd_ms_{tag}"] = both_ms - fwd_ms
    figures[f"torch_fwd_bwd_ms_{tag}"] = torch_ms
    figures[f"speedup_vs_torch_{tag}"] = torch_ms / both_ms
    figures[f"tflop_s_nominal_{tag}"] = tflop_s(3 * kda_chunk_flops(B, T, H, K, V), both_ms)


SECTIONS = {"mla_decode": mla_decode, "kda_chunk": kda_chunk, "kda_backward": kda_backward,
            "kda_decode": kda_decode, "mla_weights": mla_weights, "mla_prefill": mla_prefill}
"""Name -> section, in run order (the acceptance shapes first)."""
