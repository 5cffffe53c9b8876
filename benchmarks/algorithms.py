"""The algorithm menu on one task: every preset of configs/algo trains the main job (`make run`'s
settings: key_lookup, the tiny model, its warm-up, 150 iterations, the same seeds), one after another.

    python -m benchmarks.algorithms [--quick] [--presets grpo,ppo] [--iterations N] [--plot PATH]

Each preset runs as `python -m rl.train algo=<preset> ...` in its own process (nothing shared, the same
seeds), alone on the host. Per run: the final reward (mean of the last 15 iterations, as summary.json),
the first iteration at which the reward's mean over a 5-iteration window reaches 0.8, and the seconds
per iteration (the sum of the iterations' phases in phases.jsonl over their number: the warm-up and
the process start are left out), divided by grpo's. DAPO's dynamic sampling needs an open rollout
budget (rollout.budget_tokens / max_groups_in_flight null) and its overlong shaping a buffer below a
normal answer's length, so it runs with rollout.max_new_tokens=3 and overlong.buffer_tokens=1 (a
2-token answer, the digit and its eos, is not punished; 3 tokens gets -1). `--plot` writes every
run's reward curve in one figure (docs/algorithms_rewards.png by default on a full run).
Final line: per preset `<preset>_final_reward <preset>_iters_to_0.8 <preset>_s_per_iter_vs_grpo`
(grpo's ratio is 1), then `mismatch_k3` (the k3 KL between the engine's and the trainer's logprobs
of the sampled tokens at grpo's last iteration) and `grpo_s_per_iter`. `iters_to_0.8` is `never`
when the window never got there.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import parse_args

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["grpo", "rloo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo", "dapo", "gspo", "cispo"]
EXTRA = {"dapo": ["rollout.budget_tokens=null", "rollout.max_groups_in_flight=null", "rollout.max_new_tokens=3",
                  "algo.overlong.buffer_tokens=1"]}
"""What a preset needs beyond `algo=<preset>` on make run's settings (the module docstring says why)."""
WINDOW, TARGET, TAIL = 5, 0.8, 15


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def iters_to(rewards: list[float], target: float, window: int) -> int | None:
    """The first iteration i whose window [i - window + 1, i] has a mean reward >= `target` (the
    window shrinks at the start); None if none does."""
    for i in range(len(rewards)):
        part = rewards[max(0, i - window + 1):i + 1]
        if sum(part) / len(part) >= target:
            return i
    return None


def run_preset(preset: str, run_dir: Path, args: argparse.Namespace) -> dict:
    """Train `preset` into `run_dir`; its reward curve and figures."""
    overrides = [f"run_dir={run_dir}", f"algo={preset}", f"experiment.iterations={args.iterations}",
                 "tracking.wandb_mode=disabled", "tracking.progress=false", "tracking.plots=false",
                 *EXTRA.get(preset, []), *args.override]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rl.train", *overrides], cwd=ROOT, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"algo={preset} failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return read_run(preset, run_dir, wall_s)


def read_run(preset: str, run_dir: Path, wall_s: float = float("nan")) -> dict:
    """A finished run's reward curve and figures, from its metrics.jsonl and phases.jsonl."""
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("iteration", -1) >= 0]
    phases = [p for p in read_jsonl(run_dir / "phases.jsonl") if p.get("iteration", -1) >= 0]
    rewards = [m["reward_mean"] for m in metrics]
    tail = rewards[-TAIL:]
    figures = {"rewards": rewards, "final_reward": sum(tail) / len(tail), "iters_to": iters_to(rewards, TARGET, WINDOW),
               "s_per_iter": sum(p["seconds"] for p in phases) / len(metrics),
               "mismatch_k3": metrics[-1].get("mismatch/k3", float("nan")), "wall_s": wall_s,
               "rounds": sum(m.get("dynamic_sampling/rounds", 1.0) for m in metrics) / len(metrics),
               "sampled_tokens": sum(m["rollout_tokens"] for m in metrics) / len(metrics)}
    reached = "never" if figures["iters_to"] is None else figures["iters_to"]
    print(f"{preset:>22}: final reward {figures['final_reward']:.3f}, 0.8 at iteration {reached}, "
          f"{figures['s_per_iter']:.3f} s/iter, {figures['sampled_tokens']:.0f} tokens sampled per iteration "
          f"({figures['rounds']:.2f} sampling rounds), mismatch k3 {figures['mismatch_k3']:.2e}, {wall_s:.0f} s in all",
          flush=True)
    return figures


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for preset, r in results.items():  # the window's mean, as iters_to_0.8 reads it
        smooth = [sum(r["rewards"][max(0, i - WINDOW + 1):i + 1]) / len(r["rewards"][max(0, i - WINDOW + 1):i + 1])
                  for i in range(len(r["rewards"]))]
        ax.plot(range(len(smooth)), smooth, label=preset, linewidth=1.3,
                linestyle="--" if preset in ("grpo", "ppo", "dapo") else "-")
    ax.axhline(TARGET, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("iteration (after the warm-up)")
    ax.set_ylabel(f"train reward (mean over {WINDOW} iterations)")
    ax.set_title("key_lookup, make run's settings: each algorithm preset")
    ax.legend(ncol=3, fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated, from configs/algo (grpo first)")
    p.add_argument("--iterations", type=int, default=150)
    p.add_argument("--plot", default="docs/algorithms_rewards.png", help="'' for none")
    p.add_argument("--override", nargs="*", default=[], help="more Hydra overrides for every run")
    p.add_argument("--keep", default=None, help="keep the run directories under this path")
    p.add_argument("--from", dest="source", default=None,
                   help="read the runs kept under this path (--keep) instead of training: the figures again")
    args = parse_args(p, argv, {"iterations": 2, "plot": "", "override": [
        "warmup.steps=2", "warmup.eval_groups=1", "rollout.groups_per_iteration=2", "algo.group_size=4"]})
    presets = [s for s in args.presets.split(",") if s]
    unknown = [s for s in presets if not (ROOT / "configs" / "algo" / f"{s}.yaml").is_file()]
    if unknown or not presets or presets[0] != "grpo":
        raise SystemExit(f"--presets={args.presets!r}: expected grpo first, then names from configs/algo "
                         f"({', '.join(sorted(q.stem for q in (ROOT / 'configs' / 'algo').glob('*.yaml')))}); "
                         f"unknown: {unknown}")
    with tempfile.TemporaryDirectory(prefix="bench-algorithms-") as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        results = {s: read_run(s, Path(args.source) / s) if args.source else run_preset(s, base / s, args)
                   for s in presets}
    if args.plot:
        plot(results, ROOT / args.plot)
        print(f"reward curves: {args.plot}")
    grpo = results["grpo"]["s_per_iter"]
    line = []
    for s, r in results.items():
        reached = "never" if r["iters_to"] is None else str(r["iters_to"])
        line += [f"{s}_final_reward={r['final_reward']:.3f}", f"{s}_iters_to_0.8={reached}",
                 f"{s}_s_per_iter_vs_grpo={r['s_per_iter'] / grpo:.3f}"]
    line += [f"mismatch_k3={results['grpo']['mismatch_k3']:.3g}", f"grpo_s_per_iter={grpo:.3f}"]
    print(" ".join(line))


if __name__ == "__main__":
    main()
