"""Continuous batching with chunked prefill under a per-step token budget, preemption by swap or recompute.

Each step the scheduler decides how many new tokens each sequence computes:
1. running sequences, oldest admission first: a decoding sequence computes its 1 sampled token,
   a sequence still prefilling computes its next chunk (as much as the remaining budget and the
   cache's `chunk` limit allow: a KV budget, hash-block and turn boundaries);
   when the pool cannot hold the growth, the most recently admitted running sequence is
   preempted, and as a last resort paused sequences are preempted too — the engine never crashes
   on a full pool. The cache manager decides how, per victim (`CacheManager.preempt`): swapped to
   the host tier when it can take the victim's pages (they come back bit for bit, `num_computed`
   kept), else recomputed (pages freed, tokens kept, `num_computed` reset to 0);
2. waiting sequences, first come first served, are admitted while budget, `max_num_seqs` and
   free pages allow (admission never preempts anyone); a swapped-out sequence is swapped in first
   (`CacheManager.swap_in`), and while the pool cannot take it back nobody behind it is admitted.
Bookkeeping only: no tensors here (nano-vllm's split, testable on its own). The scheduler alone
edits its queues; it reaches the KV tiers only through the cache manager's phase methods.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rollout.kv import CacheManager
from rollout.request import SeqStatus, Sequence


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    """Token budget of one step: decode tokens + prefill chunk tokens."""
    max_num_seqs: int = 128
    """Sequences admitted (running) at once."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}, expected >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}, expected >= 1")


@dataclass
class ScheduledStep:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager) -> None:
        self.config, self.cache = config, cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused: list[Sequence] = []
        self._admissions = 0
        self.num_preemptions = 0
        """Every preemption: num_swapped_out + num_recomputed."""
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self.num_recomputed = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if seq not in self.running:  # preempted earlier in this loop
                continue
            want = self.cache.chunk(seq, budget)
            if want == 0:
                break
            while not self.cache.grow(seq, want):
                victim = self._pick_victim(exclude=step.seqs)
                self._preempt(victim, step)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                step.seqs.append(seq)
                step.num_new_tokens.append(want)
                budget -= want
        if not step.preempted:
            held_back = []  # waiting on a pending cache copy: admitted next step, the others go on
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                swapped = self.cache.is_swapped(seq)
                if swapped:
                    if not self.cache.swap_in(seq, self.cache.chunk(seq, budget)):
                        break  # the pool cannot take it back yet
                    self.num_swapped_in += 1
                elif not self.cache.admit(seq):
                    held_back.append(self.waiting.popleft())  # its cached prefix lands next step
                    continue
                want = self.cache.chunk(seq, budget)
                if not self.cache.grow(seq, want):
                    if swapped:  # swap_in made room for this growth too; should it still fail, back out
                        self._count(self.cache.preempt(seq))
                    elif seq.holds_pages:  # a prefix hit that cannot grow now: waiting sequences hold nothing
                        self.cache.reset(seq)
                    break
                self.waiting.popleft()
                seq.status, seq.admitted_at = SeqStatus.RUNNING, self._admissions
                self._admissions += 1
                self.running.append(seq)
                step.seqs.append(seq)
                step.num_new_tokens.append(want)
                budget -= want
            self.waiting.extendleft(reversed(held_back))
        return step

    def _pick_victim(self, exclude: list[Sequence]) -> Sequence:
        """The most recently admitted running sequence not already scheduled; else a paused one
        holding pages; else the newest scheduled one (so the oldest keeps making progress)."""
        candidates = [s for s in self.running if s not in exclude]
        if not candidates:
            candidates = [s for s in self.paused if s.holds_pages] or list(self.running)
        return max(candidates, key=lambda s: s.admitted_at)

    def _preempt(self, seq: Sequence, step: ScheduledStep, swap: bool = True) -> None:
        if swap:
            self._count(self.cache.preempt(seq))
        else:
            self.cache.reset(seq)
            self._count("recompute")
        step.preempted.append(seq)
        if seq.status is SeqStatus.PAUSED:
            return  # stays paused; recomputed after resume
        if seq in step.seqs:
            k = step.seqs.index(seq)
            del step.seqs[k], step.num_new_tokens[k]
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _count(self, how: str) -> None:
        self.num_preemptions += 1
        if how == "swap":
            self.num_swapped_out += 1
        else:
            self.num_recomputed += 1

    # ---- lifecycle ---------------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its pages, wherever it is queued."""
        self.cache.finish(seq)
        for queue in (self.running, self.paused):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """A prefilled prompt split into its samples: the children holding pages take the parent's
        place among the running (in order, with its admission), the others queue to recompute it;
        the parent is finished."""
        for child in children:
            child.status, child.admitted_at = parent.status, parent.admitted_at
        index = self.running.index(parent)
        self.running[index:index + 1] = [c for c in children if c.holds_pages]
        for child in children:
            if not child.holds_pages:
                self.add(child)
        parent.num_forks, parent.status = 0, SeqStatus.FINISHED

    def pause(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        seq.status = SeqStatus.PAUSED
        self.paused.append(seq)

    def resume(self, seq: Sequence) -> None:
        if seq.status is not SeqStatus.PAUSED:
            return
        self.paused.remove(seq)
        if seq.holds_pages:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            self.add(seq)

    def preempt_all(self) -> None:
        """Free every sequence's pages (sleep): running ones go back to waiting, in order, to be
        recomputed, and so are waiting ones swapped out earlier (their slots freed): the host
        tier's room is kept for the paused ones (parked, swapped ones included) and the prefix
        cache's entries."""
        step = ScheduledStep()
        for seq in sorted(self.running + [s for s in self.paused if s.holds_pages],
                          key=lambda s: -s.admitted_at):
            self._preempt(seq, step, swap=False)
        for seq in self.waiting:
            if self.cache.is_swapped(seq):
                self.cache.reset(seq)
