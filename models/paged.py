"""Paged forward: the model's mixers reading and writing caches that live in pool pages.

The rollout engine keeps every cache in one pool of equal-size pages (memory/page_pool.py) and
hands this module plain tensors: typed views of the pool (per layer) plus the step's metadata
(which page holds each sequence's KDA state, each sequence's MLA block table). `PagedMixer`
plugs into `HybridLM.run_layers`, so embeddings, norms and MLPs stay one code path.

- KDA: a sequence's state page (S of every head + conv tails, head-major) is read and written
  **in place**. Decode (one new token on a non-empty state) is batched across sequences through
  `kda_decode_step`; prefill chunks are batched too (length buckets, right-padded with steps that
  write nothing), starting from zeros when a sequence starts at position 0 (pages need no clearing).
  A speculative verification's few tokens (`PagedStep.chained_seqs`) join the decode batch, one row
  per token, chained through their position pages (`kda_decode_tokens`: no padding, gather or copy).
- MLA: the new tokens' latents [c_kv, k_rope] are written to their slots first, then decode
  attends through the block tables with `paged_mla_decode` (absorbed; a chained sequence's rows as
  decode queries over its slots up to each), and prefill chunks with
  `paged_mla_prefill` (absorbed, tiles of slots with an online softmax: no full score matrix).
Conv tails: the pool stores them per head as [3 (q, k, v), kernel-1, dk]; the layer works on
[kernel-1, 3 * H * dk] (channel = which * H * dk + h * dk + d); `_tails_to_layer` converts.

No layer waits for the device: every integer the step needs (positions, write slots, block
tables, state pages, decode rows, padding maps of the length buckets, per-sequence starts and
lengths) is computed on the host from Python lists and moved in one copy (`StepMetadata`), and
every size (longest sequence, blocks to gather) comes from those lists, never from a device tensor.
On CUDA the host can queue a whole step ahead of the device (tests/rollout/test_sync_audit.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.kda.chunk import chunk_kda
from kernels.kda.decode import kda_decode_step
from kernels.kda.decode_tokens import kda_decode_tokens
from kernels.kda.recurrent import recurrent_kda_states
from kernels.impl import require_cpu_ops
from kernels.mla.paged import paged_mla_decode
from kernels.mla.prefill import (TILE_SLOTS, attend_rows, attend_rows_weights, paged_mla_prefill,
                                 paged_mla_prefill_weights)
from kernels.mla.weights import dense_attention, merge_attention, paged_mla_weights
from models.kda import KDALayer
from models.mla import MLALayer
from models.paged_positions import PositionWrites, add_position_writes, check_position_pages, write_position_states
from models.step_metadata import StepMetadata
from models.state import SegmentBatch

PREFILL_TILE_SLOTS = TILE_SLOTS
"""Slots per tile of the torch MLA prefill (rounded to whole pages, or to a divisor of a page):
its scores peak at [sequences, chunk tokens * heads, PREFILL_TILE_SLOTS] fp32."""


def torch_prefill_form(num_seqs: int, width: int) -> tuple[str, int]:
    """Which torch KDA form runs a prefill batch of `num_seqs` sequences padded to `width` tokens:
    ("recurrent", 0) or ("chunk", chunk_len). (The Triton kernel is always chunked, 16 tokens.)

    Both are exact; their costs differ. The chunked reference builds a [L, L, dk] decay tensor per
    chunk and sequence; the token loop (kernels/kda/recurrent.py) pays five ops per token.
    Measured on CPU (ms, tiny model's 2 heads x 32): 64 seqs x 64 tokens: loop 5.9, chunk 8 16.6,
    chunk 16 24.6; 16 x 256: 12.7, 25.6, 27.4; 4 x 256: 6.9, 10.5, 9.2; 1 x 512: 11.4, 14.5, 10.0.
    So: the loop unless one or two long sequences.
    """
    if num_seqs >= 4 or width <= 256:
        return "recurrent", 0
    return "chunk", 16


@dataclass
class PagedCaches:
    """Per-layer typed views of the page pool (every page id is valid for every view)."""

    kda_state: dict[int, torch.Tensor]
    """KDA layer -> [num_pages, H, dk, dv] recurrent states."""
    kda_conv: dict[int, torch.Tensor]
    """KDA layer -> [num_pages, H, 3, kernel-1, dk] conv tails."""
    mla_latent: dict[int, torch.Tensor]
    """MLA layer -> [num_pages, block_tokens, d_c + d_r] latent cache."""


class KVObserver(Protocol):
    """What token eviction (rollout/kv/kv_eviction.py) hooks into the MLA layers of one step.

    `seqs` are indices into the step's sequences. Slots are the sequence's compacted KV slots
    (`PagedStep.kv_starts`), not token positions."""

    def extra_kv(self, layer: int, seqs: list[int], q: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows to attend besides the pages: (kv [len(seqs), M, d_c + d_r], valid [len(seqs), M]
        bool), or None. q: decode queries [len(seqs), H, d_c + d_r] (absorbed), None for prefill
        (rows every query of the chunk may see: they are all older than the chunk)."""

    def observe(self, layer: int, seqs: list[int], resident: torch.Tensor, extra: torch.Tensor | None) -> None:
        """Attention probability received this layer, summed over heads (and a prefill chunk's
        queries): resident [len(seqs), >= slots] per page slot, extra [len(seqs), M] per extra row."""


@dataclass
class PagedStep:
    """What one engine step runs: packed new tokens of several sequences and where their caches are."""

    batch: SegmentBatch
    state_pages: dict[int, list[int]]
    """KDA layer -> page holding each sequence's state for that layer's group (host ints; layers
    of one cache group share one list object, moved once)."""
    block_tables: dict[int, list[list[int]]]
    """MLA layer -> pages of each sequence in logical order, one row per sequence, rows of any
    length (host ints; layers of one cache group share one list object)."""
    impl: str = "naive"
    """Kernel implementation: "naive" (torch) or "triton"."""
    check: bool = True
    """Let the kernels validate their inputs (a host sync each); the engine turns it off and
    relies on its own integrity checks."""
    kv_starts: list[int] | None = None
    """Per sequence, the MLA slot its first new token goes to: the KV it holds, which is less than
    its token position once token eviction removed entries (None = batch.starts: nothing removed).
    RoPE always uses token positions; slots, causal masks and attention lengths use these."""
    kv_observer: KVObserver | None = None
    """Token eviction's hook (attention weights out, offloaded rows in); None = plain attention."""
    position_pages: dict[int, list[list[int]]] | None = None
    """KDA layer -> per sequence, the pages that receive its state and conv tails after each of its
    first n - 1 new tokens ([] for none; models/paged_positions.py): speculative verification's
    rollback slots. Layers of one cache group share one list object. None = none anywhere."""

    @property
    def chained_seqs(self) -> list[int]:
        """Sequences whose several new tokens run decode-shaped, one token after the other through their
        position pages (`kernels/kda/decode_tokens.py`; speculative verification): those with position
        pages, unless the kernels are Triton's (a GPU verifies through the chunked prefill path)."""
        if self.impl == "triton" or not self.position_pages:
            return []
        rows = next(iter(self.position_pages.values()))
        return [i for i, pages in enumerate(rows) if pages]

    @property
    def decode_seqs(self) -> list[int]:
        """Sequences on the batched decode path: one token added to a non-empty cache, or `chained_seqs`."""
        chained = set(self.chained_seqs)
        return [i for i, (s, n) in enumerate(zip(self.batch.starts, self.batch.new_lens))
                if (n == 1 and s > 0) or i in chained]

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


def _length_buckets(seqs: list[int], lens: list[int], max_waste: float = 2.0) -> list[list[int]]:
    """Group sequences (longest first) so that padding each group to its longest member costs at
    most `max_waste` times its real tokens."""
    groups: list[tuple[list[int], int]] = []  # (members, longest length)
    total = 0
    for i, n in sorted(zip(seqs, lens), key=lambda p: -p[1]):
        if groups and (len(groups[-1]) + 1) * groups[-1][1] <= max_waste * (total + n):
            groups[-1][0].append(i)
            total += n
        else:
            groups.append(([i], n))
            total = n
    return [members for members, _ in groups]


def _pad(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num: int, width: int) -> torch.Tensor:
    """Packed rows x[src] placed at rows dst of a zero [num * width, ...] tensor: [num, width, ...]."""
    out = x.new_zeros(num * width, *x.shape[1:])
    return out.index_copy_(0, dst, x.index_select(0, src)).view(num, width, *x.shape[1:])


@dataclass
class _Bucket:
    """Sequences whose new tokens run right-padded to one width (a length bucket), with their
    metadata as device views of the step's buffer."""

    seqs: list[int]
    """Indices into the step's sequences (host)."""
    width: int
    """Longest member's new tokens: the padded length Lmax (host)."""
    max_end: int
    """Largest kv_start + new tokens among the members (host): how many slots attention reads."""
    src: torch.Tensor
    """[num new tokens] packed row of each real token."""
    dst: torch.Tensor
    """[num new tokens] its row in the [len(seqs) * width] padded layout."""
    index: torch.Tensor
    """[Bp] `seqs` as a tensor (to gather per-sequence rows of pages and tables)."""
    fresh: torch.Tensor
    """[Bp] bool: the sequence starts at position 0 (its state starts from zeros)."""
    lens: torch.Tensor
    """[Bp] new tokens of each member."""
    kv_starts: torch.Tensor
    """[Bp] MLA slot of each member's first new token."""


class PagedMixer:
    """`Mixer` over pool pages; mutates the pages of the sequences in `step` (and only those).

    Construction adds the step's metadata to `meta` (a new `StepMetadata` when None) and moves it
    to the pool's device, so a caller that wants more fields in the same copy (the runner's token
    ids, rows to sample) adds them before and reads them after."""

    def __init__(self, caches: PagedCaches, step: PagedStep, meta: StepMetadata | None = None) -> None:
        self.caches, self.step = caches, step
        views = [*caches.kda_state.values(), *caches.mla_latent.values()]
        dev = self.device = views[0].device if views else torch.device("cpu")  # metadata lives with the pool
        self.meta = meta = meta if meta is not None else StepMetadata()
        batch = step.batch
        offsets, new_lens = batch.offsets, batch.new_lens
        self.kv_starts = batch.starts if step.kv_starts is None else list(step.kv_starts)
        self.decode, self.prefill = step.decode_seqs, step.prefill_seqs
        # Decode rows: every new token of the decode sequences (one each, several for a chained one), each
        # attending to its sequence's slots up to itself.
        rows_of = [range(offsets[i], offsets[i] + new_lens[i]) for i in self.decode]
        self.num_decode_rows = sum(len(r) for r in rows_of)
        self.chained = self.num_decode_rows > len(self.decode)  # some sequence runs several tokens decode-shaped
        self.pure_decode = self.num_decode_rows == batch.num_tokens  # every row decodes: no gathers needed
        decode_lens = [self.kv_starts[i] + 1 + t for i, r in zip(self.decode, rows_of) for t in range(len(r))]
        key = {"positions": meta.add(batch.position_list()),  # [N] token positions (RoPE)
               "decode_seq_lens": meta.add(decode_lens)}  # [Nd] attention length of each decode row
        self.max_decode_len = max(decode_lens, default=0)
        if not self.pure_decode:
            key["decode_rows"] = meta.add(r for rows in rows_of for r in rows)  # [Nd]
        if not self.pure_decode or self.chained:
            key["decode_index"] = meta.add(i for i, r in zip(self.decode, rows_of) for _ in r)  # [Nd] sequence of each row
        chain_keys: dict[tuple[int, int], int] = {}  # (id(state pages), id(position pages)) -> key of dst pages
        if self.chained:
            key["decode_seqs"] = meta.add(self.decode)  # [Bd]
            key["decode_cu"] = meta.add([0] + list(itertools.accumulate(len(r) for r in rows_of)))  # [Bd + 1]
            for layer, state_list in step.state_pages.items():
                position_list = step.position_pages[layer]
                pair = (id(state_list), id(position_list))
                if pair not in chain_keys:  # each row writes its position page; a sequence's last, its own page
                    chain_keys[pair] = meta.add(p for i in self.decode for p in position_list[i] + [state_list[i]])
        # Layers of one cache group share their host lists: one device copy per group.
        kda_keys: dict[int, int] = {}  # id(pages) -> key
        for pages in step.state_pages.values():
            if id(pages) not in kda_keys:
                kda_keys[id(pages)] = meta.add(pages)  # [B]
        mla_keys: dict[int, tuple[int, int, int]] = {}  # id(table) -> keys of (table, write pages, write slots)
        for table in step.block_tables.values():
            if id(table) not in mla_keys:
                mla_keys[id(table)] = self._add_table(table)
        self.prefill_groups = _length_buckets(self.prefill, [new_lens[i] for i in self.prefill])
        # MLA prefill cost grows with (new tokens x context): bucket by context length instead.
        self.attn_groups = _length_buckets(self.prefill, [self.kv_starts[i] + new_lens[i] for i in self.prefill])
        bucket_keys = {tuple(seqs): self._add_bucket(seqs) for seqs in self.prefill_groups + self.attn_groups}
        if step.position_pages is not None and step.check:
            check_position_pages(step.position_pages, batch)
        position_keys = (add_position_writes(meta, step.position_pages, self.prefill_groups)
                         if step.position_pages is not None else {})
        meta.move(dev)
        self.position_writes = {k: (meta[a], meta[b], meta[c], top) for k, (a, b, c, top) in position_keys.items()}
        self.positions = meta[key["positions"]]
        self.decode_seq_lens = meta[key["decode_seq_lens"]]
        self.decode_rows = slice(None) if self.pure_decode else meta[key["decode_rows"]]
        self.decode_index = meta[key["decode_index"]] if "decode_index" in key else slice(None)
        if self.chained:
            self.decode_seq_index, self.decode_cu = meta[key["decode_seqs"]], meta[key["decode_cu"]]
            self.chain_dst = {layer: meta[chain_keys[(id(p), id(step.position_pages[layer]))]]
                              for layer, p in step.state_pages.items()}  # [Nd] page each decode row writes
        self.state_pages = {i: meta[kda_keys[id(p)]] for i, p in step.state_pages.items()}  # [B] each
        self.tables = {i: meta[mla_keys[id(t)][0]] for i, t in step.block_tables.items()}  # [B, max_blocks] each
        self.write_slots = {i: (meta[mla_keys[id(t)][1]], meta[mla_keys[id(t)][2]])
                            for i, t in step.block_tables.items()}  # ([N] page, [N] slot in page) each
        self.buckets: dict[tuple[int, ...], _Bucket] = {}
        for seqs, (width, max_end, (src, dst, index, fresh, lens, starts)) in bucket_keys.items():
            self.buckets[seqs] = _Bucket(list(seqs), width, max_end, src=meta[src], dst=meta[dst], index=meta[index],
                                         fresh=meta[fresh].bool(), lens=meta[lens], kv_starts=meta[starts])

    def _add_table(self, table: list[list[int]]) -> tuple[int, int, int]:
        """Adds one cache group's block table [B, max_blocks] (padded with -1) and where each new
        token's MLA entry goes: its page and slot in the page, [N] each. Returns their keys."""
        meta, new_lens = self.meta, self.step.batch.new_lens
        block_tokens = next(iter(self.caches.mla_latent.values())).shape[1]
        slots = [k + t for k, n in zip(self.kv_starts, new_lens) for t in range(n)]  # [N] MLA slot of each new token
        seq_of_token = [i for i, n in enumerate(new_lens) for _ in range(n)]  # [N]
        width = max(len(row) for row in table)
        return (meta.add((p for row in table for p in row + [-1] * (width - len(row))), len(table), width),
                meta.add(table[i][s // block_tokens] for i, s in zip(seq_of_token, slots)),
                meta.add(s % block_tokens for s in slots))

    def _add_bucket(self, seqs: list[int]) -> tuple[int, int, tuple[int, ...]]:
        """Adds a bucket's metadata to the buffer: (width, max_end, keys of src, dst, index,
        fresh, lens, kv_starts). Packed row src[r] goes to row dst[r] of the padded layout."""
        batch, meta = self.step.batch, self.meta
        lens, offsets = [batch.new_lens[i] for i in seqs], batch.offsets
        width = max(lens)
        max_end = max(self.kv_starts[i] + n for i, n in zip(seqs, lens))
        keys = (meta.add(offsets[i] + t for i, n in zip(seqs, lens) for t in range(n)),
                meta.add(j * width + t for j, n in enumerate(lens) for t in range(n)),
                meta.add(seqs), meta.add(int(batch.starts[i] == 0) for i in seqs), meta.add(lens),
                meta.add(self.kv_starts[i] for i in seqs))
        return width, max_end, keys

    def kda(self, index: int, layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
        state, conv = self.caches.kda_state[index], self.caches.kda_conv[index]
        pages = self.state_pages[index]  # [B]
        mixed, g, beta, gate = layer.project(x)
        if self.pure_decode:  # the decode output is the whole core
            pages_d, mixed_d, g_d, beta_d, core = pages, mixed, g, beta, None
        else:
            rows = self.decode_rows
            pages_d, mixed_d, g_d, beta_d = pages[self.decode_index], mixed[rows], g[rows], beta[rows]
            core = torch.empty(x.shape[0], layer.num_heads, layer.head_dim, dtype=torch.float32, device=x.device)
        if self.chained:  # a row per token, each sequence's rows chained through their pages
            out = kda_decode_tokens(mixed_d, g_d, beta_d, state, conv, layer.head_major_taps(),
                                    pages[self.decode_seq_index], self.chain_dst[index], self.decode_cu,
                                    impl=self.step.impl, check=self.step.check)
            if core is None:
                return layer.output(out, gate)
            core[self.decode_rows] = out
        elif self.decode:
            if self.step.impl == "cpu" and mixed_d.dtype == conv.dtype == torch.float32:
                # Fused: the conv tails are read and shifted in their pages (twin: decode_conv).
                qkv = require_cpu_ops(mixed_d.device).kda_conv_step(mixed_d, conv, layer.head_major_taps(), pages_d)
                q, k, v = qkv.unbind(2)
            else:
                q, k, v, tails = layer.decode_conv(mixed_d, conv.index_select(0, pages_d))
                conv.index_copy_(0, pages_d, tails.to(conv.dtype))
            out = kda_decode_step(q, k, v, g_d, beta_d, state, pages_d, impl=self.step.impl, check=self.step.check)
            if core is None:
                return layer.output(out, gate)
            core[self.decode_rows] = out
        for group in self.prefill_groups:
            writes = (self.position_writes.get((id(self.step.position_pages[index]), tuple(group)))
                      if self.position_writes else None)
            self._kda_prefill(layer, self.buckets[tuple(group)], mixed, g, beta, state, conv, pages, core, writes)
        return layer.output(core, gate)

    def _kda_prefill(self, layer: KDALayer, bucket: _Bucket, mixed: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, conv: torch.Tensor, pages: torch.Tensor,
                     core: torch.Tensor, writes: PositionWrites | None = None) -> None:
        """Chunked KDA over several sequences' new tokens at once, right-padded to the longest.

        Padded steps get beta = 0 (nothing written) and g = 0 (no decay), so they leave the state
        exactly as the last real token left it; their outputs are discarded. `writes`: the states
        after given positions, into pages of their own as well (models/paged_positions.py).
        """
        num, width, src, dst = len(bucket.seqs), bucket.width, bucket.src, bucket.dst
        padded_mixed, padded_g, padded_beta = (_pad(x, src, dst, num, width) for x in (mixed, g, beta))  # [Bp, Lmax, ...]
        seq_pages = pages.index_select(0, bucket.index)  # [Bp]
        fresh = bucket.fresh[:, None, None, None]  # [Bp, 1, 1, 1]
        # A fresh sequence starts from zeros, whatever its page held before (pages are not cleared).
        init = state.index_select(0, seq_pages).masked_fill(fresh, 0.0)  # [Bp, H, dk, dv]
        tails = _tails_to_layer(conv.index_select(0, seq_pages).masked_fill(fresh[..., None], 0.0))  # [Bp, K-1, 3*qkv]
        q, k, v, ext = layer.short_conv(padded_mixed, tails)
        form, chunk_len = torch_prefill_form(num, width)
        positions = range(1, writes[3] + 1) if writes is not None else ()
        if self.step.impl != "triton" and form == "recurrent":
            o, final, kept = recurrent_kda_states(q, k, v, padded_g, padded_beta, initial_state=init,
                                                  state_positions=positions)
        else:
            o, final, kept = chunk_kda(q, k, v, padded_g, padded_beta, initial_state=init, impl=self.step.impl,
                                       chunk_len=chunk_len or 16, state_positions=positions)
        if writes is not None:
            write_position_states(writes, kept, ext, state, conv, layer.kernel,
                                  lambda tails: _tails_to_pool(tails, layer.num_heads))
        state.index_copy_(0, seq_pages, final.to(state.dtype))
        ends = bucket.lens[:, None] + torch.arange(layer.kernel - 1, device=self.device)[None]  # [Bp, K-1] ext rows of the new tail
        new_tails = ext[torch.arange(num, device=self.device)[:, None], ends]  # [Bp, K-1, 3*qkv]
        conv.index_copy_(0, seq_pages, _tails_to_pool(new_tails, layer.num_heads).to(conv.dtype))
        core.index_copy_(0, src, o.reshape(num * width, *o.shape[2:]).index_select(0, dst).to(core.dtype))

    def mla(self, index: int, layer: MLALayer, x: torch.Tensor) -> torch.Tensor:
        cache = self.caches.mla_latent[index]  # [P, bt, d_c + d_r]
        tables = self.tables[index]  # [B, max_blocks]
        q_nope, q_rope = layer.queries(x, self.positions)
        latent = layer.latent(x, self.positions)  # [N, d_c + d_r]
        # Write the new tokens' entries before attending: prefill attends to itself.
        cache[self.write_slots[index]] = latent.to(cache.dtype)
        w_uk, w_uv = layer.up_projections()
        out = torch.empty(x.shape[0], layer.num_heads, layer.v_dim, dtype=x.dtype, device=x.device)
        if self.decode:
            rows = self.decode_rows
            # Head-batched matmuls (cheaper than the equivalent einsums at these sizes).
            q_lat = torch.bmm(q_nope[rows].float().transpose(0, 1), w_uk.float()).transpose(0, 1)  # [Bd, H, d_c]
            if self.step.kv_observer is None:
                o_lat = paged_mla_decode(q_lat, q_rope[rows].float(), cache, tables[self.decode_index],
                                         self.decode_seq_lens, scale=layer.scale, impl=self.step.impl,
                                         check=self.step.check, max_seq_len=self.max_decode_len)
            else:
                o_lat = self._observed_decode(index, layer, q_lat, q_rope[rows].float(), cache,
                                              tables[self.decode_index])
            out[rows] = torch.bmm(o_lat.transpose(0, 1), w_uv.float().transpose(1, 2)).transpose(0, 1).to(out.dtype)
        for group in self.attn_groups:
            self._mla_prefill(index, layer, self.buckets[tuple(group)], q_nope, q_rope, cache, tables, out)
        return layer.output(x, out)

    def _observed_decode(self, index: int, layer: MLALayer, q_lat: torch.Tensor, q_rope: torch.Tensor,
                         cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Decode attention for token eviction: over the pages plus the observer's extra rows
        (merged exactly, as one softmax over both), reporting what each slot and row received.
        Without extra rows the output is the plain path's, bit for bit."""
        obs, seqs, lens = self.step.kv_observer, self.decode, self.decode_seq_lens
        o_lat, lse = paged_mla_decode(q_lat, q_rope, cache, tables, lens, scale=layer.scale, impl=self.step.impl,
                                      check=self.step.check, return_lse=True, max_seq_len=self.max_decode_len)
        q_full = torch.cat([q_lat, q_rope], dim=-1)  # [Bd, H, d_c + d_r]
        extra = obs.extra_kv(index, seqs, q_full)
        extra_weights = None
        if extra is not None:
            o_extra, lse_extra, scores = dense_attention(q_full, extra[0], extra[1], scale=layer.scale,
                                                         value_dim=layer.kv_lora_rank)
            o_lat, lse = merge_attention(o_lat, lse, o_extra, lse_extra)
            extra_weights = (scores - lse[..., None]).exp().sum(dim=1)  # [Bd, M]
        weights = paged_mla_weights(q_lat, q_rope, cache, tables, lens, lse, scale=layer.scale, impl=self.step.impl)
        obs.observe(index, seqs, weights, extra_weights)
        return o_lat.to(q_lat.dtype)

    def _mla_prefill(self, index: int, layer: MLALayer, bucket: _Bucket, q_nope: torch.Tensor,
                     q_rope: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, out: torch.Tensor) -> None:
        """Causal attention of several sequences' new tokens over their pages (absorbed form, as
        decode), queries right-padded to the longest chunk: `paged_mla_prefill`, which reads the
        pages through the block table and never holds more than one tile of scores (torch: tiles of
        `PREFILL_TILE_SLOTS` slots gathered one at a time, online softmax; Triton: registers), so
        memory does not grow with the context beyond the pages themselves. Padded query rows and
        slots past a sequence's end are masked out of the softmax; slots past the end are never
        read (Triton) or zeroed in each gathered tile (torch): pages not written yet may hold
        anything, NaN included, from an earlier owner, and 0 * NaN would leak it (zeroing is
        unconditional: testing for non-finite values first would make the host wait for the
        device). Padded outputs are dropped. With a `kv_observer`, see `_observed_prefill`."""
        num, width, src, dst = len(bucket.seqs), bucket.width, bucket.src, bucket.dst
        heads, d_c = layer.num_heads, layer.kv_lora_rank
        w_uk, w_uv = (w.float() for w in layer.up_projections())
        qn = _pad(q_nope, src, dst, num, width).float().view(num * width, heads, -1)  # [Bp*Lq, H, Dn]
        q_lat = torch.bmm(qn.transpose(0, 1), w_uk).transpose(0, 1).reshape(num, width, heads, d_c)  # [Bp, Lq, H, d_c]
        qr = _pad(q_rope, src, dst, num, width).float().view(num, width, heads, -1)  # [Bp, Lq, H, Dr]
        seq_tables = tables.index_select(0, bucket.index)  # [Bp, max_blocks]
        o_lat, lse = paged_mla_prefill(q_lat, qr, cache, seq_tables, bucket.kv_starts, bucket.lens, scale=layer.scale,
                                       impl=self.step.impl, check=self.step.check, max_end=bucket.max_end,
                                       tile_slots=PREFILL_TILE_SLOTS)  # [Bp, Lq, H, d_c], [Bp, Lq, H]
        if self.step.kv_observer is not None:
            o_lat = self._observed_prefill(index, layer, bucket, q_lat, qr, cache, seq_tables, o_lat, lse)
        o = torch.bmm(o_lat.reshape(num * width, heads, d_c).transpose(0, 1), w_uv.transpose(1, 2))  # [H, Bp*Lq, Dv]
        out.index_copy_(0, src, o.transpose(0, 1).index_select(0, dst).to(out.dtype))

    def _observed_prefill(self, index: int, layer: MLALayer, bucket: _Bucket, q_lat: torch.Tensor,
                          q_rope: torch.Tensor, cache: torch.Tensor, seq_tables: torch.Tensor, o_lat: torch.Tensor,
                          lse: torch.Tensor) -> torch.Tensor:
        """Token eviction's prefill: the observer's extra rows (older than the chunk: every query
        row sees the valid ones) attended in tiles and merged exactly with the pages' (o_lat, lse)
        [Bp, Lq, H, d_c], [Bp, Lq, H]; then, with the final lse, a second pass over the tiles gives
        the probability each slot and extra row received, summed over heads and the chunk's real
        rows (`obs.observe`). Returns o_lat; without extra rows it is the one given, bit for bit."""
        obs, seqs, lens = self.step.kv_observer, bucket.seqs, bucket.lens
        num, width, heads, d_c = q_lat.shape
        extra = obs.extra_kv(index, seqs, None)
        extra_weights = None
        if extra is not None:
            q = torch.cat([q_lat, q_rope], dim=-1).view(num, width * heads, -1)  # [Bp, Lq*H, d_c + d_r]
            o_x, lse_x = attend_rows(q, extra[0], extra[1], scale=layer.scale, value_dim=d_c,
                                     tile_slots=PREFILL_TILE_SLOTS)  # [Bp, Lq*H, d_c], [Bp, Lq*H]
            o, lse_all = merge_attention(o_lat.view(num, width * heads, d_c), lse.view(num, width * heads), o_x, lse_x)
            o_lat, lse = o.view(num, width, heads, d_c), lse_all.view(num, width, heads)
            real = (torch.arange(width, device=self.device) < lens[:, None]).float()  # [Bp, Lq] 0 = padding
            extra_weights = attend_rows_weights(q, extra[0], extra[1], lse_all, real.repeat_interleave(heads, dim=1),
                                                scale=layer.scale, tile_slots=PREFILL_TILE_SLOTS)  # [Bp, M]
        resident = paged_mla_prefill_weights(q_lat, q_rope, cache, seq_tables, bucket.kv_starts, lens, lse,
                                             scale=layer.scale, max_end=bucket.max_end,
                                             tile_slots=PREFILL_TILE_SLOTS)  # [Bp, span]
        obs.observe(index, seqs, resident, extra_weights)
        return o_lat
