"""A long-tail, code-edit-like task: read a file with a tool, restate it with one change.

Protocol (each episode draws, from `random.Random(seed)`, a file of code-like text (Python-like words
between punctuation) whose length is
log-uniform in [min_chars, max_chars], so that a rollout's answers vary widely in length: the median
~63 characters at the defaults, one in ten above ~280; and the new name, a lowercase letter):

    prompt     "rename q in k3f:" the new name of the file's first identifier, and the file's name
    turn 1     "cat"              the tool call (its first 3 characters are checked)
    observe    "=x = self(value..;"  the file, between "=" and ";" (role tool)
    turn 2     "q = self(value..."   the file with its first identifier (one letter) renamed

Rewards: a wrong call ends the episode with 0; turn 2 scores the share of the target the answer gets
right: (the new name right + the rest restated before its first difference) / max(len(answer),
len(target)), 1.0 exactly when it is the target (is_correct). The name and the copy count apart, so
a policy that copies but misses the name still earns most of the reward.

Why it exists: a byte-level model that learned to copy restates the tool's text token for token, so
most of a long answer is predictable from the context and from the group's siblings (the same file):
speculation's workload. And answers of 10 to 400 tokens make a rollout's tail: the last long answers
decode at low concurrency while the short ones are done.

Why a rising mean is honest: a random policy rarely forms the call; one that calls and answers a
fixed text gets ~1/len(target) per character it shares by chance; only copying scores near 1.
`demonstration(seed)` gives the good episode's answers (the warm-up's supervised targets).
"""
from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass, field
from typing import ClassVar

from rl.envs.tasks.base import StepResult, register_task

WORDS = ("def", "return", "self", "value", "result", "index", "count", "total", "items", "append", "range",
         "print", "lambda", "import", "class", "while", "break", "yield", "numpy", "torch", "tensor", "shape",
         "length", "buffer", "offset", "config", "params", "weight", "output", "input", "batch", "layer",
         "module", "forward", "kernel", "stride", "update", "assert", "None", "True")
"""The file's names: Python-like words (a byte-level model learns to complete a word from its first
characters; which word comes next is the file's)."""
SEPARATORS = (" ", " ", " ", " = ", "(", ")", ", ", ".", "\n")
"""What joins them: code-like punctuation."""


@register_task("restate")
@dataclass
class Restate:
    min_chars: int = 10
    """Shortest file (characters: tokens of the byte-level tokenizer)."""
    max_chars: int = 400
    """Longest file."""
    max_turns: int = 2
    """Turn 1 calls the tool, turn 2 restates."""
    answer_tokens: ClassVar[int] = 401
    """Tokens per turn a run needs (rollout.max_new_tokens=null): the longest file and its eos."""
    _file: str = field(default="", init=False, repr=False)
    _target: str = field(default="", init=False, repr=False)
    _turn: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 2 <= self.min_chars <= self.max_chars:
            raise ValueError(f"min_chars={self.min_chars}, max_chars={self.max_chars}: expected "
                             f"2 <= min_chars <= max_chars")

    @property
    def target(self) -> str:
        """The right second answer of the current episode ("" before reset())."""
        return self._target

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        span = math.log(self.max_chars / self.min_chars)
        length = min(self.max_chars, round(self.min_chars * math.exp(rng.random() * span)))
        old, new = rng.sample(string.ascii_lowercase[:20], 2)
        name = "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(3))
        body = ""
        while len(body) < length:
            body += rng.choice(SEPARATORS) + rng.choice(WORDS)
        self._file = (old + body)[:length]
        self._target = new + self._file[1:]
        self._turn = 1
        return f"rename {new} in {name}:"  # the name: one prompt, one file (a prompt's group shares it)

    def demonstration(self, seed: int, value: bool = True) -> list[str]:
        """The answers of a good episode `seed` (starts it, as reset does): the call, then the renamed
        file or, with `value=False`, the file unchanged (right but for its first character)."""
        self.reset(seed)
        return ["cat", self._target if value else self._file]

    def step(self, answer: str) -> StepResult:
        if self._turn == 0:
            raise RuntimeError("step() before reset() or after the episode is done")
        if self._turn == 1:
            if answer[:3] != "cat":
                self._turn = 0
                return StepResult("", 0.0, True, components={"call_ok": 0.0}, is_correct=False)
            self._turn = 2
            return StepResult(f"={self._file};", 0.0, False, components={"call_ok": 1.0}, role="tool")
        self._turn = 0
        target = self._target
        body, want = answer[1:], target[1:]
        same = next((i for i, (a, b) in enumerate(zip(body, want)) if a != b), min(len(body), len(want)))
        reward = (int(answer[:1] == target[:1]) + same) / max(len(answer), len(target))
        return StepResult("", reward, True, components={"call_ok": 1.0, "exact": float(answer == target)},
                          is_correct=answer == target)
