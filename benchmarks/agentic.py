"""Agentic rollout: environment calls on worker threads vs inline, on a multi-turn tool workload.

    OMP_NUM_THREADS=1 python -m benchmarks.agentic [--quick]

`--groups` groups x `--group-size` trajectories of the tiny model (configs/model/tiny.yaml, greedy,
`--max-new-tokens` per turn), each episode `--turns` turns of the "bench_tool" environment: reset
gives a short prompt at once; each step is a tool call sleeping a latency drawn from a seeded RNG
(mean `--latency-s`, uniform within +-`--jitter` of it), and a `--hang-fraction` of the calls hang
for `--hang-s` seconds, past the call timeout. One rollout iteration runs twice in this process,
each on a fresh engine with the same weights: serial (env.workers=0: every call inline, the engine
waits) and async (env.workers=`--workers`: the calls run on worker threads while the engine steps
the other requests); both with timeout_s=`--timeout-s`, max_retries=`--max-retries`,
backoff_s=`--backoff-s`. A call's latency and whether it hangs depend only on (--seed, the episode's
seed, the turn), never on the order of calls, so both modes meet the same tools; a hanging call
hangs only the first time it is made in a mode, so its retry (a fresh environment replayed to the
turn) returns, and both modes should finish the same trajectories token for token. Group members
decode greedily from one prompt, so they give the same answers and share their calls' latencies.
Final line:
async_vs_serial_time=... same_trajectories=... tool_timeouts=... engine_busy_fraction=... serial_s=...
async_s=... env_calls=...
"""
from __future__ import annotations

import argparse
import random
import threading
import time
from dataclasses import dataclass, field

from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import ByteTokenizer
from rl.episodes.env_runner import EnvConfig
from rl.episodes.driver import DriverConfig, RolloutDriver, mix_seed
from rl.envs.tasks.base import TASKS, StepResult, register_task
from rollout.engine import Engine, EngineConfig

TASK = "bench_tool"


@dataclass
class ToolLedger:
    """What the tool calls of one mode did, shared by every environment of the process (a retry
    builds a fresh environment, so "has this call hung already" cannot live on the environment)."""
    hung: set = field(default_factory=set)
    """(episode seed, turn) of the calls that hung once; a later call of the same one returns."""
    num_tool_calls: int = 0
    """Steps called, replays on fresh environments included."""
    tool_s: float = 0.0
    """Seconds the steps slept, a hang counted at its full --hang-s."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        with self.lock:
            self.hung.clear()
            self.num_tool_calls, self.tool_s = 0, 0.0


LEDGER = ToolLedger()


def tool_delay(seed: int, episode: int, turn: int, latency_s: float, jitter: float,
               hang_fraction: float) -> tuple[float, bool]:
    """(latency in seconds, whether the call hangs) of the `turn`-th step of episode `episode`:
    drawn from an RNG seeded by these alone, so any mode and any call order meets the same tools."""
    rng = random.Random(f"{seed}/{episode}/{turn}")  # str seeds hash with sha512: stable across processes
    hangs = rng.random() < hang_fraction
    return latency_s * (1.0 + jitter * (2.0 * rng.random() - 1.0)), hangs


@dataclass
class BenchTool:
    """A multi-turn tool environment: reset returns a short prompt at once, each step sleeps the
    call's latency (or hangs) and answers with the tool's output; the episode ends after `max_turns` steps."""
    seed: int = 0
    latency_s: float = 0.2
    jitter: float = 0.5
    hang_fraction: float = 0.02
    hang_s: float = 5.0
    max_turns: int = 4
    episode: int = 0
    turn: int = 0

    def reset(self, seed: int) -> str:
        self.episode, self.turn = seed, 0
        return f"task {seed % 997}: call the tool."

    def step(self, answer: str) -> StepResult:
        key = (self.episode, self.turn)
        delay_s, hangs = tool_delay(self.seed, self.episode, self.turn, self.latency_s, self.jitter, self.hang_fraction)
        with LEDGER.lock:
            if hangs and key not in LEDGER.hung:
                LEDGER.hung.add(key)
                delay_s = self.hang_s
            LEDGER.num_tool_calls += 1
            LEDGER.tool_s += delay_s
        time.sleep(delay_s)
        self.turn += 1
        reward = float(len(answer) % 3) / 2
        return StepResult(f" tool[{self.turn}]={len(answer)};", reward, self.turn >= self.max_turns, role="tool")


if TASK not in TASKS:
    register_task(TASK)(BenchTool)


def make_driver(args: argparse.Namespace, env: EnvConfig) -> RolloutDriver:
    """A fresh engine (the same weights every call) and a greedy driver on the bench_tool task."""
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=7, std=0.15)
    engine = Engine(model, EngineConfig.for_pages(model, args.pages, max_model_len=args.max_model_len))
    params = {"seed": args.seed, "latency_s": args.latency_s, "jitter": args.jitter,
              "hang_fraction": args.hang_fraction, "hang_s": args.hang_s, "max_turns": args.turns}
    config = DriverConfig(groups_per_iteration=args.groups, max_new_tokens=args.max_new_tokens)
    d = RolloutDriver(engine, ByteTokenizer(), TASK, params, config, group_size=args.group_size, seed=3, env=env)
    d.sampling["temperature"] = 0.0  # greedy: both modes must finish the same trajectories
    engine.load_weights(engine.model.state_dict(), version=1)
    return d


def run_mode(args: argparse.Namespace, workers: int) -> tuple[dict[str, float], list[tuple]]:
    """One rollout iteration with `workers` env workers (0 = inline): its figures and its finished
    trajectories as (id, tokens, policy mask, reward, answers), sorted."""
    env = EnvConfig(workers=workers, timeout_s=args.timeout_s, max_retries=args.max_retries, backoff_s=args.backoff_s)
    d = make_driver(args, env)
    LEDGER.clear()
    t0 = time.perf_counter()
    result = d.rollout()
    wall_s, metrics = time.perf_counter() - t0, result.metrics
    if d.runner is not None:
        d.runner.close()
    with LEDGER.lock:
        tool_calls, tool_s = LEDGER.num_tool_calls, LEDGER.tool_s
    trajs = sorted((t.traj_id, tuple(t.tokens), tuple(t.policy), t.reward, tuple(t.answers))
                   for g in result.groups for t in g)
    figures = {"wall_s": wall_s, "rollout_s": metrics["rollout_seconds"], "tokens": metrics["rollout_tokens"],
               "finished": float(len(trajs)), "tool_calls": float(tool_calls), "tool_s": tool_s,
               "env_calls": metrics.get("env_calls", float("nan")),  # the worker pool's count (async only)
               "timeouts": metrics["env_timeouts"], "retries": metrics["env_retries"],
               "dropped": metrics["trajectories_dropped"], "engine_s": metrics["engine_step_seconds"],
               "wait_s": metrics["env_wait_seconds"],
               "engine_busy_fraction": metrics["engine_step_seconds"] / max(metrics["rollout_seconds"], 1e-9)}
    return figures, trajs


def planned_hangs(args: argparse.Namespace) -> int:
    """Calls (episode, turn) drawn to hang: each times out once per mode (the driver's seed is 3)."""
    return sum(tool_delay(args.seed, mix_seed(3, g), turn, args.latency_s, args.jitter, args.hang_fraction)[1]
               for g in range(args.groups) for turn in range(args.turns))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8, help="per turn")
    p.add_argument("--latency-s", type=float, default=0.2, help="mean tool latency")
    p.add_argument("--jitter", type=float, default=0.5, help="latency uniform in mean x (1 +- jitter)")
    p.add_argument("--hang-fraction", type=float, default=0.02, help="share of the calls that hang once")
    p.add_argument("--hang-s", type=float, default=5.0, help="how long a hanging call sleeps")
    p.add_argument("--workers", type=int, default=32, help="env workers of the async mode")
    p.add_argument("--timeout-s", type=float, default=1.0)
    p.add_argument("--max-retries", type=int, default=1)
    p.add_argument("--backoff-s", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="the tools' latencies and hangs")
    p.add_argument("--max-model-len", type=int, default=192)
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--quick", action="store_true", help="2 groups")
    args = p.parse_args(argv)
    if args.quick:
        args.groups = 2
    if not 0 <= args.jitter < 1:
        raise ValueError(f"--jitter={args.jitter}, expected 0 <= jitter < 1 (latencies stay positive)")
    print(f"{args.groups} groups x {args.group_size}, {args.turns} turns, tools {args.latency_s:g} s "
          f"+-{args.jitter:.0%}, {planned_hangs(args)} calls drawn to hang {args.hang_s:g} s "
          f"(timeout {args.timeout_s:g} s)", flush=True)
    serial, serial_trajs = run_mode(args, 0)
    asyn, async_trajs = run_mode(args, args.workers)
    for name, r in (("serial", serial), (f"async{args.workers}", asyn)):
        pool_calls = "   -" if r["env_calls"] != r["env_calls"] else f"{r['env_calls']:4.0f}"  # NaN: inline, no pool
        print(f"{name:8s} wall {r['wall_s']:6.2f} s  tokens {r['tokens']:5.0f}  finished {r['finished']:3.0f}  "
              f"tool calls {r['tool_calls']:4.0f} ({r['tool_s']:6.2f} s)  env calls {pool_calls}  "
              f"timeouts {r['timeouts']:2.0f}  retries {r['retries']:2.0f}  dropped {r['dropped']:2.0f}  "
              f"engine {r['engine_s']:5.2f} s  idle wait {r['wait_s']:5.2f} s  "
              f"engine busy {r['engine_busy_fraction']:.2f}", flush=True)
    same = serial_trajs == async_trajs and len(serial_trajs) > 0
    print(f"trajectories identical: {same} ({len(serial_trajs)} serial, {len(async_trajs)} async)")
    figures = {"async_vs_serial_time": asyn["wall_s"] / serial["wall_s"], "same_trajectories": int(same),
               "tool_timeouts": int(asyn["timeouts"]), "engine_busy_fraction": asyn["engine_busy_fraction"],
               "serial_s": serial["wall_s"], "async_s": asyn["wall_s"], "env_calls": int(asyn["env_calls"])}
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
    return figures


if __name__ == "__main__":
    main()
