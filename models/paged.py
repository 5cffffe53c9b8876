"""Paged forward: the model's mixers reading and writing caches that live in pool pages.

The rollout engine keeps every cache in one pool of equal-size pages (memory/page_pool.py) and
hands this module plain tensors: typed views of the pool (per layer) plus the step's metadata
(which page holds each sequence's KDA state, each sequence's MLA block table). `PagedMixer`
plugs into `HybridLM.run_layers`, so embeddings, norms and MLPs stay one code path.

- KDA: a sequence's state page (S of every head + conv tails, head-major) is read and written
  **in place**. Decode (one new token on a non-empty state) is batched across sequences through
  `kda_decode_step`; prefill chunks go per sequence through `chunk_kda`, starting from zeros
  when the sequence starts at position 0 (so pages need no clearing).
- MLA: the new tokens' latents [c_kv, k_rope] are written to their slots first, then decode
  attends through the block tables with `paged_mla_decode` (absorbed), and prefill chunks
  attend over their gathered pages with the expanded form.
Conv tails: the pool stores them per head as [3 (q, k, v), kernel-1, dk]; the layer works on
[kernel-1, 3 * H * dk] (channel = which * H * dk + h * dk + d); `_tails_to_layer` converts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kda.chunk import chunk_kda
from kernels.kda.decode import kda_decode_step
from kernels.mla.naive import naive_mla_attention
from kernels.mla.paged import paged_mla_decode
from models.kda import KDALayer
from models.mla import MLALayer
from models.state import SegmentBatch


@dataclass
class PagedCaches:
    """Per-layer typed views of the page pool (every page id is valid for every view)."""

    kda_state: dict[int, torch.Tensor]
    """KDA layer -> [num_pages, H, dk, dv] recurrent states."""
    kda_conv: dict[int, torch.Tensor]
    """KDA layer -> [num_pages, H, 3, kernel-1, dk] conv tails."""
    mla_latent: dict[int, torch.Tensor]
    """MLA layer -> [num_pages, block_tokens, d_c + d_r] latent cache."""


@dataclass
class PagedStep:
    """What one engine step runs: packed new tokens of several sequences and where their caches are."""

    batch: SegmentBatch
    state_pages: dict[int, torch.Tensor]
    """KDA layer -> [num_seqs] int64 page holding each sequence's state for that layer's group."""
    block_tables: dict[int, torch.Tensor]
    """MLA layer -> [num_seqs, max_blocks] int64 pages of each sequence in logical order."""
    impl: str = "naive"
    """Kernel implementation: "naive" (torch) or "triton"."""

    @property
    def decode_seqs(self) -> list[int]:
        """Sequences that add one token to a non-empty cache (batched decode path)."""
        return [i for i, (s, n) in enumerate(zip(self.batch.starts, self.batch.new_lens)) if n == 1 and s > 0]

    @property
    def prefill_seqs(self) -> list[int]:
        decode = set(self.decode_seqs)
        return [i for i in range(len(self.batch.new_lens)) if i not in decode]


def _tails_to_layer(tails: torch.Tensor) -> torch.Tensor:
    """[B, H, 3, K-1, dk] (pool layout) -> [B, K-1, 3*H*dk] (layer layout)."""
    b, h, three, km1, dk = tails.shape
    return tails.permute(0, 3, 2, 1, 4).reshape(b, km1, three * h * dk)


def _tails_to_pool(tails: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, K-1, 3*H*dk] (layer layout) -> [B, H, 3, K-1, dk] (pool layout)."""
    b, km1, channels = tails.shape
    return tails.view(b, km1, 3, num_heads, channels // (3 * num_heads)).permute(0, 3, 2, 1, 4)


class PagedMixer:
    """`Mixer` over pool pages; mutates the pages of the sequences in `step` (and only those)."""

    def __init__(self, caches: PagedCaches, step: PagedStep) -> None:
        self.caches, self.step = caches, step
        batch = step.batch
        offsets = batch.offsets
        self.decode, self.prefill = step.decode_seqs, step.prefill_seqs
        self.decode_rows = torch.tensor([offsets[i] for i in self.decode], dtype=torch.long)  # [Bd]
        self.decode_index = torch.tensor(self.decode, dtype=torch.long)  # [Bd]
        self.positions = batch.positions()  # [N]

    def kda(self, index: int, layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
        state, conv = self.caches.kda_state[index], self.caches.kda_conv[index]
        pages = self.step.state_pages[index]  # [B]
        batch = self.step.batch
        mixed, g, beta = layer.project(x)
        core = torch.empty(x.shape[0], layer.num_heads, layer.head_dim, dtype=torch.float32, device=x.device)
        if self.decode:
            rows, dec_pages = self.decode_rows, pages[self.decode_index]
            tails = _tails_to_layer(conv[dec_pages])  # [Bd, K-1, 3*qkv]
            q, k, v, ext = layer.short_conv(mixed[rows, None], tails)
            core[rows] = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[rows], beta[rows], state, dec_pages,
                                         impl=self.step.impl)
            conv[dec_pages] = _tails_to_pool(ext[:, 1:], layer.num_heads).to(conv.dtype)
        for i in self.prefill:
            rows, page, start = batch.rows(i), int(pages[i]), batch.starts[i]
            if start == 0:  # a fresh sequence: whatever the page held before is irrelevant
                init, tail = torch.zeros_like(state[page]), torch.zeros_like(_tails_to_layer(conv[page:page + 1]))
            else:
                init, tail = state[page], _tails_to_layer(conv[page:page + 1])
            q, k, v, ext = layer.short_conv(mixed[None, rows], tail)
            o, final, _ = chunk_kda(q, k, v, g[None, rows], beta[None, rows], initial_state=init[None],
                                    impl=self.step.impl)
            core[rows] = o[0]
            state[page] = final[0]
            conv[page] = _tails_to_pool(ext[:, -(layer.kernel - 1):], layer.num_heads)[0].to(conv.dtype)
        return layer.output(x, core)

    def mla(self, index: int, layer: MLALayer, x: torch.Tensor) -> torch.Tensor:
        cache = self.caches.mla_latent[index]  # [P, bt, d_c + d_r]
        tables = self.step.block_tables[index]  # [B, max_blocks]
        batch, block_tokens = self.step.batch, cache.shape[1]
        q_nope, q_rope = layer.queries(x, self.positions)
        latent = layer.latent(x, self.positions)  # [N, d_c + d_r]
        # Write the new tokens' entries before attending: prefill attends to itself.
        seq_of_token = torch.repeat_interleave(torch.arange(len(batch.new_lens)), torch.tensor(batch.new_lens))
        cache[tables[seq_of_token, self.positions // block_tokens], self.positions % block_tokens] = latent.to(cache.dtype)
        w_uk, w_uv = layer.up_projections()
        out = torch.empty(x.shape[0], layer.num_heads, layer.v_dim, dtype=x.dtype, device=x.device)
        if self.decode:
            rows = self.decode_rows
            q_lat = torch.einsum("bhn,hnc->bhc", q_nope[rows].float(), w_uk.float())  # [Bd, H, d_c]
            seq_lens = torch.tensor([batch.starts[i] + 1 for i in self.decode])
            o_lat = paged_mla_decode(q_lat, q_rope[rows].float(), cache, tables[self.decode_index], seq_lens,
                                     scale=layer.scale, impl=self.step.impl)
            out[rows] = torch.einsum("bhc,hvc->bhv", o_lat, w_uv.float()).to(out.dtype)
        for i in self.prefill:
            rows, end = batch.rows(i), batch.starts[i] + batch.new_lens[i]
            pages = tables[i, :(end + block_tokens - 1) // block_tokens]
            gathered = cache[pages].reshape(-1, cache.shape[-1])[:end]  # [end, d_c + d_r]
            out[rows] = naive_mla_attention(q_nope[rows], q_rope[rows], gathered, w_uk, w_uv,
                                            scale=layer.scale, q_start=batch.starts[i])
        return layer.output(x, out)
