"""The rollout phase: trajectories of environment episodes generated through the engine.

A *group* is `group_size` trajectories of one episode seed (the same first prompt): its first
turn is one engine request with n = group_size (prefilled once, forked), later turns are one
request per trajectory whose prompt is the whole conversation so far (turn boundaries marked).
Every generated token keeps its behaviour logprob and the policy version that sampled it.

Partial rollouts: when the iteration's budget (generated tokens and/or seconds) runs out, the
unfinished trajectories stop where they are and carry over to the next iteration, keeping the
tokens they have. They continue either by recompute (a new request whose prompt includes the
partial answer, computed under the new weights) or, with `partial_resume="kv"`, by resuming the
paused engine request on its kept (stale) KV. Groups are trained once all their members are done.
Divided rollout (`stagger_lead` > 0): a group's first request carries only its first `stagger_lead`
members; the others' request follows when it ends, so their suffix proposals find the leaders' text.
Data-parallel rollout: with several ranks, each driver starts only its share of the global groups
(g % world == rank); a group stays on its rank until trained. The rollout makes no collective call:
a count over the ranks it needs (max_groups_in_flight's unfinished groups) is the caller's, passed in.
Faults cost trajectories, never the run. Each of these drops the trajectories it hits, logs one
line (who, the error, the reason) in `errors` and counts them as `dropped/<reason>` (and in
`trajectories_dropped`); a fault before a group's first request (its prompt) drops the whole group,
which is then skipped (GRPO needs the group), a later one drops only its trajectory:
- `too_long`: a context the engine can never run (`ContextTooLong`: longer than engine.max_model_len,
  or more pages than the pool; a long prompt or tool reply), checked before each request is submitted;
- `env_error`: the task's factory, `reset` or `step` raised (or returned no StepResult);
- `timeout`: one such call ran past `env.timeout_s` (ended on its thread, its environment discarded);
- `tokenizer`: encoding a prompt or observation, or decoding an answer, raised;
- `bad_reward`: a step's reward is not a finite number.
The circuit breaker over these counts lives in rl/run/loop.py.
Data rows: with a `RowSampler` (rl/envs/data.py), global group g takes the sampler's row g-th in its
deterministic order (every rank advances over every global group, so ranks agree without talking);
an environment whose `reset` takes `row` receives it, and a prompt given as chat messages is
rendered as they are. The sampler's position is part of the driver's checkpoint state.
The episode's conversions (first prompt with the task's tool schemas, answer text, step results, requests)
are rl/episodes/runner.py's, shared with validation; the environments and every call to them are
rl/episodes/env_calls.py's (`EnvCalls`, the driver's `calls`: one call for a request's samples when the
task steps many at once).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass, field

from rl.envs.data import DataExhausted, RowSampler
from rl.envs.tasks.base import make_task, resolve_task
from rl.episodes.cache_metrics import cache_metrics
from rl.episodes.driver_config import DriverConfig
from rl.episodes.env_calls import CallEnded, EnvCalls
from rl.episodes.env_runner import Dropped, EnvConfig
from rl.episodes.rollout_metrics import new_counters, rollout_metrics
from rl.episodes.runner import EpisodeRunner, mix_seed
from rl.episodes.trajectory import Trajectory
from rollout.dispatcher import Dispatcher, Submission, ThrottleConfig
from rollout.engine import Engine
from rollout.request import RequestOutput
from rollout.sampling import SamplingParams


@dataclass
class TurnEnd:
    """The follow-up of a request continuing `trajs` (the dispatcher's `FollowUp`): appends each
    sample to its trajectory, scores the finished turn, and returns the requests of those that go
    on. `trajs` is also who the request continues when an iteration stops before it finishes."""

    driver: "RolloutDriver"
    trajs: list[Trajectory]
    stats: dict
    """The iteration's counters (tokens, finished, dropped/<reason>), updated in place."""

    def __call__(self, out: RequestOutput) -> list[Submission]:
        for t, sample in zip(self.trajs, out.samples):
            t.request_id = None
            if t.tokens[:len(out.prompt)] != out.prompt:  # token in, token out: no text round trip anywhere
                raise AssertionError(f"trajectory {t.traj_id}: the engine's prompt ({len(out.prompt)} tokens) is not "
                                     f"a prefix of the trajectory's tokens: what the trainer scores would differ "
                                     f"from what the engine saw")
            self.stats["tokens"] += t.append_sample(sample)
        return self.driver._release_followers(self.trajs[0].group_id, self.stats) + \
            self.driver._end_turns(self.trajs, self.stats)


@dataclass
class EnvBackground:
    """The dispatcher's `Background` (rollout/dispatcher.py): the driver's environment calls on its
    worker pool; each one that ended is applied on the driver's thread, its requests returned."""

    driver: "RolloutDriver"

    @property
    def pending(self) -> int:
        return self.driver.calls.pending

    def wait(self, timeout_s: float) -> None:
        self.driver.calls.wait(timeout_s)

    def collect(self) -> list[Submission]:
        return [sub for ended in self.driver.calls.collect() for sub in self.driver._call_ended(ended)]


def _continued(sub: Submission) -> list[Trajectory]:
    """The trajectories a driver's submission continues (every one it makes has a `TurnEnd`)."""
    if not isinstance(sub.follow_up, TurnEnd):
        raise TypeError(f"submission with follow-up {sub.follow_up!r}: the RL driver only sends TurnEnd ones")
    return sub.follow_up.trajs


@dataclass
class RolloutResult:
    """What one rollout (`RolloutDriver.rollout`) hands the loop."""
    groups: list[list[Trajectory]]
    """The groups all of whose (not dropped) members are done, in group order (`take_finished_groups`)."""
    metrics: dict[str, float]
    """The iteration's rollout metrics (`run_iteration`)."""
    errors: list[str] = field(default_factory=list)
    """One line per drop (or failure scored) since the last rollout: who, the error, the reason."""


class RolloutDriver:
    """Runs iterations of trajectory generation against one engine; its state (carried-over and
    finished-but-ungrouped trajectories, counters) is plain data saved with each checkpoint. Its
    parts: `episodes` (an EpisodeRunner: prompts, answers, step results, requests) and `calls` (the
    environments and every call to them, inline or on the worker pool `runner`)."""

    def __init__(self, engine: Engine, tokenizer, task_name: str, task_params: dict, config: DriverConfig, *,
                 group_size: int, seed: int, rank: int = 0, world: int = 1, rows: RowSampler | None = None,
                 env: EnvConfig = EnvConfig()) -> None:
        """config.groups_per_iteration counts global groups; with `world` > 1 ranks this driver
        generates only the groups g with g % world == rank (every seed derives from the run `seed`
        and the global g, so the episodes and sampled tokens do not depend on the number of ranks),
        and stops each iteration at its share of config.budget_tokens, ceil(budget_tokens / world).
        `rows`: the data source; group g gets its g-th row (passed to `reset(seed, row=...)` when the
        task's reset takes `row`). `env`: how environment calls run (rl/episodes/env_runner.py: inline, or on
        worker threads while the engine steps; timeouts, retries, the failure policy)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank}, world={world}: expected 0 <= rank < world")
        self.config, self.engine, self.tokenizer, self.rank, self.world = config, engine, tokenizer, rank, world
        self.task_name, self.task_params = task_name, dict(task_params)
        try:
            probe = make_task(task_name, **self.task_params)  # fail now, with the task's own message
        except TypeError as err:
            raise ValueError(f"task {task_name!r} rejects params {self.task_params}: {err}") from None
        self.rows = rows
        self.episodes = EpisodeRunner.for_task(engine, tokenizer, probe)
        """The episode's conversions (first prompt with the task's tool schemas, answer text, step
        results, requests with the engine's context check), shared with validation."""
        pass_row = rows is not None and "row" in inspect.signature(probe.reset).parameters
        self.calls = EnvCalls(task_name, self.task_params, env, seed=seed, rows=rows, pass_row=pass_row)
        self.runner = self.calls.pool
        """The worker pool of environment calls (env.workers > 0), else None: calls run inline."""
        self.data_exhausted = False
        """The sampler ran out (DataExhausted): no new groups start; the run ends once nothing is in flight."""
        self.group_size, self.seed = group_size, seed
        # the config's knobs under the names the iteration code reads; budget_tokens is this rank's share
        self.groups_per_iteration, self.max_new_tokens = config.groups_per_iteration, config.max_new_tokens
        # the tokenizer's stop ids (eos, generation_config.json's, the chat template's end of turn) end answers
        self.sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                         "stop_token_ids": tuple(tokenizer.stop_token_ids), "stop_strings": tuple(tokenizer.stop_strings)}
        self.throttle = ThrottleConfig(max_concurrency=config.max_concurrency)
        self.partial_resume = config.partial_resume
        factory = resolve_task(task_name)  # a task's own failure policy wins over the env group's
        self.on_failure = getattr(factory, "on_failure", env.on_failure)
        self.failure_reward = float(getattr(factory, "failure_reward", env.failure_reward))
        if self.on_failure not in ("drop", "score"):
            raise ValueError(f"task {task_name!r}: on_failure={self.on_failure!r}, expected 'drop' or 'score'")
        self.budget_tokens = None if config.budget_tokens is None else -(-config.budget_tokens // world)
        self.budget_seconds = config.budget_seconds
        self.next_group = 0
        self.carry: list[Trajectory] = []  # unfinished, carried over to the next iteration
        self.waiting: dict[int, list[Trajectory]] = {}  # group -> its finished members
        self.group_sizes: dict[int, int] = {}  # group -> members not dropped
        self.auto_limit: int | None = None  # the auto-throttle's limit, carried across iterations
        self.errors: list[str] = []  # one line per drop since the loop last read them: who, the error, why
        self.held: dict[int, list[Trajectory]] = {}  # group -> its later members (stagger_lead), not yet sent

    # ---- requests and turns ----------------------------------------------------------------------------
    def _request(self, trajs: list[Trajectory], stats: dict) -> Submission:
        """The request continuing `trajs` (one group's first turn, or one trajectory), its follow-up a
        `TurnEnd` on them; the turn boundaries let the engine's prefix cache keep a checkpoint at each
        turn. Raises Dropped("too_long") when the engine refuses its context."""
        traj = trajs[0]
        remaining = max(1, self.max_new_tokens - traj.num_generated_in_turn)
        seed = mix_seed(self.seed, traj.group_id, traj.member, len(traj.answers), traj.num_generated_in_turn)
        params = SamplingParams(n=len(trajs), max_new_tokens=remaining, seed=seed, **self.sampling)
        return self.episodes.submission(traj.tokens, params, TurnEnd(self, trajs, stats), traj.turn_boundaries)

    def _admissible(self, trajs: list[Trajectory], stats: dict) -> list[Submission]:
        """[the request continuing `trajs`], or [] when the engine refuses its context
        (`Engine.check_context`): then `trajs` are dropped, with one logged line and counted."""
        try:
            return [self._request(trajs, stats)]
        except Dropped as fault:
            self._drop(trajs, fault, stats)
            return []

    def _end_turns(self, trajs: list[Trajectory], stats: dict) -> list[Submission]:
        """One request's samples ended their turn: their steps inline (`EnvCalls.steps`), then the requests
        of those that go on; or, with a worker pool, each step handed there (back through `EnvBackground`)."""
        live: list[tuple[Trajectory, str]] = []
        for traj in trajs:
            try:
                answer = self.episodes.answer_text(traj.tokens[traj.turn_start:])
                if self.runner is not None:
                    self.calls.submit_step(traj, answer, stats)
                    ready = self.calls.expected_ready(traj.traj_id)  # its tool's result: the KV waits until then
                    if ready is not None:
                        self.engine.expect_resume(traj.tokens, ready)
                else:
                    live.append((traj, answer))
            except Dropped as fault:
                self._fail(traj, fault, stats)
        nxt: list[Submission] = []
        for (traj, answer), outcome in zip(live, self.calls.steps([t for t, _ in live], [a for _, a in live], stats)):
            if isinstance(outcome, Dropped):
                self._fail(traj, outcome, stats)
            elif self._apply(traj, answer, outcome[0].max_turns, outcome[1], stats):
                nxt += self._admissible([traj], stats)
        return nxt

    def _call_ended(self, ended: CallEnded) -> list[Submission]:
        """A worker-pool call ended for good (`EnvCalls.collect`): its result applied, the next request."""
        if ended.kind == "reset":
            if ended.fault is not None:
                self._drop(ended.trajs, ended.fault, ended.stats)  # no prompt, no group: never scored
                return []
            return self._first_request(ended.trajs, ended.value, ended.stats)
        traj = ended.trajs[0]
        if ended.fault is not None:
            self._fail(traj, ended.fault, ended.stats)
            return []
        applied = self._apply(traj, ended.answer, ended.env.max_turns, ended.value, ended.stats)
        return self._admissible([traj], ended.stats) if applied else []

    def _apply(self, traj: Trajectory, answer: str, max_turns: int, result: object, stats: dict) -> bool:
        """The turn's StepResult applied to `traj`: reward, observation tokens, or the episode's end;
        True when another turn follows."""
        try:
            turn = self.episodes.outcome(result, len(traj.answers) + 1, max_turns)
        except Dropped as fault:
            self._drop([traj], fault, stats)
            return False
        if traj.end_turn(answer, turn):
            return True
        self._finish(traj, stats)
        return False

    def _finish(self, traj: Trajectory, stats: dict) -> None:
        traj.done = True
        self.calls.forget(traj.traj_id)
        self.waiting.setdefault(traj.group_id, []).append(traj)
        stats["finished"] += 1
        for name, value in traj.components.items():
            stats["components"][name] = stats["components"].get(name, 0.0) + value

    def _fail(self, traj: Trajectory, fault: Dropped, stats: dict) -> None:
        """A turn's answer or environment call failed for good: drop the trajectory, or, for an
        environment call (timeout, env_error) under on_failure=score, end its episode with
        failure_reward (it trains; one logged line either way)."""
        if self.on_failure == "drop" or fault.reason not in ("timeout", "env_error"):
            self._drop([traj], fault, stats)
            return
        self.errors.append(f"trajectory {traj.traj_id} (group {traj.group_id}, turn {len(traj.answers) + 1}): "
                           f"{fault} (scored {self.failure_reward:g}: on_failure=score)")
        stats["env_failures_scored"] += 1
        self.calls.forget(traj.traj_id)
        traj.answers.append("")
        traj.reward += self.failure_reward
        self._finish(traj, stats)

    def _drop(self, trajs: list[Trajectory], fault: Dropped, stats: dict) -> None:
        """Take `trajs` (one trajectory, or a whole group before its first request) out of their group,
        with one line in `errors` and counted in stats["dropped/<reason>"]; a group left with no member
        is forgotten: it is skipped, never trained."""
        traj = trajs[0]
        who = (f"group {traj.group_id} ({len(trajs)} trajectories)" if len(trajs) > 1
               else f"trajectory {traj.traj_id} (group {traj.group_id}, turn {len(traj.answers) + 1})")
        self.errors.append(f"{who}: {fault} (reason: {fault.reason})")
        for t in trajs:
            self.calls.forget(t.traj_id)
            self.group_sizes[t.group_id] -= 1
            stats[f"dropped/{fault.reason}"] += 1
            if not self.group_sizes[t.group_id]:
                del self.group_sizes[t.group_id]

    @property
    def groups_next_iteration(self) -> int:
        """New groups this rank starts in the next `run_iteration` (its share of the global ones)."""
        return sum(g % self.world == self.rank for g in range(self.next_group, self.next_group + self.groups_per_iteration))

    @property
    def unfinished_groups(self) -> int:
        """This rank's groups started and not yet taken (`take_finished_groups`): carried over, in
        flight or finished and waiting; a group whose every member was dropped is not counted."""
        return len(self.group_sizes)

    # ---- one iteration ---------------------------------------------------------------------------------
    def rollout(self, progress=None, groups_in_flight: int | None = None) -> RolloutResult:
        """One iteration (`run_iteration`), then its finished groups (`take_finished_groups`) and the
        error lines logged since the last rollout (`errors`, emptied)."""
        metrics = self.run_iteration(progress, groups_in_flight=groups_in_flight)
        errors, self.errors = self.errors, []
        return RolloutResult(self.take_finished_groups(), metrics, errors)

    def run_iteration(self, progress=None, *, groups_in_flight: int | None = None) -> dict[str, float]:
        """Continue carried-over trajectories, start this iteration's new groups, stop at the budget.
        Returns rollout metrics; finished groups are then collected with `take_finished_groups`.
        `progress`: a bar with `update(finished, tokens, pool_utilization, concurrency)`, updated after
        every engine step. `groups_in_flight`: the unfinished groups over all ranks (each rank's
        `unfinished_groups`, summed at the phase boundary before the rollout: the same number on
        every rank), which config.max_groups_in_flight caps; needed on several ranks with that cap
        (the rollout makes no collective call); one rank counts its own when it is None."""
        if self.world > 1 and self.config.max_groups_in_flight is not None and groups_in_flight is None:
            raise ValueError(f"max_groups_in_flight={self.config.max_groups_in_flight} on {self.world} ranks: "
                             f"run_iteration needs groups_in_flight (the unfinished groups summed over the ranks)")
        dispatcher = Dispatcher(self.engine, self.throttle)
        if dispatcher.auto is not None and self.auto_limit is not None:
            dispatcher.auto.limit = self.auto_limit
        stats = new_counters()
        calls_before, busy_before = (self.runner.num_calls, self.runner.busy_seconds) if self.runner else (0, 0.0)
        self._resubmit_carry(dispatcher, stats)
        self._start_new_groups(dispatcher, groups_in_flight, stats)
        t0, generated_before, entropy_before = time.perf_counter(), self.engine.num_generated, self.engine.entropy_sum
        counters_before, computed_before = self.engine.stats(), self.engine.num_computed_tokens

        def should_stop() -> bool:
            generated = self.engine.num_generated - generated_before  # sampled so far, finished or not
            return ((self.budget_tokens is not None and generated >= self.budget_tokens)
                    or (self.budget_seconds is not None and time.perf_counter() - t0 >= self.budget_seconds))

        def show_progress() -> None:
            progress.update(stats["finished"], self.engine.num_generated - generated_before,
                            self.engine.stats()["pool_utilization"], dispatcher.limit)

        dispatcher.run(should_stop=should_stop, background=EnvBackground(self) if self.runner is not None else None,
                       on_step=show_progress if progress is not None else None)
        self.engine.drain()  # expert parallelism: join the peers' steps until every rank's rollout is done
        self._stop_unfinished(dispatcher, stats)
        if dispatcher.auto is not None:
            self.auto_limit = dispatcher.auto.limit
        seconds, generated = time.perf_counter() - t0, self.engine.num_generated - generated_before
        cache = cache_metrics(counters_before, self.engine.stats(), self.engine.num_computed_tokens - computed_before)
        # the policy's entropy per sampled token (nats, at the sampling temperature; verl's actor/entropy)
        entropy = {"entropy": (self.engine.entropy_sum - entropy_before) / generated} if generated else {}
        return {**cache, **entropy,
                **rollout_metrics(stats, dispatcher, self.runner, seconds, generated, len(self.carry),
                                  calls_before, busy_before)}

    def _resubmit_carry(self, dispatcher: Dispatcher, stats: dict) -> None:
        """The carried-over trajectories back in flight: paused requests (partial_resume="kv")
        resumed and adopted, the others resubmitted (recompute)."""
        carry, self.carry = self.carry, []
        paused: dict[str, list[Trajectory]] = {}  # kept-KV requests (partial_resume="kv") -> their trajectories
        for traj in carry:
            if traj.request_id is not None and traj.request_id in self.engine.requests:
                paused.setdefault(traj.request_id, []).append(traj)
            else:
                traj.request_id = None
                for request in self._admissible([traj], stats):
                    dispatcher.add(request)
        for request_id, trajs in paused.items():
            self.engine.resume(request_id)
            dispatcher.adopt(request_id, self._request(trajs, stats))  # admitted before: it fits

    def _start_new_groups(self, dispatcher: Dispatcher, groups_in_flight: int | None, stats: dict) -> None:
        """This iteration's new global groups, this rank's share started (each global group takes the
        next data row on every rank)."""
        for _ in range(self._new_groups(groups_in_flight)):
            row_index = None
            if self.rows is not None:
                try:
                    self.rows[self.rows.position]  # every rank passes every global group: all agree
                except DataExhausted:
                    self.data_exhausted = True
                    break
                row_index, self.rows.position = self.rows.position, self.rows.position + 1
            group, self.next_group = self.next_group, self.next_group + 1
            if group % self.world == self.rank:  # else another rank's share
                self._start_group(dispatcher, group, row_index, stats)
        if self.rows is not None and not self.data_exhausted:
            try:  # the last row just started: say so now, so the run can end with this iteration
                self.rows[self.rows.position]
            except DataExhausted:
                self.data_exhausted = True

    def _start_group(self, dispatcher: Dispatcher, group: int, row_index: int | None, stats: dict) -> None:
        """Group `group`'s trajectories and its first request (one prompt, n = group_size); with a
        worker pool the environment's reset runs there and the request follows from `_call_ended`."""
        trajs = [Trajectory(f"{group}/{m}", group, m, [], [], [], [], 0, row_index=row_index)
                 for m in range(self.group_size)]
        self.group_sizes[group] = self.group_size
        if self.runner is not None:
            self.calls.submit_reset(trajs, stats)
            return
        try:  # the group's prompt: a fault here drops the whole group
            text = self.calls.first_prompt(group, row_index)
        except Dropped as fault:
            self._drop(trajs, fault, stats)
            return
        for request in self._first_request(trajs, text, stats):
            dispatcher.add(request)

    def _first_request(self, trajs: list[Trajectory], text: object, stats: dict) -> list[Submission]:
        """The group's prompt rendered into every member, and its request (or [] when refused)."""
        try:
            prompt = self.episodes.first_prompt(text)
        except Dropped as fault:
            self._drop(trajs, fault, stats)
            return []
        for t in trajs:
            t.tokens, t.policy = list(prompt), [False] * len(prompt)
            t.logprobs, t.versions, t.turn_start = [0.0] * len(prompt), [-1] * len(prompt), len(prompt)
        lead = self.config.stagger_lead
        if 0 < lead < len(trajs):  # divided rollout: the others follow once the leaders' first turn ends
            self.held[trajs[0].group_id] = trajs[lead:]
            return self._admissible(trajs[:lead], stats) or self._release_followers(trajs[0].group_id, stats)
        return self._admissible(trajs, stats)

    def _release_followers(self, group: int, stats: dict) -> list[Submission]:
        """The request of group `group`'s held later members (`DriverConfig.stagger_lead`), or []."""
        followers = self.held.pop(group, None)
        return self._admissible(followers, stats) if followers else []

    def _new_groups(self, groups_in_flight: int | None) -> int:
        """Global groups to start this iteration: groups_per_iteration, capped by max_groups_in_flight
        less the unfinished ones (`groups_in_flight`, over all ranks; this rank's own by default)."""
        cap = self.config.max_groups_in_flight
        if cap is None:
            return self.groups_per_iteration
        unfinished = self.unfinished_groups if groups_in_flight is None else groups_in_flight
        return max(0, min(self.groups_per_iteration, cap - unfinished))

    def _stop_unfinished(self, dispatcher: Dispatcher, stats: dict) -> None:
        """Budget reached: everything not finished becomes carry-over (paused with its KV, or with
        its partial answer appended for recompute)."""
        in_flight, backlog = dispatcher.clear()
        while self.runner is not None and self.runner.pending:  # turns whose environment call is out:
            self.runner.wait(0.5)  # their next request is known once it ends (bounded by env.timeout_s)
            for sub in EnvBackground(self).collect():
                self.carry += _continued(sub)
        for request_id, sub in in_flight:
            out, trajs = self.engine.output(request_id), _continued(sub)
            if self.partial_resume == "kv":
                self.engine.pause(request_id)
                for t in trajs:
                    t.request_id = request_id
            else:
                self.engine.abort(request_id)
                for t, sample in zip(trajs, out.samples):
                    stats["tokens"] += t.append_sample(sample)
            self.carry += trajs
        for sub in backlog:
            self.carry += _continued(sub)
        for followers in self.held.values():  # later members not yet sent: carried, each its own request
            self.carry += followers
        self.held.clear()

    def take_finished_groups(self) -> list[list[Trajectory]]:
        """Groups all of whose (not dropped) members are done, in group order; removed from the driver."""
        ready = sorted(g for g, members in self.waiting.items() if len(members) == self.group_sizes[g])
        groups = [sorted(self.waiting.pop(g), key=lambda t: t.member) for g in ready]
        for g in ready:
            del self.group_sizes[g]
        return [g for g in groups if g]

    # ---- checkpoint state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"next_group": self.next_group, "auto_limit": self.auto_limit,
                "carry": [asdict(t) | {"request_id": None} for t in self.carry],
                "waiting": {str(g): [asdict(t) for t in ts] for g, ts in self.waiting.items()},
                "group_sizes": {str(g): n for g, n in self.group_sizes.items()},
                "rows": None if self.rows is None else self.rows.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.next_group, self.auto_limit = state["next_group"], state["auto_limit"]
        self.carry = [Trajectory(**t) for t in state["carry"]]
        self.waiting = {int(g): [Trajectory(**t) for t in ts] for g, ts in state["waiting"].items()}
        self.group_sizes = {int(g): n for g, n in state["group_sizes"].items()}
        self.calls.envs.clear()
        if self.rows is not None:  # a checkpoint from before the data source (no "rows"): position 0
            self.rows.load_state_dict(state.get("rows") or {"epoch": 0, "index": 0})
