"""Validation: held-out episodes of the run's task played through the rollout engine and scored,
as verl's `test_freq` / `val_before_train` do.

An evaluation plays `num_prompts` held-out episodes, each `n` times (greedy at temperature 0, or
sampled), following the environment until it is done (multi-turn: the conversation so far is the
next request, its turn boundaries marked). Every turn goes through the training rollout's own
`EpisodeRunner` (rl/episodes/runner.py): the first prompt rendered with the task's tool schemas, the
answer's text, each observation in its chat role, the engine's context check; so the prompts of a
held-out episode are those the training rollout sends for the same episode. Episode i is started
with `reset(mix_seed(seed, HELD_OUT + i))`, a stream the training groups (`mix_seed(seed, g)`)
never reach, or, given validation data rows (rl/envs/data.py, `data.val_files`), with
`reset(seed, row=rows[i])` for the first min(num_prompts, len(rows)) rows (a prompt given as chat
messages is rendered as they are). The same episodes are played at every evaluation, with the
same sampling seeds: two evaluations differ only by the weights. With env.workers > 0 the
environments' steps run on the rollout driver's worker pool while the engine steps the other
samples (as in the rollout); then, on CPU, which requests share a step depends on when tools return,
so results are reproducible only inline (a row's logits depend on its batch there).

Scoring: a sample's reward is the sum of its turns' rewards; it is *correct* when its last step
result says so (`is_correct`, where the task sets it) and otherwise when its reward is >= 1.0 (the
training metric `reward_correct_frac`'s rule). Metrics (one evaluation; k = n):
- `val/reward_mean`: mean reward over the samples; `val/correct_frac`: share of correct samples;
- `val/pass@k`: share of prompts with at least one correct sample of k;
- `val/mean@k`: mean over prompts of the mean reward of its k samples;
- `val/tokens`: tokens generated; `val/seconds`: the evaluation's wall time; `val/errors`:
  samples a fault ended early (they keep the reward they had and are incorrect);
- the raw sums the ratios come from (`val/num_prompts`, `val/num_samples`, `val/reward_sum`,
  `val/num_correct`, `val/num_pass`, `val/mean_sum`): with several ranks, each rank plays the
  prompts i with i % world == rank, and rl/run/ranks.py's `merge_metrics` sums these counts over the
  ranks and recomputes the ratios from the sums (so N ranks report what one rank would).
Each evaluation writes `out_dir/val/iter_<N>.jsonl` (one line per prompt: its text and each
sample's answers, rewards, correctness; `iter_<N>.rank<r>.jsonl`, the rank's share, with several
ranks), atomically (temp file, fsync, rename).

The engine is left as it was found: the evaluation's requests all finish (or are aborted on an
error), seeds are its own (the driver's state and RNG are never read), and the prefix cache, which a
weight load empties, is emptied again afterwards when it was empty before (with
`rollout.reuse_stale_prefix` it was not: the evaluation's entries then stay, evictable, like a
finished request's, and may evict older ones). It needs an awake engine with no running or
waiting request; paused ones (kept-KV partial rollouts) are left paused, though an evaluation that
fills the pool can preempt them as any pool pressure would.
"""
from __future__ import annotations

import inspect
import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from memory.durable import write_durable
from rl.envs.tasks.base import Environment, make_task
from rl.episodes.driver_config import DriverConfig
from rl.episodes.env_runner import Dropped, EnvConfig, EnvRunner, call_with_timeout, resolve
from rl.episodes.runner import EpisodeRunner, mix_seed
from rollout.dispatcher import Dispatcher, Submission, ThrottleConfig
from rollout.engine import Engine
from rollout.request import RequestOutput
from rollout.sampling import SamplingParams

HELD_OUT = 1 << 40
"""Episode i of the held-out set is `mix_seed(seed, HELD_OUT + i)`; training group g uses
`mix_seed(seed, g)`, so the two meet only after 2**40 training groups."""

SUMS = ("val/num_prompts", "val/num_samples", "val/reward_sum", "val/num_correct", "val/num_pass",
        "val/mean_sum", "val/tokens", "val/errors")
"""The counts an evaluation returns besides its ratios; summed over ranks."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """When and how the run evaluates its policy on held-out episodes (rl/episodes/validation.py)."""
    every: int | None = None
    """Evaluate at iterations N, 2N, ... (the policy after N, 2N, ... updates); None = never."""
    before_train: bool | None = None
    """Evaluate at iteration 0, before any update (verl's val_before_train); null = on when data.val_files
    are given. Any evaluating run also evaluates the weights after its last update."""
    n: int = 1
    """Samples per prompt (the k of pass@k and mean@k); greedy (temperature 0) plays n identical ones."""
    temperature: float = 0.0
    """Sampling temperature of the evaluation; 0 = greedy (any value >= 0: nothing trains on it)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    max_new_tokens: int | None = None
    """Tokens per policy turn at most; None = the rollout's (rollout.max_new_tokens)."""
    num_prompts: int = 16
    """Held-out episodes per evaluation, over all ranks."""
    dump: bool = True
    """Write each evaluation's episodes to run_dir/val/iter_<N>.jsonl."""

    def __post_init__(self) -> None:
        def count(name: str, value: object, allow_none: bool = False) -> None:
            if allow_none and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}, expected an integer >= 1" + (" or null" if allow_none else ""))

        count("every", self.every, allow_none=True)
        count("n", self.n)
        count("max_new_tokens", self.max_new_tokens, allow_none=True)
        count("num_prompts", self.num_prompts)
        if isinstance(self.temperature, bool) or not (isinstance(self.temperature, (int, float))
                                                      and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r}, expected a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}, expected a number in (0, 1]")
        if self.before_train is not None and not isinstance(self.before_train, bool):
            raise ValueError(f"before_train={self.before_train!r}, expected true, false or null")
        if not isinstance(self.dump, bool):
            raise ValueError(f"dump={self.dump!r}, expected true or false")
        if self.n > 1 and self.temperature == 0:
            warnings.warn(f"eval.n={self.n} with eval.temperature=0 (greedy) plays {self.n} identical samples: pass@{self.n} "
                          f"equals pass@1; set eval.temperature > 0 (e.g. 0.7) to sample, or eval.n=1", UserWarning)

    def is_due(self, iteration: int) -> bool:
        """Whether iteration `iteration` starts with an evaluation (after its weight load)."""
        return eval_due(iteration, self.every, self.before_train)


def eval_due(iteration: int, every: int | None, before_train: bool) -> bool:
    """Iteration 0 with `before_train`; iterations N, 2N, ... with `every=N`."""
    return (before_train and iteration == 0) or (every is not None and iteration > 0 and iteration % every == 0)


@dataclass
class _Sample:
    """One play of a held-out episode: its conversation so far and its scores."""
    prompt_index: int
    member: int
    env: Environment | None
    """None when the episode could not be started (`error` says why)."""
    tokens: list[int]
    """The whole conversation: prompt, answers, observations."""
    turn_boundaries: list[int] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    is_correct: bool | None = None
    """The last step result's `is_correct` (None: the task does not say)."""
    num_generated: int = 0
    error: str | None = None

    @property
    def reward(self) -> float:
        return sum(self.rewards)

    @property
    def correct(self) -> bool:
        if self.error is not None:
            return False
        return bool(self.is_correct) if self.is_correct is not None else self.reward >= 1.0

    def row(self) -> dict:
        return {"member": self.member, "answers": self.answers, "rewards": self.rewards, "reward": self.reward,
                "correct": self.correct, "tokens": self.num_generated, "error": self.error}


def _error_text(err: BaseException) -> str:
    """A sample's error line: the fault's own for a Dropped (it names the error), else the error's."""
    return str(err) if isinstance(err, Dropped) else f"{type(err).__name__}: {err}"


class _Episodes:
    """The evaluation's requests and their follow-ups (the dispatcher's `FollowUp`s), each turn
    converted by `runner` (the training rollout's EpisodeRunner). With a worker pool (`pool`, the
    run's env.workers) each environment step runs there while the engine steps the other samples;
    `_Calls` hands its end back to the dispatcher."""

    def __init__(self, runner: EpisodeRunner, sampling: dict, seed: int, env_timeout_s: float | None,
                 pool: EnvRunner | None = None) -> None:
        self.runner, self.sampling = runner, sampling
        self.seed, self.env_timeout_s, self.pool = seed, env_timeout_s, pool

    def request(self, samples: list[_Sample]) -> list[Submission]:
        """The request continuing `samples` (a prompt's first turn: all n; later turns: one), or []
        when the engine could never run its context (the samples end with the error)."""
        s = samples[0]
        params = SamplingParams(n=len(samples), seed=mix_seed(self.seed, HELD_OUT + s.prompt_index, s.member,
                                                                 len(s.answers)), **self.sampling)
        try:
            return [self.runner.submission(s.tokens, params, _TurnEnd(self, samples), s.turn_boundaries)]
        except Dropped as fault:
            for t in samples:
                t.error = str(fault)
            return []

    def end_turn(self, s: _Sample, tokens: list[int]) -> list[Submission]:
        """Append the answer, step the environment; the next turn's request, or [] when it ended."""
        s.tokens += tokens
        s.num_generated += len(tokens)
        try:
            answer = self.runner.answer_text(tokens)
            if self.pool is not None:
                self.pool.submit(("eval", s, answer), lambda: resolve(s.env.step(answer)))
                return []
            result = call_with_timeout(lambda: s.env.step(answer), self.env_timeout_s, "step")
        except Exception as err:  # noqa: BLE001 - a fault ends this sample, not the evaluation
            s.error = _error_text(err)
            return []
        return self.apply(s, answer, result)

    def end_turns(self, samples: list[_Sample], tokens: list[list[int]], many) -> list[Submission]:
        """`end_turn` for a request's samples at once, stepped in one call of their task's
        `step_many(envs, answers)` (inline; a fault there ends every sample of the call)."""
        live: list[tuple[_Sample, str]] = []
        for s, t in zip(samples, tokens):
            s.tokens += t
            s.num_generated += len(t)
            try:
                live.append((s, self.runner.answer_text(t)))
            except Exception as err:  # noqa: BLE001 - a fault ends this sample, not the evaluation
                s.error = _error_text(err)
        try:
            results = call_with_timeout(lambda: many([s.env for s, _ in live], [a for _, a in live]),
                                        self.env_timeout_s, "step") if live else []
        except Exception as err:  # noqa: BLE001
            for s, _ in live:
                s.error = _error_text(err)
            return []
        return [sub for (s, answer), result in zip(live, results) for sub in self.apply(s, answer, result)]

    def apply(self, s: _Sample, answer: str, result: object) -> list[Submission]:
        """Record a step's result; the next turn's request, or [] when the episode ended."""
        try:
            turn = self.runner.outcome(result, len(s.answers) + 1, s.env.max_turns)
        except Dropped as fault:  # a fault ends this sample, not the evaluation
            s.error = str(fault)
            return []
        s.answers.append(answer)
        s.rewards.append(turn.reward)
        s.is_correct = turn.is_correct
        if turn.last:
            return []
        s.tokens += turn.observation
        s.turn_boundaries.append(len(s.tokens))
        return self.request([s])


@dataclass
class _Calls:
    """The dispatcher's `Background` (rollout/dispatcher.py): the evaluation's steps on the worker pool."""

    episodes: _Episodes

    @property
    def pending(self) -> int:
        return self.episodes.pool.pending

    def wait(self, timeout_s: float) -> None:
        self.episodes.pool.wait(timeout_s)

    def collect(self) -> list[Submission]:
        out: list[Submission] = []
        for (_, s, answer), value in self.episodes.pool.collect():
            if isinstance(value, BaseException):  # a timeout (EnvTimeout) or what the step raised
                s.error = _error_text(value)
            else:
                out += self.episodes.apply(s, answer, value)
        return out


@dataclass
class _TurnEnd:
    episodes: _Episodes
    samples: list[_Sample]

    def __call__(self, out: RequestOutput) -> list[Submission]:
        tokens = [list(sample.tokens) for sample in out.samples]
        many = getattr(type(self.samples[0].env), "step_many", None)
        if many is not None and self.episodes.pool is None and len(self.samples) > 1:
            return self.episodes.end_turns(self.samples, tokens, many)
        return [sub for s, t in zip(self.samples, tokens) for sub in self.episodes.end_turn(s, t)]


def _start(task_name: str, task_params: dict, runner: EpisodeRunner, index: int, n: int, seed: int,
           env_timeout_s: float | None, row: dict | None) -> tuple[str | list[dict], list[_Sample]]:
    """Held-out episode `index`'s prompt (text, or the chat messages a data row gives) and its n
    samples, each with its own environment reset to the episode's seed (and `row`, when given) and
    its first prompt rendered as the training rollout renders it (`EpisodeRunner.first_prompt`). A
    fault here ends every sample with its error (and no request is made)."""
    episode_seed = mix_seed(seed, HELD_OUT + index)
    samples: list[_Sample] = []
    text: str | list[dict] = ""
    try:
        for member in range(n):
            env = call_with_timeout(lambda: make_task(task_name, **task_params), env_timeout_s, "task factory")
            reset = (lambda: env.reset(episode_seed)) if row is None else (lambda: env.reset(episode_seed, row=row))
            text = call_with_timeout(reset, env_timeout_s, "reset")
            samples.append(_Sample(index, member, env, runner.first_prompt(text)))
    except Exception as err:  # noqa: BLE001 - a fault ends this prompt's samples, not the evaluation
        samples = [_Sample(index, member, None, [], error=_error_text(err)) for member in range(n)]
    return text, samples


def evaluate(engine: Engine, tokenizer, task_name: str, task_params: dict, config: EvalConfig, *, seed: int,
             iteration: int, out_dir: str | Path | None, rank: int = 0, world: int = 1,
             rollout_max_new_tokens: int = DriverConfig.max_new_tokens,
             env_timeout_s: float | None = EnvConfig.timeout_s,
             rows: Sequence[dict] | None = None, runner: EnvRunner | None = None) -> dict[str, float]:
    """One evaluation of the engine's current weights (module docstring): this rank's share of the
    held-out prompts (i % world == rank), each played `config.n` times; returns the metrics (ratios
    and raw sums, `val/...`) and writes the dump under `out_dir` when `config.dump` (and out_dir is
    given). `rollout_max_new_tokens` applies when config.max_new_tokens is None; `env_timeout_s`
    bounds each environment call. `rows` (validation data rows, rl/envs/data.py): prompt i is `rows[i]`,
    handed to `reset(seed, row=...)`, for the first min(num_prompts, len(rows)) rows. `runner`: an
    idle worker pool (the rollout driver's, env.workers > 0) that runs the environments' steps while
    the engine steps (resets stay inline; its own timeout applies). Mutates nothing the training
    rollout reads."""
    if runner is not None and runner.pending:
        raise RuntimeError(f"evaluate: the worker pool has {runner.pending} calls out; evaluate between rollouts")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank}, world={world}: expected 0 <= rank < world")
    check_rows(task_name, task_params, rows)
    if engine.is_asleep:
        raise RuntimeError("evaluate: the engine is asleep (its pool is released); wake() it first")
    signals = engine.stats()
    if signals["running"] or signals["waiting"]:
        raise RuntimeError(f"evaluate: the engine has {signals['running']} running and {signals['waiting']} "
                           f"waiting sequences; evaluate between rollouts")
    t0 = time.perf_counter()
    max_new = config.max_new_tokens if config.max_new_tokens is not None else rollout_max_new_tokens
    sampling = {"max_new_tokens": max_new, "temperature": config.temperature, "top_p": config.top_p,
                "stop_token_ids": tuple(tokenizer.stop_token_ids), "stop_strings": tuple(tokenizer.stop_strings)}
    episode_runner = EpisodeRunner.for_task(engine, tokenizer, make_task(task_name, **task_params))
    episodes = _Episodes(episode_runner, sampling, seed, env_timeout_s, runner)
    prompts: list[tuple[int, str | list[dict], list[_Sample]]] = []
    dispatcher = Dispatcher(engine, ThrottleConfig())
    prefix_was_empty = engine.prefix_cache_is_empty
    before = set(engine.requests)
    try:
        num_prompts = config.num_prompts if rows is None else min(config.num_prompts, len(rows))
        for i in range(rank, num_prompts, world):
            row = None if rows is None else rows[i]
            text, samples = _start(task_name, task_params, episode_runner, i, config.n, seed, env_timeout_s, row)
            prompts.append((i, text, samples))
            if samples[0].error is None:  # the prompt's first turn: one request of n samples (prefilled once)
                for sub in episodes.request(samples):
                    dispatcher.add(sub)
        dispatcher.run(background=_Calls(episodes) if runner is not None else None)
        engine.drain()  # expert parallelism: join the peers' steps until every rank's evaluation is done
    finally:
        for request_id in [r for r in engine.requests if r not in before]:  # an error left requests: abort
            engine.abort(request_id)
    if prefix_was_empty:
        engine.clear_prefix_cache()  # as found (a weight load empties it before each evaluation in a run)
    metrics = _metrics(prompts, config.n, time.perf_counter() - t0)
    if config.dump and out_dir is not None:
        name = f"iter_{iteration}.jsonl" if world == 1 else f"iter_{iteration}.rank{rank}.jsonl"
        _dump(Path(out_dir) / "val" / name, iteration, prompts)
    return metrics


def check_rows(task_name: str, task_params: dict, rows: Sequence[dict] | None) -> None:
    """ValueError unless `rows` is None, or non-empty and the task's `reset` takes a `row`."""
    if rows is None:
        return
    if not len(rows):
        raise ValueError("evaluation rows: the list is empty, expected at least one row (or none: the task's "
                         "own held-out episodes)")
    reset = make_task(task_name, **task_params).reset
    if "row" not in inspect.signature(reset).parameters:
        raise ValueError(f"evaluation rows given, but task {task_name!r}'s reset takes no `row`: expected a task "
                         f"over data rows (such as 'scored')")


def _metrics(prompts: list[tuple[int, str | list[dict], list[_Sample]]], n: int, seconds: float) -> dict[str, float]:
    samples = [s for _, _, ss in prompts for s in ss]
    sums = {"val/num_prompts": float(len(prompts)), "val/num_samples": float(len(samples)),
            "val/reward_sum": sum(s.reward for s in samples),
            "val/num_correct": float(sum(s.correct for s in samples)),
            "val/num_pass": float(sum(any(s.correct for s in ss) for _, _, ss in prompts)),
            "val/mean_sum": sum(sum(s.reward for s in ss) / len(ss) for _, _, ss in prompts),
            "val/tokens": float(sum(s.num_generated for s in samples)),
            "val/errors": float(sum(s.error is not None for s in samples))}
    return {**sums, **val_ratios(sums, n), "val/seconds": seconds}


def val_ratios(sums: dict[str, float], n: int) -> dict[str, float]:
    """The evaluation's ratios from its raw sums (`SUMS`; one rank's or summed over ranks); NaN
    where the denominator is 0 (a rank without prompts)."""
    def ratio(num: str, den: str) -> float:
        return sums[num] / sums[den] if sums[den] else float("nan")

    return {"val/reward_mean": ratio("val/reward_sum", "val/num_samples"),
            "val/correct_frac": ratio("val/num_correct", "val/num_samples"),
            f"val/pass@{n}": ratio("val/num_pass", "val/num_prompts"),
            f"val/mean@{n}": ratio("val/mean_sum", "val/num_prompts")}


def _dump(path: Path, iteration: int, prompts: list[tuple[int, str | list[dict], list[_Sample]]]) -> None:
    """One JSON line per prompt, written atomically and durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"iteration": iteration, "index": i, "prompt": text, "samples": [s.row() for s in ss]})
             for i, text, ss in prompts]
    write_durable(path, "".join(line + "\n" for line in lines).encode())


def evaluator(engine: Engine, tokenizer, task_name: str, task_params: dict, config: EvalConfig, *, seed: int,
              out_dir: str | Path | None, rank: int = 0, world: int = 1,
              rollout_max_new_tokens: int = DriverConfig.max_new_tokens,
              env_timeout_s: float | None = EnvConfig.timeout_s,
              rows: Sequence[dict] | None = None, runner: EnvRunner | None = None
              ) -> Callable[[int], dict[str, float]] | None:
    """`evaluate` bound to the run's parts, called with the iteration (rl/run/loop.py's
    `LoopParts.evaluate`); None when `config` never evaluates."""
    if config.every is None and not config.before_train:
        return None
    make_task(task_name, **task_params)  # fail now, with the task's own message
    check_rows(task_name, task_params, rows)

    def run(iteration: int) -> dict[str, float]:
        return evaluate(engine, tokenizer, task_name, task_params, config, seed=seed, iteration=iteration,
                        out_dir=out_dir, rank=rank, world=world, rollout_max_new_tokens=rollout_max_new_tokens,
                        env_timeout_s=env_timeout_s, rows=rows, runner=runner)

    return run
