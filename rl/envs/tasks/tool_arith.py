"""An agentic task the tiny model learns on CPU and cannot do without its tool: multiplication by
calling `python_exec` in the sandbox, then reading the result back.

Protocol (each episode draws, from `random.Random(seed)`, a in [10, 99] and b in [2, 9]):

    prompt     "37*8="               the product to compute
    turn 1     "[py:37*8]"           a tool call (parser python_tag, tags "[" "]", tool `py` =
                                     python_exec): model-written Python, run in the sandbox
    observe    "=296;"               what the code printed (its last expression's value), in the
                                     chat template's tool turn
    turn 2     "296"                 the answer, compared digit by digit from its start

Rewards: turn 1 without one well-formed call of a known tool (parse error, no call, unknown tool):
0, the episode ends. Otherwise the code runs (whatever it is: a wrong expression returns its own
value, an escape attempt an error line) and the episode continues. Turn 2: 1.0 when the answer
starts with the product (`is_correct`); otherwise, when the tool printed the product,
`call_reward` + (1 - call_reward) x (leading digits right) / (digits of the product): a policy that
calls right but guesses the answer gets about call_reward; 0 when the tool printed something else.
A three-digit product (up to 891) is far beyond what the tiny model computes in one token; copying
the prompt's expression into the call and the tool's digits into the answer solves it.

Demonstrations (`demonstration(seed)`) for the supervised warm-up (rl/run/warmup.py): the right call,
then the product, or with `value=False` three digits drawn at random, leaving RL the reading of the
tool's output to learn (as key_lookup leaves the copy of its value).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from rl.envs.tasks.base import StepResult, register_task
from rl.envs.tools.calls import ToolCall, ToolError, ToolRegistry, make_parser
from rl.envs.tools.python_exec import python_exec_tool, shared_sandbox
from rl.envs.tools.sandbox import SandboxConfig

PARSER = make_parser("python_tag", open_tag="[", close_tag="]", arg_key="code")
"""The task's call syntax: "[py:<code>]"."""


@register_task("tool_arith")
@dataclass
class ToolArith:
    uses_sandbox: ClassVar[bool] = True
    """Runs model-written code: the run refuses to start when the sandbox backend cannot run here."""
    call_reward: float = 0.2
    """Reward of a right call followed by a wrong answer (plus the share of leading digits right)."""
    max_turns: int = 2
    """Turn 1 calls the tool, turn 2 answers."""
    answer_tokens: ClassVar[int] = 12
    """Tokens per turn a run needs (rollout.max_new_tokens=null): "[py:37*8]" and its eos."""
    wall_time_s: float = 5.0
    """The sandbox's wall-clock limit of one call."""
    workers: int = 4
    """Warm sandbox workers (one pool per process, shared by every episode)."""
    _tools: ToolRegistry | None = field(default=None, init=False, repr=False)
    _a: int = field(default=0, init=False, repr=False)
    _b: int = field(default=0, init=False, repr=False)
    _printed: str = field(default="", init=False, repr=False)
    _turn: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.call_reward < 1:
            raise ValueError(f"call_reward={self.call_reward}, expected in [0, 1)")
        if not self.wall_time_s > 0 or self.workers < 1:
            raise ValueError(f"wall_time_s={self.wall_time_s} (> 0), workers={self.workers} (>= 1) out of range")

    @property
    def tools(self) -> ToolRegistry:
        """The task's tools (the driver hands their schemas to the chat template)."""
        if self._tools is None:
            config = SandboxConfig(wall_time_s=self.wall_time_s, cpu_time_s=min(self.wall_time_s, 5.0),
                                   workers=self.workers)
            self._tools = ToolRegistry([python_exec_tool(shared_sandbox(config), name="py", max_chars=16)])
        return self._tools

    @property
    def product(self) -> str:
        return str(self._a * self._b)

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self._a, self._b = rng.randint(10, 99), rng.randint(2, 9)
        self._printed, self._turn = "", 1
        return f"{self._a}*{self._b}="

    def demonstration(self, seed: int, value: bool = True) -> list[str]:
        """The answers of a good episode `seed` (starts it, as reset does): the call, then the product
        or, with `value=False`, three random digits (from a generator of its own)."""
        self.reset(seed)
        answer = self.product if value else str(random.Random(f"tool_arith demo {seed}").randint(100, 999))
        return [f"[py:{self._a}*{self._b}]", answer]

    def step(self, answer: str) -> StepResult:
        if self._turn == 0:
            raise RuntimeError("step() before reset() or after the episode is done")
        if self._turn == 1:
            return self._call(answer)
        self._turn = 0
        right = self.product
        if answer.startswith(right):
            return StepResult("", 1.0, True, components={"call_right": 1.0, "answer_right": 1.0}, is_correct=True)
        if self._printed != right:
            return StepResult("", 0.0, True, components={"call_right": 0.0, "answer_right": 0.0}, is_correct=False)
        lead = next((i for i, (x, y) in enumerate(zip(answer, right)) if x != y), min(len(answer), len(right)))
        reward = self.call_reward + (1 - self.call_reward) * lead / len(right)
        return StepResult("", reward, True, components={"call_right": 1.0, "answer_right": 0.0}, is_correct=False)

    def _call(self, answer: str) -> StepResult:
        parsed = PARSER.parse(answer)
        calls = [c for c in parsed.calls if c.name in self.tools]
        if parsed.errors or len(calls) != 1 or len(parsed.calls) != 1:
            self._turn = 0
            return StepResult("", 0.0, True, components={"call_ok": 0.0}, is_correct=False)
        try:
            self._printed = self.tools.call(ToolCall(calls[0].name, calls[0].arguments))
        except ToolError:  # "[py:]": no code
            self._turn = 0
            return StepResult("", 0.0, True, components={"call_ok": 0.0}, is_correct=False)
        self._turn = 2
        return StepResult(f"={self._printed};", 0.0, False, components={"call_ok": 1.0}, role="tool")
