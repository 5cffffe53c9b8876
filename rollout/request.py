"""Requests, their sequences, and what the engine returns.

A request is one prompt with sampling parameters. It runs as one `Sequence`, or, with n > 1, as
one prompt sequence that is prefilled once and then forked into n sequences sharing its pages.
A sequence's `tokens` are prompt + generated; `num_computed` of them are in the cache. The
scheduler's whole job is to move `num_computed` up to `len(tokens)`; when a step computes the
last token, the engine samples the next one. Preemption by recompute just sets `num_computed`
back to 0 (nothing generated is lost).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
import torch

from rollout.sampling import SamplingParams
from rollout.seq_kv import SeqKV


class SeqStatus(enum.Enum):
    WAITING = "waiting"    # queued; holds no pages
    RUNNING = "running"    # admitted; holds pages
    PAUSED = "paused"      # holds its pages (if any) but is not scheduled until resumed
    FINISHED = "finished"  # done or aborted; holds no pages


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    tokens: list[int]
    """Prompt followed by generated tokens."""
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    num_forks: int = 0
    """> 0 for the prompt sequence of a parallel request: fork into this many when prefilled."""
    num_computed: int = 0
    """Tokens whose cache entries / state are in the pool."""
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    """Per generated token, see rollout/sampling.py for the convention."""
    versions: list[int] = field(default_factory=list)
    """Per generated token, the policy version that sampled it."""
    mla_pages: list[list[int]] = field(default_factory=list)
    """Per MLA cache group, the sequence's pages in logical order."""
    kda_pages: list[int] = field(default_factory=list)
    """Per KDA cache group, the page holding the sequence's private recurrent state."""
    admitted_at: int = -1
    """Admission counter: preemption picks the most recently admitted sequence."""
    turn_boundaries: tuple[int, ...] = ()
    """Token positions where conversation turns end (the request's; the prefix cache checkpoints there)."""
    kv_version: int | None = None
    """The oldest policy version whose KV (or KDA state) this sequence holds: set when its cache is
    first computed or taken from a prefix hit, kept over pauses and weight updates, None after a
    reset. Tokens it samples are tagged with min(sampler's version, this): stale KV makes them stale."""
    kv: SeqKV | None = None
    """With a KV budget (rollout/kv/kv_eviction.py): which tokens its MLA slots hold; None = all of them."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def kv_len(self) -> int:
        """MLA slots the sequence holds: num_computed, less what token eviction removed."""
        return self.num_computed if self.kv is None else self.kv.length

    @property
    def kv_pruned(self) -> bool:
        """Token eviction removed entries: the pages no longer hold the full prefix."""
        return self.kv is not None and self.kv.pruned

    @property
    def holds_pages(self) -> bool:
        return bool(self.kda_pages) or any(self.mla_pages)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    turn_boundaries: list[int] = field(default_factory=list)
    """Token positions where conversation turns end (kept for the prefix cache)."""

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs) and not any(s.num_forks for s in self.seqs)


@dataclass
class SampleOutput:
    tokens: list[int]
    """Generated tokens (prompt excluded)."""
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None
    """"stop" (eos / stop token), "length" (max_new_tokens or max_model_len), "abort", or None while running."""


@dataclass
class RequestOutput:
    request_id: str
    prompt: list[int]
    samples: list[SampleOutput]
    """One per parallel sample, in fork order."""
    finished: bool

    @classmethod
    def of(cls, request: Request) -> "RequestOutput":
        samples = [SampleOutput(s.tokens[s.prompt_len:], list(s.logprobs), list(s.versions), s.finish_reason)
                   for s in request.seqs if not s.num_forks]
        return cls(request.request_id, list(request.prompt), samples, request.finished)
