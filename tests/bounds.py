"""Bounds for comparing two computations of the same quantity that sum in different orders (layouts,
kernels vs their naive twins, expert-parallel or data-parallel ranks vs one rank).

fp32 addition is not associative: summing K terms in another order moves the result by up to about
K * 2^-24 of the terms' magnitude (typically sqrt(K) of that). Which order a host takes depends on the
SIMD kernels torch dispatches to (AVX-512, AVX2 or the scalar default), its BLAS, and the intra-op
thread count, so a bound must be relative to the quantity's own scale: an absolute 1e-6 holds on one
host and fails on the next. Where the order is the same by construction (a copy, the same op on the
same inputs), tests compare with ``==`` and say so.
"""
import torch

# A logprob is a logit minus a log-sum-exp over the vocabulary. Their magnitude (a few units here), not the
# logprob's, sets the rounding: a confident token's logprob near 0 carries the same absolute error as a
# rare one's. Two chunkings of a prompt or a verification chunk vs decode steps measured up to 1.0e-5
# (rounding riding through the layers); a wrong token or stale cache bytes move a logprob by > 1e-2.
LOGPROB_TOL = {"rel": 1e-5, "abs": 5e-5}


def scaled_err(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max|got - want| / max|scale| in float64 (`scale` defaults to `want`): the worst elementwise
    difference in units of the compared quantity's largest entry. 0 when both are exactly zero; inf when
    the scale is zero but the tensors differ (nothing to round, so any difference is a bug)."""
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    size = (want if scale is None else scale).double().abs().max().item() if want.numel() else 0.0
    if size == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / size


def norm_err(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||got - want|| / ||scale|| (2-norms, float64; `scale` defaults to `want`), with scaled_err's
    conventions for a zero scale."""
    diff = (got.double() - want.double()).norm().item()
    size = (want if scale is None else scale).double().norm().item()
    if size == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / size
