"""`scored`: a single-turn environment over data rows, rewarded by your own Python function.

The prompt is the row's (a string, or chat messages the driver renders with the tokenizer's chat
template); the reward is the function `reward_name` of the file `reward_path`, called by keyword
according to its signature (rl/envs/rewards.py: verl's `compute_score(data_source, solution_str,
ground_truth, extra_info)` and subsets of it, TRL's, OpenRLHF's, slime's). It returns a number, or a
dict with a "score" key (the reward) and other numeric entries, each logged as `reward/<name>`;
the answer counts as correct when the dict's "acc" (or "correct") entry is true, else when
score >= 1.

The reward file is imported into the trainer's process and runs there with the trainer's privileges:
it is trusted code, like the trainer itself. To score model-written code, run that code in the sandbox
from the reward (rl/envs/tools/sandbox.py; the `code_reward` task does).
"""
from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from rl.envs.data import PROMPT
from rl.envs.rewards import RewardFunction
from rl.envs.tasks.base import StepResult, register_task

_LOADED: dict[tuple[str, float, str], Callable] = {}
"""(absolute path, mtime, name) -> the function: one import per file, not one per episode."""


def load_reward_function(path: str, name: str = "compute_score") -> Callable:
    """The callable `name` defined in the Python file `path`; ValueError naming the path and the
    name when the file is missing, does not import, or lacks a callable `name`."""
    if not os.path.isfile(path):
        raise ValueError(f"reward_path={path!r}: no such file, expected a Python file defining {name}()")
    key = (os.path.abspath(path), os.path.getmtime(path), name)
    if key in _LOADED:
        return _LOADED[key]
    spec = importlib.util.spec_from_file_location(f"_reward_fn_{len(_LOADED)}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"reward_path={path!r}: cannot be imported, expected a Python (.py) file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ValueError(f"reward_path={path!r}: importing it raised {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"reward_path={path!r} defines no {name!r} (reward_name), expected a function "
                         f"{name}(solution_str, ground_truth, extra_info)")
    if not callable(fn):
        raise ValueError(f"reward_path={path!r}: {name!r} is a {type(fn).__name__}, expected a callable")
    _LOADED[key] = fn
    return fn


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(float(value))


def score_result(out: object) -> StepResult:
    """The StepResult of a reward function's return value: a number, or {"score": ..., <components>}."""
    if not isinstance(out, dict):
        score = float(out)  # a non-number raises, and the driver drops the trajectory as env_error
        return StepResult("", score, True, is_correct=score >= 1.0)
    if "score" not in out:
        raise ValueError(f"the reward function returned {out!r:.120}, expected a number or a dict with a 'score' key")
    score = float(out["score"])
    components = {k: float(v) for k, v in out.items() if k != "score" and _is_number(v)}
    flag = next((out[k] for k in ("acc", "correct") if k in out), None)
    return StepResult("", score, True, components=components,
                      is_correct=bool(flag) if flag is not None else score >= 1.0)


@register_task("scored")
@dataclass
class ScoredTask:
    reward_path: str
    """Python file defining the reward function. It is imported and runs in the trainer's own process with
    its privileges (files, network, GPUs), not in the sandbox: trusted code only."""
    reward_name: str = "compute_score"
    """Name of the function in that file, of one of the shapes rl/envs/rewards.py accepts (verl's
    compute_score(data_source, solution_str, ground_truth, extra_info), TRL's, OpenRLHF's, slime's)."""
    max_turns: int = 1
    """Single turn."""
    _fn: RewardFunction = field(init=False, repr=False)
    _row: dict | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_turns != 1:
            raise ValueError(f"max_turns={self.max_turns}, expected 1 (the scored task is single-turn)")
        self._fn = RewardFunction(load_reward_function(self.reward_path, self.reward_name),
                                  f"{self.reward_path}:{self.reward_name}")

    def reset(self, seed: int, row: dict | None = None) -> str | list[dict]:
        """The row's prompt (messages are returned as they are); `seed` is unused: the row decides."""
        if row is None:
            raise ValueError("the scored task needs a data row: set data.train_files")
        self._row = row
        return row[PROMPT]

    def step(self, answer: str) -> StepResult:
        if self._row is None:
            raise RuntimeError("step() before reset()")
        return score_result(self._fn.score(answer, self._row))

    @staticmethod
    def answer_tokens(rows: list[dict], encode: Callable[[str], list[int]]) -> int:
        """The answer length a run needs when rollout.max_new_tokens is null: twice the longest label in
        tokens plus one for the end of turn, at least 8 (room for a short answer around the label; an answer
        that reasons first needs rollout.max_new_tokens set). `rows`: the first training rows."""
        longest = max((len(encode(str(row.get("label")))) for row in rows if row.get("label") is not None), default=0)
        return max(8, 2 * longest + 1)

    @staticmethod
    def step_many(envs: list["ScoredTask"], answers: list[str]) -> list[StepResult]:
        """`envs[i].step(answers[i])` for all at once: one call of a batched reward function (TRL's,
        OpenRLHF's, slime's list shape), async ones awaited together, others one answer at a time.
        The environments come from one task config, so they share the reward function."""
        if any(e._row is None for e in envs):
            raise RuntimeError("step_many() before reset()")
        return [score_result(out) for out in envs[0]._fn.batch(answers, [e._row for e in envs])]
