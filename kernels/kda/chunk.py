"""Chunked KDA prefill (and training forward) that also emits the states at requested positions.

Same contract as `naive_chunk_kda` (kernels/kda/naive.py, which derives the WY/UT form).
`impl="naive"` calls it; `impl="triton"` runs fla's chunk algorithm in Triton: 64-token chunks
with 16-token sub-chunks, the UT transform, one serial loop over chunks (kernels/kda/chunk_fwd.py),
and a Triton backward (kernels/kda/chunk_bwd.py) wired as this function's autograd, so training
and rollout share one kernel. Chunks are cut, as in the naive form, at multiples of 64 and at every
requested position (the state there is exact without padding). The Triton path requires g <= 0
(a log-decay, as in the model; fla requires the same): its intra-chunk products bound every exp
by 1 only then.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.impl import check_impl, require_triton
from kernels.kda.chunk_bwd import TRITON_KERNELS as _BWD_KERNELS
from kernels.kda.chunk_bwd import chunk_kda_bwd
from kernels.kda.chunk_fwd import TRITON_KERNELS as _FWD_KERNELS
from kernels.kda.chunk_fwd import intra_kernel, chunk_kda_fwd
from kernels.kda.naive import check_inputs, naive_chunk_kda

TRITON_KERNELS = {**_FWD_KERNELS, **_BWD_KERNELS}  # name -> @triton.jit function (tools/gpu_check.py)


class _ChunkKDATriton(torch.autograd.Function):
    """chunk_kda_fwd / chunk_kda_bwd as one differentiable op. Inputs contiguous, T > 0."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, positions):
        o, final, pos, saved = chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, positions)
        ctx.save_for_backward(q, k, v, beta, *(saved[name] for name in _SAVED))
        ctx.seg, ctx.NS, ctx.scale, ctx.positions = saved["seg"], saved["NS"], scale, positions
        ctx.g_dtype, ctx.has_initial = g.dtype, initial_state is not None
        return o, final, pos

    @staticmethod
    def backward(ctx, do, dfinal, dpos):
        q, k, v, beta, *rest = ctx.saved_tensors
        saved = dict(zip(_SAVED, rest), seg=ctx.seg, NS=ctx.NS)
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd(q, k, v, beta, ctx.scale, saved, ctx.positions,
                                                   do.contiguous(), dfinal, dpos)
        return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, dh0 if ctx.has_initial else None, None, None


_SAVED = ("G", "ai", "aqk", "w", "u", "qg", "kg", "v_new", "hs")


def _chunk_kda_triton(q, k, v, g, beta, scale, initial_state, positions):
    B, T, H, K = q.shape
    V = v.shape[3]
    require_triton(intra_kernel, q.device)
    if B == 0 or H == 0 or T == 0:
        init = (torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device) if initial_state is None
                else initial_state.to(torch.float32).clone())
        pos = init.unsqueeze(1).repeat(1, len(positions), 1, 1, 1)  # every position is 0 here
        return q.new_zeros(B, T, H, V), init, pos
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    return _ChunkKDATriton.apply(q, k, v, g, beta, initial_state, float(scale), positions)


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    state_positions: Sequence[int] = (),
    chunk_len: int = 64,
    impl: str = "naive",
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked KDA over B sequences of T tokens; same contract as `naive_chunk_kda`.

    Args:
        q, k: [B, T, H, K], already L2-normalised over K.
        v: [B, T, H, V].
        g: [B, T, H, K] per-channel log-decay.
        beta: [B, T, H] delta-rule write strength.
        scale: query scale, default K ** -0.5.
        initial_state: [B, H, K, V] state before token 0, or None for zeros. Not mutated.
        state_positions: strictly increasing ints p in [0, T]; the state after the first p
            tokens is returned for each (p = 0 gives the initial state).
        chunk_len: segment length of the naive path; the Triton path validates it but uses
            64-token chunks (same results up to fp32 rounding).
        impl: "naive" or "triton" (see module docstring); both are differentiable.

    Returns (all new tensors):
        o: [B, T, H, V] in q's dtype (math in fp32).
        final_state: [B, H, K, V] fp32.
        position_states: [B, P, H, K, V] fp32, P = len(state_positions).

    Raises ValueError on bad shapes, positions, chunk_len or impl; RuntimeError if
    impl="triton" cannot run here.
    """
    check_impl(impl)
    if impl != "triton":  # "naive", or "cpu" (no fused CPU version of this one)
        return naive_chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            state_positions=state_positions,
            chunk_len=chunk_len,
        )
    (B, T, H, K, V), positions = check_inputs(q, k, v, g, beta, initial_state, state_positions)
    if isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 1:
        raise ValueError(f"chunk_len must be a positive int, got {chunk_len!r}")
    scale = K**-0.5 if scale is None else scale
    return _chunk_kda_triton(q, k, v, g, beta, scale, initial_state, positions)
