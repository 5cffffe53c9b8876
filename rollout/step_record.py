"""What an engine's steps ran, for diagnostics that redo its computation elsewhere (rl/mismatch).

    with record_steps(engine) as record:
        outputs = engine.generate(prompts, params)

While the block runs, each step's sequences are written down with the position of their first new
token and their new tokens (`StepRecord.steps`: the prefill chunks and decode steps in the batches
the scheduler made), and for each sequence that samples after a step, the final-normed hidden row
its logits came from (`StepRecord.sampled`: the head's input, in sampling order). Nothing the engine
computes changes: the model runner's `run` is wrapped and a forward hook reads the final norm's
output; both are removed when the block ends. Speculative steps (proposals verified in the step)
are refused: their rows are not one token per sampling.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rollout.engine import Engine
from rollout.model_runner import sampling_indices


@dataclass
class StepRecord:
    impl: str
    """The kernel implementation the engine's steps ran ("naive" | "triton" | "cpu")."""
    steps: list[list[tuple[str, int, int]]] = field(default_factory=list)
    """Per step, in order: (request id, position of the first new token, new tokens) of each sequence,
    in the step's order."""
    sampled: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Request id -> the [D] final hidden rows its sequence sampled from, one per sampled token, in
    the model dtype. (A parallel request's forks share the id: record n=1 requests.)"""


@contextmanager
def record_steps(engine: Engine) -> Iterator[StepRecord]:
    """Record what `engine`'s steps run inside the block (module docstring)."""
    runner, norm = engine.runner, engine.model.model.norm
    record = StepRecord(impl=runner.impl)
    captured: list[torch.Tensor] = []
    run = runner.run

    def recording_run(step, sampling=None, verify=None):
        if verify is not None:
            raise RuntimeError("record_steps: a speculative step (turn speculative decoding off to record)")
        entries = [(s.request_id, s.num_computed, n) for s, n in zip(step.seqs, step.num_new_tokens)]
        samplers = sampling_indices(step)  # before the run moves num_computed on
        out = run(step, sampling, verify)
        hidden = captured.pop()  # [N, D] the final norm's output over the step's tokens
        ends = list(itertools.accumulate(step.num_new_tokens))
        for i in samplers:
            record.sampled.setdefault(entries[i][0], []).append(hidden[ends[i] - 1].clone())
        record.steps.append(entries)
        return out

    hook = norm.register_forward_hook(lambda module, args, out: captured.append(out))
    runner.run = recording_run
    try:
        yield record
    finally:
        del runner.run  # the instance attribute goes; the class's method is back
        hook.remove()
