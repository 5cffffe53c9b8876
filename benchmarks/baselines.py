"""The anchors as optional baselines: flash-linear-attention's KDA (`fla-core`) and FlashInfer's MLA
paged decode, behind adapters that take our tensor layouts. Used by benchmarks/kernels.py and the
GPU check (tools/check_baselines.py) when importable; never by the package, and never installed
into the test environment (transformers binds fla's kernels when it can import them, and its
KimiLinear then fails on CPU): `pip install '.[gpu]'` into an environment of its own
(docs/gpu_check.md). Every import of fla or flashinfer is inside a function.
"""
from __future__ import annotations

from importlib import metadata

import torch
from torch import Tensor


def availability() -> dict[str, str]:
    """{"fla": "fla-core <version>" or "unavailable: <why>", "flashinfer": likewise}."""
    out = {}
    for name, dist, load in (("fla", "fla-core", import_fla), ("flashinfer", "flashinfer-python", _import_flashinfer)):
        try:
            load()
            out[name] = f"{dist} {metadata.version(dist)}"
        except Exception as err:  # noqa: BLE001 - any import failure means "not usable here"
            out[name] = f"unavailable: {type(err).__name__}: {err}"[:300]
    return out


def import_fla():
    """(chunk_kda, fused_recurrent_kda) from fla.ops.kda (fla-core); ImportError if absent."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    return chunk_kda, fused_recurrent_kda


def _import_flashinfer():
    import flashinfer.mla

    return flashinfer.mla


def fla_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float,
              initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """fla's chunk_kda on our layout: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], g the
    per-token log-decay (fla's default use_gate_in_kernel=False), initial_state [B, H, K, V] fp32.
    Returns (o [B, T, H, V], final_state [B, H, K, V] fp32); differentiable."""
    chunk, _ = import_fla()
    o, final = chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True)
    return o, final


def fla_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
               scale: float) -> tuple[Tensor, Tensor]:
    """One step of fla's fused_recurrent_kda for B sequences: q, k, g [B, H, K], v [B, H, V],
    beta [B, H], state [B, H, K, V] fp32 (gathered: fla takes no page ids). Returns (o [B, H, V],
    new state [B, H, K, V])."""
    _, recurrent = import_fla()
    o, final = recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale,
                         initial_state=state, output_final_state=True)
    return o[:, 0], final


class FlashInferMLADecode:
    """FlashInfer's BatchMLAPagedAttentionWrapper planned for one batch of our paged decode.

    Our cache rows are [c_kv (Dc), k_rope (Dr)] in one tensor; FlashInfer takes the two parts as
    separate caches, so they are copied once here (outside any timing). block_tables [B, blocks]
    and seq_lens [B] become FlashInfer's CSR page list (kv_indptr, kv_indices) and kv_len_arr.
    """

    WORKSPACE_BYTES = 128 << 20

    def __init__(self, cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *, num_heads: int, latent_dim: int,
                 scale: float, q_dtype: torch.dtype):
        mla = _import_flashinfer()
        device, page_tokens = cache.device, cache.shape[1]
        pages = (seq_lens.long() + page_tokens - 1) // page_tokens  # [B] pages each sequence uses
        used = torch.arange(block_tables.shape[1], device=device) < pages[:, None]  # [B, blocks]
        kv_indices = block_tables[used].to(torch.int32)  # row-major: each sequence's pages in order
        kv_indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).to(torch.int32)  # [B + 1]
        qo_indptr = torch.arange(block_tables.shape[0] + 1, dtype=torch.int32, device=device)  # one query each
        self.ckv = cache[..., :latent_dim].contiguous()  # [num_pages, page_tokens, Dc]
        self.kpe = cache[..., latent_dim:].contiguous()  # [num_pages, page_tokens, Dr]
        workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.int8, device=device)
        self.wrapper = mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        self.wrapper.plan(qo_indptr, kv_indptr, kv_indices, seq_lens.to(torch.int32), num_heads, latent_dim,
                          cache.shape[2] - latent_dim, page_tokens, False, scale, q_dtype, cache.dtype)

    def __call__(self, q_lat: Tensor, q_rope: Tensor) -> Tensor:
        """o_lat [B, H, Dc] for q_lat [B, H, Dc] and q_rope [B, H, Dr] (our paged_mla_decode's output)."""
        return self.wrapper.run(q_lat, q_rope, self.ckv, self.kpe, return_lse=False)
