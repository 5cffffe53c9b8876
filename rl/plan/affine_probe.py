"""The activation probe for one long sequence: its chunk peaks from two short probes.

A one-sequence micro-batch of 100k+ tokens costs the direct probe (rl/plan/activation.py
`probe_activations`) minutes: it loops over every 64-token KDA segment. Every piece it meters
grows by the same bytes each `affine_period` tokens, so two probes a period apart give the peaks
at any length on the same lattice (`affine_activations` says why that is exact).
"""
from __future__ import annotations

import math

import torch

from models.config import ModelConfig
from rl.plan.activation import (ActivationProbe, compose_chunk_peaks, IndexShadow, measure_pieces, meta_probe,
                                probe_model, probe_activations)


AFFINE_MIN_PERIODS = 2
"""`affine_activations` meters at AFFINE_MIN_PERIODS and one more periods (plus the residue), far
from the short-input special cases (a KDA segment of min(64, width) tokens)."""


def affine_period(logprob_chunk_len: int = 1024) -> int:
    """Tokens after which every piece of one sequence's step repeats its bytes: KDA's 64-token
    segments and the head's logprob chunks both restart (their least common multiple)."""
    return math.lcm(64, logprob_chunk_len)


def affine_activations(model_config: ModelConfig, seq_len: int, num_chunks: int, dtype: torch.dtype = torch.float32,
                       logprob_chunk_len: int = 1024, grouped_mm: bool = False, split: str = "layers",
                       context_parallel: bool = False) -> ActivationProbe:
    """`probe_activations` for micro-batches of one sequence of `seq_len` tokens each, from two short
    probes instead of one at seq_len (whose cost grows with its KDA segments: minutes at 256k tokens).

    Why it is exact. Every piece `measure_pieces` meters (the embedding, each layer kind, the head)
    holds tensors whose sizes are linear in the tokens, plus per-segment KDA states and per-chunk
    logprob pieces, which grow by the same bytes every `affine_period` tokens. So on the lattice
    n = r + m * period (r = seq_len mod period) each piece's peak and kept bytes are affine in m:
    two probes at m = AFFINE_MIN_PERIODS and m + 1 give every piece at seq_len, and the chunks are
    composed from those pieces exactly as `_composed_peaks` does (tests/rl/test_context_plan.py
    compares the two at lengths off the lattice's base). A seq_len no longer than the second probe
    is probed directly, and so is a model whose routed experts run the padded blocked form (each
    expert's rows padded to a block: not affine in the tokens; `padded_experts`)."""
    period = affine_period(logprob_chunk_len)
    low = seq_len % period + AFFINE_MIN_PERIODS * period
    if seq_len <= low + period or padded_experts(model_config, grouped_mm):
        return probe_activations(model_config, [[seq_len]], num_chunks, dtype, logprob_chunk_len, grouped_mm, split,
                                 context_parallel=context_parallel)
    chunked, layer_runs, hooks = probe_model(model_config, num_chunks, dtype, split)
    shadow = IndexShadow()
    try:
        with meta_probe(shadow, grouped_mm, context_parallel):
            a, b = (measure_pieces(chunked.model, [n], logprob_chunk_len) for n in (low, low + period))
    finally:
        for hook in hooks:
            hook.remove()
    peaks = compose_chunk_peaks(chunked.specs, a.extrapolate(b, (seq_len - low) // period))
    return ActivationProbe(peaks, layer_runs[0], shadow.num_ops, "affine")


def padded_experts(model_config: ModelConfig, grouped_mm: bool) -> bool:
    """Whether the probed MoE takes the routed path without torch._grouped_mm (models/mlp.py
    `Experts.runs_dense`: routed when there are more than 4 x top-k experts)."""
    routed = "moe" in model_config.mlp_layer_types and (
        model_config.num_experts > 4 * model_config.num_experts_per_token)
    return routed and not grouped_mm
