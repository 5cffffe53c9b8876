"""A rollout iteration's counters (`new_counters`, updated in place by the driver's turns) and the metrics
they become (`rollout_metrics`): throughput, finished / carried / dropped trajectories by reason, reward
components, and how the environments' calls shared the wall time with the engine."""
from __future__ import annotations

from rl.episodes.env_runner import DROP_REASONS, EnvRunner
from rollout.dispatcher import Dispatcher


def new_counters() -> dict:
    """The iteration's counters: tokens, finished, reward components, dropped/<reason>, environment retries,
    timeouts and failures scored, and the step results held for a simulated tool latency (how many, the
    seconds summed)."""
    return {"tokens": 0, "finished": 0, "components": {}, **{f"dropped/{reason}": 0 for reason in DROP_REASONS},
            "env_retries": 0, "env_timeouts": 0, "env_failures_scored": 0,
            "tool_calls_delayed": 0, "tool_wait_seconds": 0.0}


def rollout_metrics(stats: dict, dispatcher: Dispatcher, runner: EnvRunner | None, seconds: float, generated: int,
                    num_carried: int, calls_before: int, busy_before: float) -> dict[str, float]:
    """The metrics of an iteration that ran `seconds` and generated `generated` tokens: its counters
    `stats`, the dispatcher's split of the wall time, and the worker pool's calls since
    (`calls_before`, `busy_before`) when there is one. `tool_calls_delayed` / `tool_wait_seconds` (the
    step results held for a simulated tool latency, and those latencies summed) appear only in an
    iteration that delayed some."""
    dropped = {f"dropped/{reason}": float(stats[f"dropped/{reason}"]) for reason in DROP_REASONS}
    env_calls = {"env_retries": float(stats["env_retries"]), "env_timeouts": float(stats["env_timeouts"]),
                 "env_failures_scored": float(stats["env_failures_scored"]),
                 # the engine's share of the rollout's wall time, and the environments' work done off it
                 "engine_step_seconds": dispatcher.engine_seconds, "env_wait_seconds": dispatcher.wait_seconds,
                 **({"env_calls": float(runner.num_calls - calls_before),
                     "env_busy_seconds": runner.busy_seconds - busy_before,
                     "env_stuck_calls": float(runner.num_stuck)} if runner else {}),
                 # the simulated tool latency (env.tool_latency_*): only in iterations that applied one
                 **({"tool_calls_delayed": float(stats["tool_calls_delayed"]),
                     "tool_wait_seconds": float(stats["tool_wait_seconds"])} if stats["tool_calls_delayed"] else {})}
    return {"rollout_seconds": seconds, "rollout_tokens": float(generated),
            "rollout_tok_s": generated / max(seconds, 1e-9),
            "trajectories_finished": float(stats["finished"]), "trajectories_carried": float(num_carried),
            # reward components: the mean over this iteration's finished trajectories (a missing one counts 0)
            **{f"reward/{k}": v / stats["finished"] for k, v in sorted(stats["components"].items())},
            **dropped, "trajectories_dropped": sum(dropped.values()), **env_calls,
            # the names before the drops had reasons, kept for older readers
            "env_errors": dropped["dropped/env_error"], "rollout_dropped_too_long": dropped["dropped/too_long"]}
