"""Reward functions of the shapes RL users bring, called by keyword according to their signature.

`RewardFunction(fn)` reads `fn`'s signature once and knows how to call it:

| shape | signature (names matter, order does not) | called with | returns |
|---|---|---|---|
| verl / ours | any of `data_source, solution_str, ground_truth, extra_info` (solution_str required), `**kwargs` | one answer | a number or {"score": ..., <numbers>} |
| TRL | `completions` (and optionally `prompts`), the rows' columns by name or `**kwargs` (as lists) | a batch | a list of numbers (None = no reward: 0) |
| OpenRLHF | `queries, prompts, labels` | a batch | a list (or tensor) of numbers, or {"rewards": ...} |
| slime | `args, sample` (one) or `args, samples` (a batch) | `sample.prompt/.response/.label/.metadata` | a number (a list for a batch) |

`async def` functions are awaited. The scored task steps a request's samples together (`batch`): a
batched shape gets them in one call, an async one has them all in flight at once. A signature of none of these shapes is refused when the function is
loaded, naming it and the shapes accepted. Arguments: `solution_str` / `completions` / `response` the
decoded answer; `ground_truth` / `labels` / `label` the row's label; `data_source` the row's
`data_source` column (else None); `extra_info` the row's `extra_info` column when it has one (verl's
files), else a dict of the row's other columns; `prompts` the rows' prompts (a string, or chat messages);
`queries` a prompt's text (its messages' contents joined by newlines) followed by the answer.
"""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from types import SimpleNamespace

from rl.envs.data import LABEL, PROMPT

VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
SHAPES = ("verl/ours: compute_score(data_source, solution_str, ground_truth, extra_info) (a subset with "
          "solution_str, or **kwargs)", "TRL: reward_func(completions, <columns>, **kwargs) -> list",
          "OpenRLHF: reward_func(queries, prompts, labels) -> list", "slime: rm(args, sample) / rm(args, samples)")


def _resolve(value: object) -> object:
    return _resolve_all([value])[0]


def _resolve_all(values: list[object]) -> list[object]:
    """`values` with every awaitable among them awaited, all together in one event loop."""
    if not any(inspect.isawaitable(v) for v in values):
        return values

    async def wait() -> list[object]:
        return list(await asyncio.gather(*(v if inspect.isawaitable(v) else asyncio.sleep(0, v) for v in values)))
    return asyncio.run(wait())


def _prompt_text(prompt: object) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def _extra(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in (PROMPT, LABEL)}


class RewardFunction:
    """`fn` with its shape (module docstring); `score(answer, row)` one answer, `batch(answers, rows)`."""

    def __init__(self, fn: Callable, name: str = "the reward function") -> None:
        self.fn, self.name = fn, name
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            raise ValueError(f"{name}: its signature cannot be read; expected one of: {'; '.join(SHAPES)}") from None
        names = [p for p, v in params.items() if v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)]
        self.var_kw = any(v.kind is v.VAR_KEYWORD for v in params.values())
        required = [p for p, v in params.items() if v.default is v.empty
                    and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)]
        self.names = names
        if "completions" in names:  # its other parameters name the rows' columns
            self.shape = "trl"
        elif names[:3] == ["queries", "prompts", "labels"] and set(required) <= set(names[:3]):
            self.shape = "openrlhf"
        elif names[:2] in (["args", "sample"], ["args", "samples"]) and set(required) <= set(names[:2]):
            self.shape = "slime" if names[1] == "sample" else "slime_batch"
        elif "solution_str" in names and set(required) <= set(VERL_ARGS):
            self.shape = "verl"
        else:
            raise ValueError(f"{name}{inspect.signature(fn)}: a signature of no known shape; expected one of: "
                             f"{'; '.join(SHAPES)}")
        self.batched = self.shape in ("trl", "openrlhf", "slime_batch")

    def score(self, answer: str, row: dict) -> object:
        """The reward of one answer: what the function returned for it (a number or a dict)."""
        if self.batched:
            return self.batch([answer], [row])[0]
        return _resolve(self._call_one(answer, row))

    def _call_one(self, answer: str, row: dict) -> object:
        """The function called on one answer (an awaitable for an async one)."""
        if self.shape == "slime":
            return self.fn(None, self._sample(answer, row))
        values = {"data_source": row.get("data_source"), "solution_str": answer, "ground_truth": row.get(LABEL),
                  "extra_info": row["extra_info"] if "extra_info" in row else _extra(row)}
        return self.fn(**{k: v for k, v in values.items() if k in self.names})

    def batch(self, answers: list[str], rows: list[dict]) -> list[object]:
        """The rewards of `answers` (row i answered by answers[i]): one call for the batched shapes;
        one call per answer otherwise, an async function's awaited all together."""
        if not self.batched:
            return _resolve_all([self._call_one(a, r) for a, r in zip(answers, rows)])
        if self.shape == "trl":
            chat = all(not isinstance(r[PROMPT], str) for r in rows)
            completions = [[{"role": "assistant", "content": a}] for a in answers] if chat else list(answers)
            kwargs = {"completions": completions, "prompts": [r[PROMPT] for r in rows]}
            kwargs |= {k: [r.get(k) for r in rows] for k in {k for r in rows for k in r if k != PROMPT}}
            kwargs["ground_truth"] = kwargs.get(LABEL, [None] * len(rows))
            out = _resolve(self.fn(**{k: v for k, v in kwargs.items() if self.var_kw or k in self.names}))
            out = [0.0 if v is None else v for v in out]
        elif self.shape == "openrlhf":
            out = _resolve(self.fn(queries=[_prompt_text(r[PROMPT]) + a for a, r in zip(answers, rows)],
                                   prompts=[r[PROMPT] for r in rows], labels=[r.get(LABEL) for r in rows]))
            out = out["rewards"] if isinstance(out, dict) else out
        else:
            out = _resolve(self.fn(None, [self._sample(a, r) for a, r in zip(answers, rows)]))
        out = [float(v) for v in (out.tolist() if hasattr(out, "tolist") else out)]
        if len(out) != len(answers):
            raise ValueError(f"{self.name} returned {len(out)} rewards for {len(answers)} answers")
        return out

    @staticmethod
    def _sample(answer: str, row: dict) -> SimpleNamespace:
        return SimpleNamespace(prompt=row[PROMPT], response=answer, label=row.get(LABEL), metadata=_extra(row))
