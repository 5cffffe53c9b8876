"""The engine's token mixing, replayed inside a whole-sequence forward: `EngineMixer`.

A mixer (models/model.py `Mixer`) whose `kda` and `mla` compute a layer over the packed whole
sequences exactly as the rollout engine computed it: the recorded engine steps are rerun one after
the other through the engine's own `PagedMixer` (models/paged.py) over a page pool of the engine's
layout, each step with the same sequences, first positions and new tokens as in the engine. So a
KDA layer runs the engine's fused projections (outside `unfused()`), its recurrent or chunked
prefill over the prompt, the decode kernel per sampled token and its state pages in
`engine.kda_state_dtype`; an MLA layer writes its latents to pages in the cache dtype and attends
through `paged_mla_prefill` / `paged_mla_decode` (the absorbed form). Token mixing is causal and per
layer, so a layer's outputs over the whole sequences may be computed step by step, given that layer's
inputs at every position: the replay runs layer-major, the engine ran step-major, and the two see the
same mixing ops on the same inputs. What differs is only the batching of everything else (norms,
MLPs, the head ran over one step's rows in the engine, over all rows here).

Pages: sequence i's KDA state is page i (every layer: a layer is replayed in full before the next,
and each starts from zeros at position 0), its MLA entries the pages after those, one run per
sequence. Page slots of different layers may overlap; no two layers are live at once.
"""
from __future__ import annotations

import math

import torch

from memory.layout import CacheLayout
from memory.page_pool import PagePool
from models.kda import KDALayer
from models.mla import MLALayer
from models.model import HybridLM
from models.paged import PagedCaches, PagedMixer, PagedStep
from models.state import SegmentBatch
from rl.mismatch.record import Rollout


class EngineMixer:
    """`Mixer` over whole sequences (the rollout's packed layout) that replays the engine's steps.

    Holds its own page pool (`layout`'s pages, as many as the rollout needs) on `device`; each call
    of `kda`/`mla` overwrites the pages it uses. `impl`: the engine's kernel implementation
    (rollout/step_record.py `StepRecord.impl`)."""

    def __init__(self, model: HybridLM, layout: CacheLayout, rollout: Rollout, impl: str) -> None:
        self.impl = impl
        seq_lens, offsets = rollout.seq_lens, rollout.offsets
        num_seqs = len(seq_lens)
        mla_runs = [math.ceil(n / layout.block_tokens) for n in seq_lens]
        first = [num_seqs + sum(mla_runs[:i]) for i in range(num_seqs)]
        self.mla_pages = [list(range(f, f + m)) for f, m in zip(first, mla_runs)]  # per sequence, in order
        self.block_tokens = layout.block_tokens
        pool = PagePool(layout, num_seqs + sum(mla_runs), rollout.device)
        cfg = model.config
        kda = {i: pool.kda_views(i) for i in cfg.kda_layers}
        self.caches = PagedCaches(kda_state={i: v[0] for i, v in kda.items()},
                                  kda_conv={i: v[1] for i, v in kda.items()},
                                  mla_latent={i: pool.mla_view(i) for i in cfg.mla_layers})
        self.pool = pool  # owns the views' buffer
        self.steps = []
        for step in rollout.schedule:
            seqs = [seq for seq, _, _ in step]
            batch = SegmentBatch(new_lens=[n for _, _, n in step], starts=[s for _, s, _ in step])
            rows = torch.tensor([offsets[seq] + start + t for seq, start, n in step for t in range(n)],
                                dtype=torch.long, device=rollout.device)  # [step tokens] packed rows
            self.steps.append((seqs, batch, rows))

    def kda(self, index: int, layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] the layer's input over the whole sequences -> [N, D], as the engine mixed it."""
        out = torch.empty_like(x)
        for seqs, batch, rows in self.steps:
            step = PagedStep(batch=batch, state_pages={index: seqs}, block_tables={}, impl=self.impl, check=False)
            out.index_copy_(0, rows, PagedMixer(self.caches, step).kda(index, layer, x.index_select(0, rows)))
        return out

    def mla(self, index: int, layer: MLALayer, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, D]: MLA over the engine's pages, step by step (each sequence's block table
        as long as its tokens so far, as the engine grows it)."""
        out = torch.empty_like(x)
        for seqs, batch, rows in self.steps:
            tables = [self.mla_pages[seq][:math.ceil((start + n) / self.block_tokens)]
                      for seq, start, n in zip(seqs, batch.starts, batch.new_lens)]
            step = PagedStep(batch=batch, state_pages={}, block_tables={index: tables}, impl=self.impl, check=False)
            out.index_copy_(0, rows, PagedMixer(self.caches, step).mla(index, layer, x.index_select(0, rows)))
        return out
