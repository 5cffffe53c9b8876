"""The environment protocol every task implements.

An episode: `reset(seed)` returns the first prompt (text); the policy answers; `step(answer)`
returns a StepResult with the next observation (the text appended to the conversation before
the next turn), the reward of this turn and whether the episode is done. Single-turn tasks are
done after one step; multi-turn (tool-using) tasks return an observation (e.g. a tool result)
and the driver sends the whole conversation so far as the next request, marking the turn
boundary (where the prefix cache keeps its durable checkpoints).
With a data source (rl/envs/data.py), an environment whose `reset` takes a `row` keyword receives the
group's data row ({"prompt", "label", extras}) and may return its prompt as chat messages.
A task is a registered name or an import path "package.module:Class".
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StepResult:
    observation: str
    """Text appended to the conversation after the policy's answer ("" when done)."""
    reward: float
    done: bool
    components: dict[str, float] = field(default_factory=dict)
    """Named parts of the reward, logged separately (the driver's `reward/<name>` metrics)."""
    is_correct: bool | None = None
    """Whether the episode's answer was right, when the environment knows (else reward >= 1 counts)."""
    role: str = "user"
    """The chat role the observation is rendered in ("tool" for a tool's reply: the chat template's
    tool/observation turn), tokenized on its own and appended (the conversation's tokens only grow)."""


class Environment(Protocol):
    max_turns: int
    """The driver stops an episode after this many policy turns (reward so far counts)."""

    def reset(self, seed: int) -> str:
        """Start an episode; returns the first prompt. Deterministic given `seed`. An environment
        fed from data defines `reset(seed, row=None)` and may return a list of chat messages."""

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


def resolve_task(name: str) -> Callable[..., Environment]:
    """The factory of task `name`: a registered name, or an import path "package.module:Class"."""
    if name in TASKS:
        return TASKS[name]
    if ":" not in name:
        raise ValueError(f"unknown task {name!r}, expected one of {sorted(TASKS)} or an import path "
                         f"'package.module:Class'")
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"task {name!r}: expected an import path 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"task {name!r}: cannot import module {module_name!r} ({err})") from None
    target = getattr(module, attr, None)
    if target is None:
        raise ValueError(f"task {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not isinstance(target, type):
        raise ValueError(f"task {name!r}: {attr!r} is a {type(target).__name__}, expected a class")
    return target


def make_task(name: str, **kwargs) -> Environment:
    return resolve_task(name)(**kwargs)
