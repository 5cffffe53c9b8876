"""The engine's steps under expert parallelism: every step is a step of the whole expert-parallel
group (models/expert_parallel.py), since each MoE layer exchanges tokens with every rank of it.

Each rank decodes its own sequences (data-parallel attention). Before a step's forward the group
agrees (`ExpertParallel.round`: one all-reduce of [ranks with a step to run, ranks with work
left]); a rank without sequences this step joins the peers' exchanges with zero tokens
(`HybridLM.join_experts`). A rank waiting on something else (tool calls) keeps joining
(`idle_step`); a rank whose generation is over `drain`s (joins until no rank has work left), once
per generation on every rank. Without expert parallelism every call is free and returns at once.
"""
from __future__ import annotations

import torch

from models.model import HybridLM


class Lockstep:
    def __init__(self, model: HybridLM) -> None:
        self.model = model

    @property
    def expert_parallel(self):
        """The model's expert-parallel group, None when it holds every expert."""
        return self.model.expert_parallel

    @torch.inference_mode()
    def _join(self) -> None:
        self.model.join_experts()

    def before_step(self, has_step: bool, unfinished: bool) -> None:
        """Agree on this step with the peers; join theirs when this rank has none to run."""
        ep = self.expert_parallel
        if ep is None:
            return
        busy, _ = ep.round(has_step, unfinished)
        if busy and not has_step:
            self._join()

    def idle_step(self, unfinished: bool = True) -> bool:
        """A step without sequences of this rank's (`unfinished`: it still has work, e.g. waiting on
        tool calls): joins the peers' step when one runs; returns whether one did."""
        ep = self.expert_parallel
        if ep is None:
            return False
        busy, _ = ep.round(False, unfinished)
        if busy:
            self._join()
        return busy

    def drain(self) -> int:
        """Join the peers' steps until no rank of the group has work left; returns the steps joined."""
        joined, ep = 0, self.expert_parallel
        while ep is not None:
            busy, unfinished = ep.round(False, False)
            if busy:
                self._join()
                joined += 1
            if not unfinished:
                break
        return joined
