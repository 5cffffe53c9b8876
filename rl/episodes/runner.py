"""One episode's turns, as the training rollout (driver.py) and validation (validation.py) both play them.

An episode is a conversation. Its first prompt is the task's reset (a text, or the chat messages a
data row gives) rendered by the tokenizer's chat template with the task's tool schemas. Each turn
the engine samples an answer; the environment steps on its text (decoded, eos left out); the
step's result gives the turn's reward and either the episode's end (done, or `max_turns` reached)
or an observation, tokenized in the chat role the result names ("tool" for a tool's reply) and
appended; the next request's prompt is the whole conversation so far, its turn boundaries marked.

`EpisodeRunner` owns these conversions and the engine's context check; its callers own their
bookkeeping (trajectories and groups, or held-out samples), their seeds and their environments.
Every fault is raised as `Dropped` (rl/episodes/env_runner.py) with its reason: `tokenizer` (a
prompt, answer or observation could not be converted), `bad_reward` (not a finite number),
`env_error` (a step returned no StepResult), `too_long` (a context the engine can never run); the
caller decides what it costs.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from rl.episodes.env_runner import Dropped
from rollout.dispatcher import FollowUp, Submission
from rollout.engine import ContextTooLong, Engine
from rollout.sampling import SamplingParams


def mix_seed(*parts: int) -> int:
    """A deterministic 62-bit seed from integers (SplitMix64-style), independent of PYTHONHASHSEED."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x >> 2


def as_messages(prompt: str | list[dict]) -> list[dict]:
    """A prompt as chat messages: a list of messages as it is, a text as one user message."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def render_prompt(tokenizer, prompt: str | list[dict], tools: list[dict] | None = None) -> list[int]:
    """The ids of a first prompt (text or chat messages) with the generation prompt opened, the
    `tools` schemas handed to the chat template."""
    return tokenizer.render(as_messages(prompt), tools=tools)


def tool_schemas(env: object) -> list[dict] | None:
    """The tool schemas a task exposes: its `tools` (a ToolRegistry's `schemas()`, or a list of
    OpenAI-style function schemas as they are); None without tools."""
    tools = getattr(env, "tools", None)
    return tools.schemas() if hasattr(tools, "schemas") else tools


@dataclass(frozen=True)
class TurnOutcome:
    """A step's result as the conversation takes it."""
    reward: float
    last: bool
    """The episode ends with this turn (done, or max_turns reached)."""
    observation: list[int] = field(default_factory=list)
    """Ids appended before the next turn (empty when `last`)."""
    components: dict[str, float] = field(default_factory=dict)
    is_correct: bool | None = None
    """The result's verdict on the episode (None: the environment does not say)."""


class EpisodeRunner:
    """The conversions of an episode's turns (module docstring) for one engine, tokenizer and task.
    Holds no episode state: its calls mutate nothing but what they return."""

    def __init__(self, engine: Engine, tokenizer, tools: list[dict] | None = None) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.tools = tools
        """The task's tool schemas, handed to the chat template with every first prompt; None without."""

    @classmethod
    def for_task(cls, engine: Engine, tokenizer, probe: object) -> EpisodeRunner:
        """A runner for the task `probe` is an instance of (its tools read once, here)."""
        return cls(engine, tokenizer, tool_schemas(probe))

    def _tokenizer_call(self, fn: Callable, *args, **kwargs) -> object:
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - a tokenizer fault costs the episode, not the run
            raise Dropped("tokenizer", err) from err

    def first_prompt(self, prompt: str | list[dict]) -> list[int]:
        """The ids of the episode's first request (`render_prompt` with the task's tools).
        Raises Dropped("tokenizer")."""
        return list(self._tokenizer_call(render_prompt, self.tokenizer, prompt, self.tools))

    def answer_text(self, tokens: list[int]) -> str:
        """The text of a turn's sampled `tokens` as the environment sees it: the model's eos left
        out, cut before a stop string. Raises Dropped("tokenizer")."""
        eos = self.engine.model.config.eos_token_id
        return self._tokenizer_call(self.tokenizer.answer_text, [t for t in tokens if t != eos])

    def outcome(self, result: object, turn: int, max_turns: int) -> TurnOutcome:
        """Step `result` of turn `turn` (1 = the first answer) of an episode of at most `max_turns`
        turns; the observation is tokenized in the result's `role` ("user" when it names none).
        Raises Dropped ("env_error": not a StepResult, "bad_reward", "tokenizer")."""
        try:
            raw_reward, done, observation = result.reward, result.done, result.observation
            components, is_correct = dict(getattr(result, "components", {})), getattr(result, "is_correct", None)
        except AttributeError as err:
            raise Dropped("env_error", TypeError(f"step returned {result!r}, expected a StepResult")) from err
        reward = finite_reward(raw_reward)
        last = bool(done) or turn >= max_turns
        role = getattr(result, "role", "user")  # a tool's reply renders in the template's tool turn
        obs = [] if last else list(self._tokenizer_call(self.tokenizer.continue_turn, observation, role))
        return TurnOutcome(reward, last, obs, components, is_correct)

    def submission(self, tokens: list[int], params: SamplingParams, follow_up: FollowUp,
                   turn_boundaries: list[int]) -> Submission:
        """The request continuing a conversation of `tokens` (its turns ending at `turn_boundaries`,
        where the prefix cache keeps a checkpoint). Raises Dropped("too_long") when the engine can
        never run that context (`Engine.check_context`: the message names the tokens, the limit, the pages)."""
        try:
            self.engine.check_context(len(tokens))
        except ContextTooLong as err:
            raise Dropped("too_long", err) from err
        return Submission(list(tokens), params, follow_up, tuple(turn_boundaries))


def finite_reward(reward: object) -> float:
    """`reward` as a float; Dropped("bad_reward") unless it is a finite number."""
    try:
        value = float(reward)
    except (TypeError, ValueError) as err:
        raise Dropped("bad_reward", err) from err
    if not math.isfinite(value):
        raise Dropped("bad_reward", ValueError(f"reward={value}, expected a finite number"))
    return value
