"""A single-turn verifiable task a tiny byte-level model can learn on CPU: the majority digit.

Prompt: "<digits>=" with `length` digits drawn from 1..9, redrawn until one digit is strictly the
most frequent; the answer is that digit. The answer's first character is checked: 1.0 if it is that digit, `format_reward` if it is some other digit, 0
otherwise. A random policy over 259 byte tokens scores ~0; always answering a digit scores
`format_reward`; only reading the prompt scores 1, so a rising mean reward means the policy learned
to count, not to game the format (the format credit is capped far below).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from rl.envs.tasks.base import StepResult, register_task


@register_task("majority_digit")
@dataclass
class MajorityDigit:
    length: int = 3
    """Digits in the prompt (3: what the tiny CPU model learns in a few minutes)."""
    format_reward: float = 0.1
    """Reward for answering with a digit that is wrong."""
    max_turns: int = 1
    """Single turn."""
    _answer: str = field(default="", init=False, repr=False)
    answer_tokens: ClassVar[int] = 1
    """The answer length it needs (rollout.max_new_tokens=null): one digit."""

    def __post_init__(self) -> None:
        if self.length < 3:
            raise ValueError(f"length={self.length}, expected >= 3 (a unique most-frequent digit needs room)")
        if not 0 <= self.format_reward < 1:
            raise ValueError(f"format_reward={self.format_reward}, expected in [0, 1)")

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        while True:
            digits = [rng.randint(1, 9) for _ in range(self.length)]
            counts = sorted(((digits.count(d), d) for d in set(digits)), reverse=True)
            if len(counts) == 1 or counts[0][0] > counts[1][0]:  # a unique winner
                break
        self._answer = str(counts[0][1])
        return "".join(map(str, digits)) + "="

    def demonstration(self, seed: int) -> list[str]:
        """The one answer of a correct episode `seed` (starts that episode, as `reset(seed)` does)."""
        self.reset(seed)
        return [self._answer]

    def step(self, answer: str) -> StepResult:
        if not self._answer:
            raise RuntimeError("step() before reset()")
        first = answer[:1]
        reward = 1.0 if first == self._answer else self.format_reward if first.isdigit() else 0.0
        return StepResult("", reward, True)
