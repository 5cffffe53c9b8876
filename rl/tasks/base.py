"""The environment protocol every task implements (issue 5).

An episode: `reset(seed)` returns the first prompt (text); the policy answers; `step(answer)`
returns a StepResult with the next observation (the text appended to the conversation before
the next turn), the reward of this turn and whether the episode is done. Single-turn tasks are
done after one step; multi-turn (tool-using) tasks return an observation (e.g. a tool result)
and the driver sends the whole conversation so far as the next request, marking the turn
boundary (where the prefix cache keeps its durable checkpoints).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StepResult:
    observation: str
    """Text appended to the conversation after the policy's answer ("" when done)."""
    reward: float
    done: bool


class Environment(Protocol):
    max_turns: int
    """The driver stops an episode after this many policy turns (reward so far counts)."""

    def reset(self, seed: int) -> str:
        """Start an episode; returns the first prompt. Deterministic given `seed`."""

    def step(self, answer: str) -> StepResult:
        """Score the policy's answer to the current turn."""


TASKS: dict[str, Callable[..., Environment]] = {}


def register_task(name: str) -> Callable:
    def wrap(factory: Callable[..., Environment]) -> Callable[..., Environment]:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        TASKS[name] = factory
        return factory

    return wrap


def make_task(name: str, **kwargs) -> Environment:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}, expected one of {sorted(TASKS)}")
    return TASKS[name](**kwargs)
