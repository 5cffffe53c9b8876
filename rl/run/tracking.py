"""Tracking and feedback for the RL loop: metric files, wandb, progress bars, end-of-run plots.

Owns everything a run writes to `run_dir` for humans to read:

- `metrics.jsonl` — one JSON object per line, `{"iteration": int, <metric>: number, ...}`, one line
  per `Tracker.log` call.
- `phases.jsonl` — the memory timeline, one line per `Tracker.log_phase` call:
  `{"iteration", "phase", "seconds", "bytes_moved", "memory": {<pool name>: bytes, ...}}`;
  `memory` is what each pool held during the phase (bytes; drawn across the phase's span), its
  keys are whatever the caller passes.
- `wandb_id.txt` — the wandb run id, so a resumed run continues the same wandb run.
- `reward.png`, `memory.png`, `mechanisms.png`, `summary.json` — written by `Tracker.finish`.

In a multi-rank run only the writer (rank 0) has an enabled Tracker; the others are built with
`writer=False` and write, print and import nothing (the loop hands rank 0 the global figures).

Invariants: every appended line is flushed and fsynced before `log` returns, so `kill -9` loses at
most the line being written; `read_jsonl` skips such a truncated last line. On resume after
iteration N both .jsonl files are rewritten atomically (tmp + os.replace) keeping only records
with iteration <= N, which also drops a truncated tail; a new run (no checkpoint to resume) keeps none. wandb is imported only when enabled.
"""
from __future__ import annotations

import json
import numbers
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from memory.durable import temp_path, write_durable

WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    wandb_mode: str | None = None
    """"offline" (files under run_dir, sync later), "online", or "disabled" (wandb never imported); null =
    the WANDB_MODE environment variable when set (wandb's own "dryrun" = offline, "run" = online), else offline."""
    project: str = "hybridrl"
    """wandb project name."""
    run_name: str | None = None
    """wandb display name; None lets wandb pick one."""
    progress: bool = True
    """Show rich progress bars for rollout and training."""
    plots: bool = True
    """Write reward.png and memory.png in `finish`."""

    def __post_init__(self) -> None:
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"TrackingConfig.wandb_mode={self.wandb_mode!r}; allowed: {', '.join(WANDB_MODES)} or null")
        self.mode  # a bad WANDB_MODE is named now

    @property
    def mode(self) -> str:
        """The wandb mode the run uses (`wandb_mode`, else WANDB_MODE, else offline)."""
        if self.wandb_mode is not None:
            return self.wandb_mode
        env = os.environ.get("WANDB_MODE", "").strip().lower()
        mode = {"": "offline", "dryrun": "offline", "run": "online"}.get(env, env)
        if mode not in WANDB_MODES:
            raise ValueError(f"WANDB_MODE={env!r} (tracking.wandb_mode=null reads it); allowed: "
                             f"{', '.join(WANDB_MODES)}, dryrun, run")
        return mode


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a .jsonl file ([] if missing). A last line that does not parse is the
    write a kill interrupted and is skipped; a bad line anywhere else raises ValueError."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: corrupt record on non-blank line {i + 1}: {e}") from e
    return records


def _check_number(name: str, value: Any) -> int | float:
    """The value as a JSON-ready int/float; bools, strings, tensors etc. raise TypeError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"metric {name!r} must be a real number, got {type(value).__name__} {value!r}"
                        " (call .item() on tensors)")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _append_line(path: Path, record: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _rewrite(path: Path, records: list[dict]) -> None:
    tmp = temp_path(path)
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Tracker:
    """Writes one run's metrics and memory timeline (see module docstring for the files)."""

    def __init__(self, run_dir: str | Path, config: TrackingConfig, run_config: dict,
                 resume_from_iteration: int | None = None, writer: bool = True):
        """writer=False (ranks other than 0): every method is a no-op, the console is quiet."""
        self.run_dir = Path(run_dir)
        self.config = config
        self.writer = writer
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.phases_path = self.run_dir / "phases.jsonl"
        self.console = Console(quiet=not writer)
        self._wandb_run = None
        self._probes: list[Callable[[], dict[str, float]]] = []
        if not writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Existing files are always rewritten (drops a truncated tail); on resume, also the records
        # of iterations after the last complete one, which the resumed run will log again; a new run
        # keeps none (a start killed before its first checkpoint left some: they are logged again).
        for path in (self.metrics_path, self.phases_path):
            if path.exists():
                last = -1 if resume_from_iteration is None else resume_from_iteration
                _rewrite(path, [r for r in read_jsonl(path) if r["iteration"] <= last])
        if config.mode != "disabled":
            import wandb

            id_path = self.run_dir / "wandb_id.txt"
            if not id_path.exists():
                write_durable(id_path, (uuid.uuid4().hex[:16] + "\n").encode())
            self._wandb_run = wandb.init(project=config.project, name=config.run_name, dir=str(self.run_dir),
                                         mode=config.mode, config=run_config,
                                         id=id_path.read_text(encoding="utf-8").strip(), resume="allow")

    def add_probe(self, probe: Callable[[], dict[str, float]]) -> None:
        """Have every later `log` line carry `probe()`'s figures too (read as the line is logged;
        this rank's component figures, such as the reference stream's seconds of the iteration)."""
        self._probes.append(probe)

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        """Append `{"iteration": iteration, **metrics, **probes}` to metrics.jsonl (durable on
        return) and send it to wandb at step=iteration. Non-numeric values raise TypeError, nothing
        written."""
        metrics = {**metrics, **{k: v for probe in self._probes for k, v in probe().items()}}
        clean = {name: _check_number(name, value) for name, value in metrics.items()}
        if not self.writer:
            return
        _append_line(self.metrics_path, {"iteration": int(iteration), **clean})
        if self._wandb_run is not None:
            self._wandb_run.log(clean, step=int(iteration))

    def run_started(self, start: int, iterations: int) -> None:
        """The loop starts at iteration `start` of `iterations`: the clock of `run_progress`."""
        self._run_clock = (time.monotonic(), start, iterations)

    def run_progress(self, iteration: int) -> str:
        """The run-level progress after iteration `iteration`: "[done/total, s/it, time left]" (the rate
        of this start's iterations; a resume's earlier ones are not timed)."""
        t0, start, total = getattr(self, "_run_clock", (time.monotonic(), iteration, iteration + 1))
        done = iteration + 1 - start
        rate = (time.monotonic() - t0) / max(done, 1)
        left = rate * (total - iteration - 1)
        return f"[{iteration + 1}/{total} {rate:.1f}s/it {int(left) // 60}m{int(left) % 60:02d}s left]"

    def log_wandb(self, iteration: int, metrics: dict[str, float]) -> None:
        """Send figures to wandb only (at step=iteration), not to metrics.jsonl: the final validation."""
        if self.writer and self._wandb_run is not None:
            self._wandb_run.log({name: _check_number(name, value) for name, value in metrics.items()}, step=int(iteration))

    def log_phase(self, iteration: int, phase: str, seconds: float, bytes_moved: int,
                  memory: dict[str, int]) -> None:
        """Append one memory-timeline record to phases.jsonl (durable on return)."""
        if not self.writer:
            return
        _append_line(self.phases_path, {
            "iteration": int(iteration), "phase": str(phase),
            "seconds": _check_number("seconds", seconds), "bytes_moved": _check_number("bytes_moved", bytes_moved),
            "memory": {name: _check_number(name, value) for name, value in memory.items()},
        })

    def rollout_progress(self, total: int) -> RolloutProgress:
        return RolloutProgress(total, self.console, enabled=self.config.progress and self.writer)

    def train_progress(self, total_steps: int) -> TrainProgress:
        return TrainProgress(total_steps, self.console, enabled=self.config.progress and self.writer)

    def finish(self, summary: dict[str, float], warmup: dict | None = None, ceiling: float | None = None) -> None:
        """Write the plots (those with data, if enabled) and summary.json, print the summary
        table, and finish the wandb run. `warmup`: the supervised warm-up's record (rl/run/warmup.py),
        drawn before the RL iterations on the reward plot; `ceiling`: the best reward a constant
        answer can score (the task's), drawn as a line on it."""
        clean = {name: _check_number(name, value) for name, value in summary.items()}
        if not self.writer:
            return
        if self.config.plots:
            metrics, phases = read_jsonl(self.metrics_path), read_jsonl(self.phases_path)
            final = (int(summary["final_val/iteration"]), summary["final_val/reward_mean"]) if (
                "final_val/reward_mean" in summary and "final_val/iteration" in summary) else None
            _plot_reward(metrics, self.run_dir / "reward.png", warmup, ceiling, final)
            plot_memory(phases, self.run_dir / "memory.png")
            plot_mechanisms(metrics, phases, self.run_dir / "mechanisms.png")
        write_durable(self.run_dir / "summary.json", (json.dumps(clean, indent=2) + "\n").encode())
        table = Table(title="run summary")
        table.add_column("key")
        table.add_column("value", justify="right")
        for name, value in clean.items():
            table.add_row(name, f"{value:.4g}")
        self.console.print(table)
        if self._wandb_run is not None:
            self._wandb_run.summary.update(clean)
            self._wandb_run.finish()
            self._wandb_run = None


class _Bar:
    """A rich Progress with one task; a context manager. In a terminal the bar is cleared when the
    phase ends (the loop prints periodic one-line summaries); in a log its final state is printed
    once. Disabled bars print nothing."""

    def __init__(self, description: str, total: int, console: Console, enabled: bool, *columns, **fields):
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *columns,
                                  TimeElapsedColumn(), console=console, disable=not enabled,
                                  transient=console.is_terminal)
        self._task = self._progress.add_task(description, total=total, **fields)

    def __enter__(self):
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()


class RolloutProgress(_Bar):
    """Trajectories done/total, generation throughput, KV-cache utilisation and concurrency."""

    def __init__(self, total: int, console: Console, enabled: bool = True):
        super().__init__("rollout", total, console, enabled,
                         TextColumn("{task.fields[tokens_per_s]:.0f} tok/s"),
                         TextColumn("KV {task.fields[kv_pct]:.0f}%"),
                         TextColumn("conc {task.fields[concurrency]}"),
                         tokens_per_s=0.0, kv_pct=0.0, concurrency=0)
        self._start_s = time.monotonic()

    def __enter__(self) -> RolloutProgress:
        self._start_s = time.monotonic()
        return super().__enter__()

    def update(self, done: int, tokens: int, kv_utilization: float, concurrency: int) -> None:
        """`done`: trajectories finished so far; `tokens`: tokens generated so far (cumulative,
        tok/s is tokens / time since enter); `kv_utilization`: used fraction of the KV pool in [0, 1]."""
        elapsed_s = max(time.monotonic() - self._start_s, 1e-9)
        self._progress.update(self._task, completed=done, tokens_per_s=tokens / elapsed_s,
                              kv_pct=100.0 * kv_utilization, concurrency=concurrency)


class TrainProgress(_Bar):
    """Optimizer steps done/total and the last loss."""

    def __init__(self, total_steps: int, console: Console, enabled: bool = True):
        super().__init__("train", total_steps, console, enabled, TextColumn("loss {task.fields[loss]}"), loss="-")

    def advance(self, loss: float) -> None:
        self._progress.update(self._task, advance=1, loss=f"{loss:.4g}")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede the pyplot import
    import matplotlib.pyplot as plt

    return plt


_REWARD_LABELS = {"reward_mean": "train reward (mean)", "reward_correct_frac": "train correct (fraction)",
                  "val/reward_mean": "validation reward (mean)"}


def _plot_reward(records: list[dict], path: Path, warmup: dict | None = None, ceiling: float | None = None,
                 final_val: tuple[int, float] | None = None) -> None:
    """reward_mean (and reward_correct_frac if logged) against iteration; skipped without data.
    With a warm-up record: its steps drawn left of iteration 0 (shaded, one step per unit, their
    demonstration loss on a second axis), the reward measured before and after it as two points,
    the level after it dashed across the RL iterations (what RL added is above that line). With a
    `ceiling`: the best constant answer's reward, dotted. The validation reward (each evaluation, and
    `final_val` = (iteration, reward) of the weights after the last update) joins them when logged."""
    keys = [k for k in ("reward_mean", "reward_correct_frac", "val/reward_mean") if any(k in r for r in records)]
    if "reward_mean" not in keys:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key in keys:
        points = [(r["iteration"], r[key]) for r in records if key in r] + (
            [(final_val[0], final_val[1])] if key == "val/reward_mean" and final_val is not None else [])
        style = dict(marker="o", markersize=4, linewidth=1.2) if key.startswith("val/") else dict(
            marker=".", markersize=3, linewidth=0.8)
        ax.plot([x for x, _ in points], [y for _, y in points], label=_REWARD_LABELS[key], **style)
    if final_val is not None and "val/reward_mean" not in keys:
        ax.plot([final_val[0]], [final_val[1]], marker="o", markersize=4, linestyle="", label=_REWARD_LABELS["val/reward_mean"])
    ax.set_title("reward per iteration (mean over the iteration's trajectories; validation on held-out episodes)",
                 fontsize="medium")
    twin = _draw_warmup(ax, warmup, last=max(r["iteration"] for r in records)) if warmup is not None else None
    if ceiling is not None:
        ax.axhline(ceiling, color="grey", linestyle=":", linewidth=1.0, label=f"best constant answer ({ceiling:.3f})")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("warm-up step - steps | RL iteration" if warmup is not None else "iteration")
    ax.set_ylabel("reward (the task's units; correct: fraction of trajectories)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize="small", loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_memory(records: list[dict], path: Path, last_iterations: int = 3) -> None:
    """What each memory consumer holds through the phases of the last `last_iterations` iterations:
    one step line per memory key, one equal-width slot per phase (durations differ by 1000x; each
    slot's label gives the phase and its seconds). Keys named by tier (`device_*`, `host_*`,
    `disk_*`: rl/run/loop.py `Phases.memory`) get one panel per tier, their `*_total` dashed;
    the older `train_*` aliases are then left out; any other key goes to a last panel. Keys at 0 in
    every phase are left out, and with them a tier that holds nothing (no empty panel)."""
    if not records:
        return
    kept = sorted({r["iteration"] for r in records})[-last_iterations:]
    records = [r for r in records if r["iteration"] in kept]
    plt = _pyplot()
    keys = [k for k in dict.fromkeys(k for r in records for k in r["memory"])
            if any(r["memory"].get(k, 0) for r in records)]  # a key at 0 throughout would draw an empty panel
    if not keys:
        return
    tiers = [t for t in ("device", "host", "disk") if any(k.startswith(f"{t}_") and k != "device_pool"
                                                          and k != "host_pool" for k in keys)]
    panels: dict[str, list[str]] = {t: [k for k in keys if k.startswith(f"{t}_")] for t in tiers}
    legacy = ("train_device", "train_host", "train_disk") if tiers else ()
    rest = [k for k in keys if not any(k in ks for ks in panels.values()) and k not in legacy]
    if rest:
        panels["memory" if not tiers else "other"] = rest
    peak = max((v for r in records for v in r["memory"].values()), default=0)
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(max(8, 0.55 * len(records) + 3), 1.2 + 2.6 * len(panels)))
    x = list(range(len(records) + 1))
    for ax, (title, panel_keys) in zip(axes[:, 0], panels.items()):
        for key in panel_keys:
            values = [r["memory"].get(key, float("nan")) / scale for r in records]
            ax.step(x, values + values[-1:], where="post", label=key,
                    linestyle="--" if key.endswith("_total") else "-")
        for i, r in enumerate(records):
            if i == 0 or r["iteration"] != records[i - 1]["iteration"]:
                ax.axvline(i, color="grey", alpha=0.4, linewidth=0.8)
        ax.set_ylabel(f"{title}, {unit}" if len(panels) > 1 else unit)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax = axes[-1, 0]
    ax.set_xticks([i + 0.5 for i in range(len(records))])
    ax.set_xticklabels([f"{r['iteration']}:{r['phase']} {r['seconds']:.2g}s" for r in records],
                       rotation=60, ha="right", fontsize="x-small")
    axes[0, 0].set_title(f"memory by phase, iterations {kept[0]}-{kept[-1]}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _draw_warmup(ax, warmup: dict, last: int):
    """The warm-up on the reward axes `ax`: its steps at x = step - steps (shaded), their loss on a
    twin axis (returned), the rewards before and after it, and the after level dashed up to `last`."""
    steps = len(warmup["steps"])
    ax.axvspan(-steps - 0.5, -0.5, color="tab:green", alpha=0.12, label=f"supervised warm-up ({steps} steps)")
    ax.axvline(-0.5, color="tab:green", linewidth=0.8)
    ax.plot([-steps, -0.5], [warmup["reward_before"], warmup["reward_after"]], "s", color="tab:red",
            label="reward measured before / after warm-up")
    ax.hlines(warmup["reward_after"], -0.5, last, colors="tab:red", linestyles="--", linewidth=0.8)
    loss = ax.twinx()
    loss.plot([s["step"] - steps for s in warmup["steps"]], [s["loss"] for s in warmup["steps"]],
              color="tab:green", linewidth=0.8, label="warm-up demonstration NLL (right)")
    loss.set_ylabel("demonstration NLL")
    loss.set_ylim(bottom=0)
    return loss


MECHANISM_PANELS = (
    ("prefix cache: hit fraction of KV tokens", ["prefix_hit_frac"], "metrics", 1),
    ("host KV pool, MiB", ["host_pool", "host_parked"], "phases", 2**20),
    ("on NVMe: optimizer states, host KV pool contents; MiB", ["disk_spilled", "disk_kv_pool"], "phases", 2**20),
    ("reference stream, s", ["ref_stream_s", "ref_stream_wait_s"], "metrics", 1),
    ("partial rollouts carried over", ["trajectories_carried"], "metrics", 1),
)
"""(title, keys, source, unit) of `plot_mechanisms`' panels: a metrics.jsonl key per iteration, or
a phases.jsonl memory key at its largest within the iteration."""


def plot_mechanisms(metrics: list[dict], phases: list[dict], path: Path) -> None:
    """One panel per memory mechanism the run used (MECHANISM_PANELS), against iteration: prefix hit
    fraction, host KV pool bytes (and its parked partial rollouts), bytes on NVMe (optimizer states,
    the host pool's contents between rollouts), the reference stream's seconds, trajectories
    carried over. Nothing is written when none has data."""
    series = []
    for title, keys, source, unit in MECHANISM_PANELS:
        lines = {}
        for key in keys:
            if source == "metrics":
                points = [(r["iteration"], r[key] / unit) for r in metrics if key in r]
            else:
                peak: dict[int, float] = {}
                for p in phases:
                    if key in p["memory"]:
                        peak[p["iteration"]] = max(peak.get(p["iteration"], 0.0), p["memory"][key] / unit)
                points = sorted(peak.items())
            if points and any(y for _, y in points):
                lines[key] = points
        if lines:
            series.append((title, lines))
    if not series:
        return
    plt = _pyplot()
    fig, axes = plt.subplots(len(series), 1, sharex=True, squeeze=False, figsize=(8, 1.2 + 1.7 * len(series)))
    for ax, (title, lines) in zip(axes[:, 0], series):
        for key, points in lines.items():
            ax.plot([x for x, _ in points], [y for _, y in points], linewidth=0.8, label=key)
        ax.set_title(title, fontsize="small", loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper right")
    axes[-1, 0].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
