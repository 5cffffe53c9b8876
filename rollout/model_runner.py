"""Turns a scheduled step into one paged forward of the model and returns the logits to sample.

Per step it packs the sequences' new tokens (`SegmentBatch`), hands the mixer each layer's pages
(state page per KDA group, block table per MLA group: host lists) and runs `HybridLM.run_layers`
with `PagedMixer` over the pool's typed views. Logits are formed only for sequences whose step
reaches their last token (the ones that will sample). Token ids and rows to sample join the
mixer's metadata: the whole step's integers reach the device in one copy (`StepMetadata`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memory.page_pool import PagePool
from models.model import HybridLM
from models.paged import PagedCaches, PagedMixer, PagedStep, StepMetadata
from models.state import SegmentBatch
from rollout.kv import CacheManager
from rollout.sampling import SamplingRows
from rollout.scheduler import ScheduledStep
from rollout.speculative import Verification


def sampling_indices(step: ScheduledStep) -> list[int]:
    """Indices into step.seqs whose new tokens reach their last token: the sequences that sample
    after this step (known before the forward pass)."""
    return [i for i, (s, n) in enumerate(zip(step.seqs, step.num_new_tokens)) if s.num_computed + n == s.num_tokens]


class ModelRunner:
    def __init__(self, model: HybridLM, pool: PagePool, cache: CacheManager, impl: str) -> None:
        self.model, self.pool, self.cache, self.impl = model, pool, cache, impl
        self.layout = pool.layout
        self._views: PagedCaches | None = None

    @property
    def views(self) -> PagedCaches:
        """Typed per-layer views of the pool (rebuilt after the pool is re-acquired)."""
        if self._views is None:
            cfg = self.model.config
            kda = {i: self.pool.kda_views(i) for i in cfg.kda_layers}
            self._views = PagedCaches(kda_state={i: v[0] for i, v in kda.items()},
                                      kda_conv={i: v[1] for i, v in kda.items()},
                                      mla_latent={i: self.pool.mla_view(i) for i in cfg.mla_layers})
        return self._views

    def invalidate_views(self) -> None:
        self._views = None

    @torch.inference_mode()  # cheaper per op than no_grad: no version counters or view tracking
    def run(self, step: ScheduledStep, sampling: SamplingRows | None = None, verify: Verification | None = None
            ) -> tuple[list[int], torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Compute the step's tokens into the pool. Returns (indices into step.seqs that reached
        their last token (`sampling_indices`), their next-token logits [num_sampling, vocab]
        float32, the sampler's settings on the device [rows, 4] float64 or None, the verifying
        sequences' logits at each of their k + 1 positions [sum k + 1, vocab] or None).
        `sampling`: the sampler's rows (rollout/sampling.py `SamplingRows`), whose settings and draws
        ride in the step's one metadata copy; None (or all greedy) = nothing to ship. `verify`: the
        step's speculative verifications (rollout/speculative/speculation.py): their proposals run after their
        last token, and their KDA states at each position go to their position pages."""
        seqs = step.seqs
        batch = SegmentBatch(new_lens=list(step.num_new_tokens), starts=[s.num_computed for s in seqs])
        sampling_rows, sampling = sampling, sampling_indices(step)
        offsets = batch.offsets
        proposals = dict(zip(verify.index, verify.proposals)) if verify is not None else {}
        # Token ids, rows to sample and the sampler's settings ride in the mixer's one metadata
        # copy (models/paged.py).
        meta = StepMetadata()
        settings_key = (meta.add_floats(sampling_rows.values, sampling_rows.fill_draws)
                        if sampling_rows is not None and sampling_rows.num_stochastic else None)
        token_key = meta.add(t for i, (s, n) in enumerate(zip(seqs, step.num_new_tokens))
                             for t in s.tokens[s.num_computed:s.num_computed + n] + proposals.get(i, []))  # [N]
        every_row = sampling == list(range(len(seqs))) and batch.num_tokens == len(seqs)  # pure decode
        verify_rows = [offsets[i] + t for i in proposals for t in range(step.num_new_tokens[i])]
        rows_key = None if every_row else meta.add([offsets[i] + step.num_new_tokens[i] - 1 for i in sampling]
                                                   + verify_rows)
        state_pages, tables = self.cache.state_pages(seqs), self.cache.block_tables(seqs)
        cfg = self.model.config
        observer = self.cache.observer(seqs, list(step.num_new_tokens))  # None without a KV budget
        paged = PagedStep(batch=batch,
                          state_pages={i: state_pages[self.layout.group_of(i)[1]] for i in cfg.kda_layers},
                          block_tables={i: tables[self.layout.group_of(i)[1]] for i in cfg.mla_layers},
                          impl=self.impl, check=False,
                          kv_starts=[s.kv_len for s in seqs] if observer is not None else None, kv_observer=observer,
                          position_pages=self._position_pages(len(seqs), verify))
        mixer = PagedMixer(self.views, paged, meta)  # moves `meta` to the device
        hidden = self.model.run_layers(meta[token_key], mixer)  # [N, D]
        last = hidden if rows_key is None else hidden.index_select(0, meta[rows_key])  # [num_sampling + verify, D]
        logits = F.linear(last, self.model.output_weight).float()
        for s, n in zip(seqs, step.num_new_tokens):
            s.num_computed += n
        self.cache.observed(observer)
        settings = None if settings_key is None else meta.floats(settings_key)
        if verify is None:
            return sampling, logits, settings, None
        return sampling, logits[:len(sampling)], settings, logits[len(sampling):]

    def _position_pages(self, num_seqs: int, verify: Verification | None) -> dict[int, list[list[int]]] | None:
        """PagedStep.position_pages of a step: per KDA layer (one list per cache group), each sequence's
        position pages ([] unless it verifies)."""
        if verify is None:
            return None
        per_group = []
        for g in range(self.cache.num_kda_groups):
            rows: list[list[int]] = [[] for _ in range(num_seqs)]
            for i, pages in zip(verify.index, verify.position_pages):
                rows[i] = pages[g]
            per_group.append(rows)
        return {i: per_group[self.layout.group_of(i)[1]] for i in self.model.config.kda_layers}
