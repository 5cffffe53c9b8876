"""The write-back host KV tier on the workload it exists for: agentic rollouts whose tools take time.

    OMP_NUM_THREADS=1 python -m benchmarks.host_tier [--quick]

`--groups` x `--group-size` trajectories of the tiny model (configs/model/tiny.yaml, random weights,
greedy), each `--turns` turns of the "bench_context" environment: reset gives a context of
`--context-chars` characters, each tool call answers `--obs-chars` more after a log-normal latency
(median `--latency-s`, log-space sigma `--sigma`, capped at `--max-latency-s`: right-skewed as code
execution is, most calls quick and a long tail; drawn from (episode, turn) only, so every run meets
the same tools; the call sleeps it on one of `--workers` env worker threads), so contexts
grow to ~context + turns x (obs + answer) tokens and, at any moment, many trajectories wait on a tool
with their KV idle. One rollout iteration, side by side, each on a fresh engine with the same weights
and the prefix cache (hash blocks of `--hash-block`):
- unlimited: a device pool that never runs short (no host tier);
- tier: a device pool of `--pool-fraction` of the unlimited run's peak pages (about half of what the
  waiting trajectories hold), plus a host tier (write-back: a waiting conversation's KV goes to host
  memory when the pool is short, the one resuming last first; prefetched when its next request queues,
  the copy overlapping other sequences' steps on the host copier's side thread);
- recompute: the same short pool, no host tier: an evicted prefix is prefilled again.
Final line (ratios first): tier_vs_unlimited_pool tier_vs_recompute (rollout tokens per second of
wall time; targets >= 0.9 and >= 1.3) prefetch_hidden_fraction (the prefetch copies' time overlapped
with compute / their time; >= 0.8) prefetched_pages same_tokens (1: the three runs' trajectories are
identical) reprefilled_tokens_{tier,recompute} host_hit_tokens pool_pages peak_pages.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass

from benchmarks import parse_args
from models.config import load_model_config
from models.model import HybridLM
from models.tokenizer import ByteTokenizer
from rl.envs.tasks.base import TASKS, StepResult, register_task
from rl.episodes.driver import DriverConfig, RolloutDriver
from rl.episodes.env_runner import EnvConfig
from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig

TASK = "bench_context"
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789 "


@dataclass
class BenchContext:
    """reset: a context of `context_chars` characters drawn from the episode seed; each step: the tool's
    `obs_chars` more (its latency is the env group's, applied by the runtime); `max_turns` steps."""
    context_chars: int = 160
    obs_chars: int = 64
    max_turns: int = 4
    latency_s: float = 0.3
    sigma: float = 0.8
    max_latency_s: float = 3.0
    episode: int = 0
    turn: int = 0

    def latency(self) -> float:
        """This call's latency: log-normal (median latency_s, log-space sigma), capped at max_latency_s."""
        rng = random.Random(f"latency/{self.episode}/{self.turn}")
        return min(self.max_latency_s, self.latency_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)))

    def _text(self, n: int) -> str:
        rng = random.Random(f"{self.episode}/{self.turn}")
        return "".join(rng.choice(LETTERS) for _ in range(n))

    def reset(self, seed: int) -> str:
        self.episode, self.turn = seed, 0
        return "read:" + self._text(self.context_chars) + "\n"

    def step(self, answer: str) -> StepResult:
        time.sleep(self.latency())
        self.turn += 1
        return StepResult("\n=" + self._text(self.obs_chars) + "\n", float(len(answer) % 2), self.turn >= self.max_turns,
                          role="tool")


if TASK not in TASKS:
    register_task(TASK)(BenchContext)


def run(args, model: HybridLM, pages: int, host_pages: int) -> dict:
    """One rollout iteration on a fresh engine of `pages` device and `host_pages` host pages."""
    engine = Engine(model, EngineConfig.for_pages(model, pages, host_pages, max_model_len=args.max_model_len,
                                                  max_num_batched_tokens=args.batched_tokens,
                                                  max_num_seqs=args.max_seqs,
                                                  prefix_cache=PrefixCacheConfig(hash_block=args.hash_block)))
    env = EnvConfig(workers=args.workers, timeout_s=args.max_latency_s + 10.0)
    params = {"context_chars": args.context_chars, "obs_chars": args.obs_chars, "max_turns": args.turns,
              "latency_s": args.latency_s, "sigma": args.sigma, "max_latency_s": args.max_latency_s}
    config = DriverConfig(groups_per_iteration=args.groups, max_new_tokens=args.max_new_tokens,
                          max_concurrency=args.groups * args.group_size)
    driver = RolloutDriver(engine, ByteTokenizer(), TASK, params, config, group_size=args.group_size, seed=3, env=env)
    driver.sampling["temperature"] = 0.0  # greedy: the three runs must finish the same trajectories
    engine.load_weights(model.state_dict(), version=1)
    t0 = time.perf_counter()
    result = driver.rollout()
    wall = time.perf_counter() - t0
    if driver.runner is not None:
        driver.runner.close()
    m = result.metrics
    trajs = sorted((t.traj_id, tuple(t.tokens)) for g in result.groups for t in g)
    return {"wall_s": wall, "tokens": m["rollout_tokens"], "tok_s": m["rollout_tokens"] / wall, "trajs": trajs,
            "engine_s": m["engine_step_seconds"], "peak": engine.peak_pages_used, "metrics": m}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--context-chars", type=int, default=192)
    p.add_argument("--obs-chars", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=6, help="per turn")
    p.add_argument("--latency-s", type=float, default=0.3, help="median tool latency (log-normal)")
    p.add_argument("--sigma", type=float, default=0.8, help="the latency's log-space standard deviation")
    p.add_argument("--max-latency-s", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=64, help="env worker threads (a sleeping call holds one)")
    p.add_argument("--hash-block", type=int, default=16)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=768)
    p.add_argument("--pool-fraction", type=float, default=0.5, help="the short pool, of the unlimited run's peak")
    p.add_argument("--repeats", type=int, default=2)
    args = parse_args(p, argv, {"groups": 4, "turns": 3, "latency_s": 0.05, "repeats": 1, "context_chars": 96})
    if not 0 < args.pool_fraction < 1:
        raise ValueError(f"--pool-fraction={args.pool_fraction}, expected in (0, 1)")
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=7, std=0.15).eval()
    tokens_at_most = args.context_chars + args.turns * (args.obs_chars + args.max_new_tokens + 4) + 16
    per_traj = Engine(model, EngineConfig(pool_mb=1, max_model_len=args.max_model_len)).cache.layout.mla_pages_for(
        tokens_at_most) * 2 + 4
    unlimited_pages = args.groups * args.group_size * per_traj * 2
    calib = run(args, model, unlimited_pages, 0)
    pages = max(per_traj * 2, int(calib["peak"] * args.pool_fraction))
    print(f"{args.groups} x {args.group_size} trajectories, {args.turns} turns, tools log-normal median "
          f"{args.latency_s:g} s sigma {args.sigma:g}; unlimited pool {unlimited_pages} pages (peak {calib['peak']}), "
          f"short pool {pages} pages", flush=True)
    kinds = {"unlimited": (unlimited_pages, 0), "tier": (pages, unlimited_pages), "recompute": (pages, 0)}
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for name, (dev, host) in kinds.items():
            runs[name].append(run(args, model, dev, host))
    top = {name: max(r, key=lambda x: x["tok_s"]) for name, r in runs.items()}
    for name, r in top.items():
        m = r["metrics"]
        print(f"{name:10s} {r['wall_s']:6.2f} s wall, {r['engine_s']:6.2f} s engine, {r['tok_s']:6.1f} tok/s; written back "
              f"{m.get('host_pages_written_back', 0):.0f}, prefetched {m.get('host_pages_prefetched', 0):.0f} "
              f"(ahead {m.get('host_pages_prefetched_ahead', 0):.0f}), host hits {m.get('host_hit_tokens', 0):.0f} tokens, "
              f"re-prefilled {m.get('reprefilled_tokens', 0):.0f} tokens, admissions deferred "
              f"{m.get('admissions_deferred', 0):.0f}, hidden {m.get('prefetch_hidden_fraction', float('nan')):.2f}",
              flush=True)
    same = int(len({tuple(r["trajs"]) for r in top.values()}) == 1 and bool(top["tier"]["trajs"]))
    tm = top["tier"]["metrics"]
    out = {"tier_vs_unlimited_pool": top["tier"]["tok_s"] / top["unlimited"]["tok_s"],
           "tier_vs_recompute": top["tier"]["tok_s"] / top["recompute"]["tok_s"],
           "prefetch_hidden_fraction": tm.get("prefetch_hidden_fraction", 0.0),
           "prefetched_pages": tm.get("host_pages_prefetched", 0.0), "same_tokens": same,
           "reprefilled_tokens_tier": tm.get("reprefilled_tokens", 0.0),
           "reprefilled_tokens_recompute": top["recompute"]["metrics"].get("reprefilled_tokens", 0.0),
           "host_hit_tokens": tm.get("host_hit_tokens", 0.0), "pool_pages": pages, "peak_pages": calib["peak"]}
    print(" ".join(f"{k}={v:.4g}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
