"""Per-position KDA states of a paged step: speculative verification's rollback slots.

A verification pass runs a sequence's last token and k proposals as one chunk. MLA's cache rolls back by
its length alone, but a KDA layer's state (and its short-conv tails) has absorbed every token of the chunk
by the end. So the step also writes, for each sequence that asks, the state and conv tails after each of
its first n - 1 new tokens into pages of their own (`PagedStep.position_pages`); the state after all n goes
to the sequence's page as always. Rolling back to the last accepted position is then choosing one page
(the engine's speculation): no recompute, no copy. These writes serve verifications on the chunked
prefill path (Triton); the CPU kernels run a verification decode-shaped instead, each token writing its
own page as it goes (`PagedStep.chained_seqs`, kernels/kda/decode_tokens.py).
"""
from __future__ import annotations

import torch

from models.state import SegmentBatch

PositionWrites = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
"""(rows [W] bucket member, positions [W] in 1..n-1, pages [W], the largest position) on the device."""


def add_position_writes(meta, position_pages: dict[int, list[list[int]]], groups: list[list[int]]
                        ) -> dict[tuple[int, tuple[int, ...]], tuple[int, int, int, int]]:
    """For each cache group's page lists (layers of a group share one list object) and each length bucket
    of prefilling sequences, add the writes' metadata to `meta` (a `StepMetadata`, before its move):
    {(id(list), bucket): (keys of rows, positions, pages; the largest position)}; buckets without any
    write are left out."""
    keys = {}
    for pages in {id(p): p for p in position_pages.values()}.values():
        for group in groups:
            rows, at, dst = [], [], []
            for j, seq in enumerate(group):
                for position, page in enumerate(pages[seq], start=1):
                    rows.append(j)
                    at.append(position)
                    dst.append(page)
            if dst:
                keys[(id(pages), tuple(group))] = (meta.add(rows), meta.add(at), meta.add(dst), max(at))
    return keys


def check_position_pages(position_pages: dict[int, list[list[int]]], batch: SegmentBatch) -> None:
    """Each sequence asks for at most n - 1 position pages (n its new tokens), and only in a prefill
    chunk (a decode step of one token has no position before its last)."""
    for layer, pages in position_pages.items():
        if len(pages) != len(batch.new_lens):
            raise ValueError(f"position_pages[{layer}] has {len(pages)} rows for {len(batch.new_lens)} sequences")
        for i, (row, n) in enumerate(zip(pages, batch.new_lens)):
            if len(row) > max(n - 1, 0):
                raise ValueError(f"sequence {i} asks for {len(row)} position pages in layer {layer} with {n} new "
                                 f"tokens: expected at most {max(n - 1, 0)}")


def write_position_states(writes: PositionWrites, states: torch.Tensor, ext: torch.Tensor, state: torch.Tensor,
                          conv: torch.Tensor, kernel: int, to_pool) -> None:
    """Write each requested position's state and conv tails into its page. states: [Bp, P, H, K, V], the
    state after positions 1..P; ext: [Bp, K-1 + width, C], the short conv's input with the old tails in
    front (the tails after p new tokens are its rows p .. p+K-2); state, conv: the layer's pool views
    (mutated at `pages` only); to_pool: the layer-to-pool layout of conv tails."""
    rows, at, pages, _ = writes
    state.index_copy_(0, pages, states[rows, at - 1].to(state.dtype))
    taps = at[:, None] + torch.arange(kernel - 1, device=at.device)[None]  # [W, K-1]
    conv.index_copy_(0, pages, to_pool(ext[rows[:, None], taps]).to(conv.dtype))
