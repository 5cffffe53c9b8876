"""A two-turn tool-using task a tiny byte-level model can learn on CPU by copying: key lookup.

Protocol (each episode draws, from `random.Random(seed)`, a hidden table of `num_keys` distinct
lowercase letters, each with a digit value 1..9, and one queried key among them; the table is
never shown):

    prompt     "get c:"        the key to look up, then a colon
    turn 1     "c"             a tool call, the bare key letter (its first character is checked);
                               with brackets=True "[c]" (its first 3 characters)
    observe    "=7;"           the value of the key that was called (whichever key it was)
    turn 2     "7"             the answer's first character is checked

The driver appends the policy's answer and the observation to the conversation and sends
"get c:c=7;" ("get c:[c]=7;" with brackets) as the second prompt. Rewards:

- turn 1 is not a key of the table (in brackets with brackets=True): reward 0, the episode ends;
- turn 1 is a well-formed call: reward 0, the episode continues;
- turn 2: 1.0 if the call was for the queried key and the answer is its value, otherwise
  `call_reward` (the call was well-formed, the answer is wrong or came from another key).

Why a rising mean is honest: a random policy over 259 byte tokens almost never forms a call for a
key of the table (~0); a policy that learned only the call syntax gets at most `call_reward`
(calling a fixed letter only hits the table num_keys/26 of the time; copying the queried key hits it
always); copying the key and then guessing a digit averages call_reward + (1 - call_reward) / 9.
Only copying the queried key into the call AND the returned digit into the answer scores 1, and no
arithmetic is needed, so the tiny model can get there in a few hundred policy updates.
A policy that answers the same text every time (a fixed letter, then a fixed digit) scores at most
`constant_answer_ceiling`: num_keys/26 * call_reward + the rare exact hit (0.034 at 4 keys, 0.2).

Demonstrations (`demonstration(seed)`): the answers of a good episode for a supervised warm-up
(rl/run/warmup.py); `value=False` keeps the call correct and answers a random digit instead, so a
policy that imitates them scores call_reward + (1 - call_reward) / 9 and RL has the copy of the
returned value left to learn.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import ClassVar

from rl.envs.tasks.base import StepResult, register_task


@register_task("key_lookup")
@dataclass
class KeyLookup:
    num_keys: int = 4
    """Keys in the hidden table (distinct lowercase letters)."""
    call_reward: float = 0.2
    """Reward for a well-formed call (any key of the table) followed by a wrong final answer."""
    max_turns: int = 2
    """Turn 1 calls the tool, turn 2 answers."""
    answer_tokens: ClassVar[int] = 2
    """Tokens per turn a run needs (rollout.max_new_tokens=null): the key or the digit, and its eos."""
    brackets: bool = False
    """The call syntax: the bare key letter "c" (False: a one-character action a tiny model from a
    random init finds by chance), or "[c]" (True)."""
    _table: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _query: str = field(default="", init=False, repr=False)
    _called: str = field(default="", init=False, repr=False)
    """The key called in turn 1 ("" before it)."""
    _turn: int = field(default=0, init=False, repr=False)
    """Next turn to score: 1 or 2; 0 before reset() and after the episode is done."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_keys <= 26:
            raise ValueError(f"num_keys={self.num_keys}, expected in 1..26 (distinct lowercase letters)")
        if not 0 <= self.call_reward < 1:
            raise ValueError(f"call_reward={self.call_reward}, expected in [0, 1)")

    @property
    def table(self) -> dict[str, int]:
        """The hidden table of the current episode, key -> value (a copy; for tests and debugging)."""
        return {key: int(value) for key, value in self._table.items()}

    @property
    def query(self) -> str:
        """The key the current episode asks for ("" before reset())."""
        return self._query

    @property
    def constant_answer_ceiling(self) -> float:
        """The best expected reward of a policy that gives the same answers in every episode: its call
        letter is in the table num_keys/26 of the time, the queried key a quarter of that, and then a
        fixed digit is the value 1/9 of the time."""
        in_table = self.num_keys / 26
        return in_table * self.call_reward + in_table / self.num_keys / 9 * (1 - self.call_reward)

    def demonstration(self, seed: int, value: bool = True) -> list[str]:
        """The answers, turn by turn, of a good episode `seed` (starts that episode: mutates the
        environment as `reset(seed)` does): the call for the queried key, then its value, or with
        `value=False` a digit drawn from 1..9 by a generator of its own (right 1/9 of the time)."""
        self.reset(seed)
        call = f"[{self._query}]" if self.brackets else self._query
        digit = self._table[self._query] if value else str(random.Random(f"key_lookup demo {seed}").randint(1, 9))
        return [call, digit]

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        keys = rng.sample(string.ascii_lowercase, self.num_keys)
        self._table = {key: str(rng.randint(1, 9)) for key in keys}
        self._query = rng.choice(keys)
        self._called = ""
        self._turn = 1
        return f"get {self._query}:"

    def step(self, answer: str) -> StepResult:
        if self._turn == 0:
            raise RuntimeError("step() before reset() or after the episode is done")
        if self._turn == 1:
            call = answer[:3] if self.brackets else answer[:1]
            key = call[1:2] if self.brackets and call[:1] == "[" and call[2:3] == "]" else call if not self.brackets else ""
            if key and key in self._table:
                self._called = key
                self._turn = 2
                return StepResult(f"={self._table[self._called]};", 0.0, False)
            self._turn = 0
            return StepResult("", 0.0, True)
        self._turn = 0
        correct = self._called == self._query and answer[:1] == self._table[self._query]
        return StepResult("", 1.0 if correct else self.call_reward, True)
