"""Baseline sections of the GPU check: our kernels timed beside the anchors in the same process, on
the same inputs: fla's chunk_kda (forward and backward) and fused_recurrent_kda, and FlashInfer's
MLA paged decode. They run only where those import (gpu_check.sh installs them into an environment
of their own, never the test environment); otherwise the section is skipped and says why.

Figure names: <ours>_vs_<anchor>_<dtype>_<case> = anchor time / our time (>= 1: ours is as fast or
faster), <anchor>_ms_*, ours_ms_*, err_<anchor>_* (the anchor vs our torch reference: a check that
both compute the same function), hbm_fraction_* (docs/gpu_check.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tools.check_common import Ctx, Parts, Skip, hbm_fraction, mla_decode_bytes, rel_err
from tools.check_kernels import GRAD_NAMES, kda_dims, kda_grads, kda_inputs, mla_dims, mla_inputs, mla_scale


def _require(ctx: Ctx, name: str) -> str:
    """The anchor's version string; Skip when it cannot run here."""
    ctx.require_native(f"{name}'s kernels run on CUDA only")
    from benchmarks.baselines import availability

    found = availability()[name]
    if found.startswith("unavailable"):
        raise Skip(f"{name} {found} (gpu_check.sh installs the [gpu] extra into a separate environment)")
    return found


def fla(ctx: Ctx, figures) -> None:
    """Ours vs fla 0.6: chunk_kda forward (the acceptance ratio), fused_recurrent_kda, chunk backward."""
    figures["version"] = _require(ctx, "fla")
    gen, parts = ctx.generator(7), Parts(figures)
    for dt, tag in ctx.dtypes:  # bf16 first: the acceptance figure, and all of it before fp32
        g_dtype = parts.run(f"chunk_{tag}", lambda: _fla_chunk(ctx, figures, gen, dt, tag)) or dt
        parts.run(f"decode_{tag}", lambda: _fla_decode(ctx, figures, gen, dt, tag))
        parts.run(f"backward_{tag}", lambda: _fla_backward(ctx, figures, gen, dt, tag, g_dtype))
    parts.done()


def _fla_chunk(ctx: Ctx, figures, gen, dt: torch.dtype, tag: str) -> torch.dtype:
    """Forward at B=1 x 8192 and 8 x 2048 tokens. fla is given our fp32 log-decay g; if it refuses
    that, g in the inputs' dtype (fla's own tests' convention; noted in fla_g_dtype_<tag>).
    Returns the g dtype fla took."""
    from benchmarks.baselines import fla_chunk
    from kernels.kda.chunk import chunk_kda

    _, K, _ = kda_dims(ctx)
    scale, g_dtype = K ** -0.5, torch.float32
    for B, T in ((1, 8192), (8, 2048)):
        suffix = f"{tag}_B{B}_T{T}"
        q, k, v, g, beta, h0 = kda_inputs(ctx, gen, B, T, dt)
        o_ref, s_ref, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, impl="naive")
        try:
            o_f, s_f = fla_chunk(q, k, v, g.to(g_dtype), beta, scale=scale, initial_state=h0)
        except Exception as err:  # noqa: BLE001 - retried once with the other convention, then raised
            if g_dtype == dt:
                raise
            g_dtype = dt
            figures[f"fla_g_dtype_{tag}"] = f"{dt} (fp32 g refused: {type(err).__name__}: {err})"[:300]
            o_f, s_f = fla_chunk(q, k, v, g.to(g_dtype), beta, scale=scale, initial_state=h0)
        g_f = g.to(g_dtype)
        figures[f"err_fla_o_{suffix}"] = rel_err(o_f, o_ref)
        figures[f"err_fla_final_state_{suffix}"] = rel_err(s_f, s_ref)
        ours = ctx.bench_ms(lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, impl="triton"))
        theirs = ctx.bench_ms(lambda: fla_chunk(q, k, v, g_f, beta, scale=scale, initial_state=h0))
        figures[f"ours_ms_{suffix}"], figures[f"fla_ms_{suffix}"] = ours, theirs
        figures[f"kda_chunk_vs_fla_{suffix}"] = theirs / ours
    return g_dtype


def _fla_decode(ctx: Ctx, figures, gen, dt: torch.dtype, tag: str) -> None:
    from benchmarks.baselines import fla_decode
    from kernels.kda.decode import kda_decode_step

    H, K, V = kda_dims(ctx)
    B = 256
    state = ctx.randn(gen, 2 * B, H, K, V) * 0.1  # [num_pages, H, K, V] fp32
    pages = torch.randperm(2 * B, generator=gen, device=ctx.device)[:B]
    q, k = (F.normalize(ctx.randn(gen, B, H, K), dim=-1).to(dt) for _ in range(2))
    v, g = ctx.randn(gen, B, H, V, dtype=dt), F.logsigmoid(ctx.randn(gen, B, H, K))
    beta = torch.sigmoid(ctx.randn(gen, B, H)).to(dt)
    gathered = state[pages].clone()  # [B, H, K, V]: fla reads states by sequence, not by page
    o_ref = kda_decode_step(q, k, v, g, beta, state.clone(), pages, impl="naive")
    o_f, _ = fla_decode(q, k, v, g, beta, gathered.clone(), scale=K ** -0.5)
    figures[f"err_fla_decode_o_{tag}"] = rel_err(o_f, o_ref)
    ours = ctx.bench_ms(lambda: kda_decode_step(q, k, v, g, beta, state, pages, impl="triton", check=False))
    theirs = ctx.bench_ms(lambda: fla_decode(q, k, v, g, beta, gathered, scale=K ** -0.5))
    figures[f"ours_decode_ms_{tag}_B{B}"], figures[f"fla_decode_ms_{tag}_B{B}"] = ours, theirs
    figures[f"kda_decode_vs_fla_{tag}_B{B}"] = theirs / ours


def _fla_backward(ctx: Ctx, figures, gen, dt: torch.dtype, tag: str, g_dtype: torch.dtype) -> None:
    """fla's gradients vs autograd through our torch reference; fwd+bwd times of fla and ours."""
    from benchmarks.baselines import fla_chunk
    from kernels.kda.chunk import chunk_kda

    H, K, V = kda_dims(ctx)
    B, T = 1, 8192
    scale = K ** -0.5

    def fla_like(q, k, v, g, beta, *, initial_state):
        return fla_chunk(q, k, v, g.to(g_dtype), beta, scale=scale, initial_state=initial_state)

    leaves = tuple(x.detach().requires_grad_() for x in kda_inputs(ctx, gen, B, T, dt))
    d_o, d_final = ctx.randn(gen, B, T, H, V), ctx.randn(gen, B, H, K, V) * 0.1
    ref = kda_grads(chunk_kda, leaves, d_o, d_final, impl="naive")
    theirs = kda_grads(fla_like, leaves, d_o, d_final)
    for name, a, b in zip(GRAD_NAMES, theirs, ref):
        figures[f"err_fla_{name}_{tag}"] = rel_err(a, b)
    fla_ms = ctx.bench_ms(lambda: kda_grads(fla_like, leaves, d_o, d_final))
    figures[f"fla_fwd_bwd_ms_{tag}_B{B}_T{T}"] = fla_ms
    try:  # a failure of our backward is reported; fla's figures stay
        ours_ms = ctx.bench_ms(lambda: kda_grads(chunk_kda, leaves, d_o, d_final, impl="triton"))
    except Exception as err:  # noqa: BLE001
        figures[f"ours_fwd_bwd_error_{tag}"] = f"{type(err).__name__}: {err}"[:300]
        return
    figures[f"ours_fwd_bwd_ms_{tag}_B{B}_T{T}"] = ours_ms
    figures[f"kda_backward_vs_fla_{tag}_B{B}_T{T}"] = fla_ms / ours_ms


def flashinfer(ctx: Ctx, figures) -> None:
    """Ours vs FlashInfer's MLA paged decode (bf16: FlashInfer's MLA takes fp16/bf16 only)."""
    figures["version"] = _require(ctx, "flashinfer")
    gen, parts = ctx.generator(8), Parts(figures)
    for case in (("B64_ctx8192", 64, 8192, True), ("B4_ctx32768", 4, 32768, False)):
        parts.run(case[0], lambda: _flashinfer(ctx, figures, gen, *case))
    parts.done()


def _flashinfer(ctx: Ctx, figures, gen, case: str, B: int, max_len: int, fixed: bool) -> None:
    from benchmarks.baselines import FlashInferMLADecode
    from kernels.mla.paged import paged_mla_decode

    H, Dc, Dr, _ = mla_dims(ctx)
    scale = mla_scale(ctx)
    q_lat, q_rope, cache, tables, lens = mla_inputs(ctx, gen, B, max_len, fixed, torch.bfloat16)
    ref = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, impl="naive")
    fi = FlashInferMLADecode(cache, tables, lens, num_heads=H, latent_dim=Dc, scale=scale, q_dtype=q_lat.dtype)
    suffix = f"bf16_{case}"
    figures[f"err_flashinfer_o_{suffix}"] = rel_err(fi(q_lat, q_rope), ref)
    ours = ctx.bench_ms(lambda: paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=scale, impl="triton",
                                                 check=False))
    theirs = ctx.bench_ms(lambda: fi(q_lat, q_rope))
    figures[f"ours_ms_{suffix}"], figures[f"flashinfer_ms_{suffix}"] = ours, theirs
    figures[f"mla_decode_vs_flashinfer_{suffix}"] = theirs / ours
    num_bytes = mla_decode_bytes(int(lens.sum()), B, H, Dc, Dr, 2, 2)
    figures[f"flashinfer_hbm_fraction_{suffix}"] = hbm_fraction(num_bytes, theirs)


SECTIONS = {"fla": fla, "flashinfer": flashinfer}
"""Name -> section, in run order."""
