"""The Python sections of the prepared GPU check (tools/gpu_check.sh; every figure: docs/gpu_check.md).

    python tools/gpu_check.py --device cuda --out OUT                   # every section, one process
    python tools/gpu_check.py --device cuda --out OUT --sections mla_decode,kda_chunk
    python tools/gpu_check.py --device cpu --small --out OUT            # CPU-runnable parts (CI test)
    python tools/gpu_check.py --summarize OUT/results.json              # the pass/fail lines
    python tools/gpu_check.py --list                                    # the sections

Each section writes its figures to OUT/results.json as it measures them (the file is rewritten after
every figure), so a section killed by its time box still leaves what it had; its status then stays
"running". A section that cannot run here says why ("skipped: needs CUDA ..."); one that fails
records the error and the next section runs anyway. gpu_check.sh runs each section in its own
process (a CUDA fault poisons the process's context) under its own timeout.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (set before anything imports kernels/):
fp32 only (the interpreter's bf16 tl.dot is wrong) and small sizes; timings there mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages are importable
    sys.path.insert(0, str(ROOT))

ACCEPTANCE = (
    # (name, section, figure, minimum, what it compares)
    ("kda_chunk_vs_fla", "fla", "kda_chunk_vs_fla_bf16_B1_T8192", 0.9,
     "fla chunk_kda time / our chunk_kda time, forward, B=1 T=8192 H=32 K=V=128 bf16"),
    ("mla_decode_hbm", "mla_decode", "hbm_fraction_bf16_B64_ctx8192", 0.70,
     "paged MLA decode bytes/s / 4.8 TB/s, B=64 x 8192-token contexts, bf16 cache"),
    ("rl_run_completes", "rl_run", "iterations_completed", 3,
     "RL iterations completed of 3 (experiment.device=cuda, bf16, streamed reference, spill)"),
)
ERROR_LIMITS = {"fp32": 1e-4, "bf16": 2e-2}
"""Largest relative error (Frobenius norm) of a kernel vs its torch reference that CHECK lines pass."""
MAX_VARIANTS = 2
"""Most specializations (compiled variants less the extra autotune configs) one kernel may have after
the T sweep of compile_stats for its CHECK line to pass."""


class Record(dict):
    """One section's figures; every assignment rewrites the results file (evidence survives a kill)."""

    def __init__(self, results: Results, name: str):
        super().__init__()
        self._results, self._name = results, name

    def __setitem__(self, key: str, value) -> None:
        super().__setitem__(key, value)
        self._results.flush()


class Results:
    """OUT/results.json: {"meta": {...}, "steps": {name: {...}}, "sections": {name: {status, reason,
    wall_s, figures}}}. Loaded if present, so sections run by separate processes add up in one file."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {"meta": {}, "steps": {}, "sections": {}}
        self.data.setdefault("steps", {})
        self.data.setdefault("sections", {})
        self.data.setdefault("meta", {})

    def start(self, name: str) -> Record:
        figures = Record(self, name)
        self.data["sections"][name] = {"status": "running", "reason": "", "wall_s": None, "figures": figures}
        self.flush()
        return figures

    def finish(self, name: str, status: str, reason: str, wall_s: float) -> None:
        self.data["sections"][name].update(status=status, reason=reason, wall_s=round(wall_s, 2))
        self.flush()

    def flush(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)  # atomic: a kill never leaves half a file


def sections() -> dict[str, Callable]:
    """Section name -> function(ctx, figures), in the order gpu_check.sh runs them."""
    from tools import check_baselines, check_kernels, check_system

    out = {"env": check_system.env}
    out.update(check_kernels.SECTIONS)
    out.update(check_baselines.SECTIONS)
    out.update(check_system.SECTIONS)
    return out


def run_sections(names: list[str], ctx, results: Results) -> int:
    """Runs each section, recording ok / skipped / error; returns the number that failed."""
    from tools.check_common import Skip

    table, failed = sections(), 0
    for name in names:
        figures = results.start(name)
        t0 = time.perf_counter()
        status, reason = "ok", ""
        try:
            table[name](ctx, figures)
        except Skip as why:
            status, reason = "skipped", str(why)
        except Exception as err:  # noqa: BLE001 - one failing section must not hide the others
            status, reason = "error", f"{type(err).__name__}: {err}"[:400]
            figures["traceback"] = traceback.format_exc(limit=6)[-2000:]
            failed += 1
        wall_s = time.perf_counter() - t0
        results.finish(name, status, reason, wall_s)
        print(f"[{name}] {status}{': ' + reason if reason else ''} ({wall_s:.1f} s)", flush=True)
        for key, value in figures.items():
            if key != "traceback":
                print(f"  {key} = {value}", flush=True)
    return failed


def _figure(results: dict, section: str, key: str):
    """(value, None) or (None, why it is missing)."""
    entry = results.get("sections", {}).get(section)
    if entry is None:
        return None, f"section {section} did not run"
    value = entry.get("figures", {}).get(key)
    if value is None:
        state = entry.get("status")
        reason = entry.get("reason") or ("killed (time box?)" if state == "running" else "figure not measured")
        return None, f"section {section} {state}: {reason}"
    return value, None


def summarize(results: dict) -> list[str]:
    """The pass/fail lines: acceptance targets, then kernel errors and compile variants (CHECK), then
    the sections that failed or were killed and every shell step's exit code."""
    meta = results.get("meta", {})
    shown = ("gpu", "torch", "torch_cuda", "triton", "small")
    lines = ["RUN " + " ".join(f"{k}={meta[k]}" for k in shown if k in meta)]
    for name, section, key, minimum, what in ACCEPTANCE:
        value, why = _figure(results, section, key)
        if why is not None or not isinstance(value, (int, float)):
            lines.append(f"UNKNOWN  {name}: {why or value}  [{what}]")
        else:
            verdict = "PASS" if value >= minimum else "FAIL"
            lines.append(f"{verdict}     {name}: {value:.3g} (need >= {minimum})  [{what}]")
    for section, entry in results.get("sections", {}).items():
        for key, value in entry.get("figures", {}).items():
            kind = next((t for t in ERROR_LIMITS if key.startswith("err_") and f"_{t}" in key), None)
            if kind is not None and isinstance(value, (int, float)):
                limit = ERROR_LIMITS[kind]
                lines.append(f"CHECK {'PASS' if value <= limit else 'FAIL'} {section}.{key} = {value:.2e} "
                             f"(<= {limit:g})")
            if key.startswith("specializations_") and isinstance(value, int):
                lines.append(f"CHECK {'PASS' if value <= MAX_VARIANTS else 'FAIL'} {section}.{key} = {value} "
                             f"(<= {MAX_VARIANTS} over the T sweep)")
    for section, entry in results.get("sections", {}).items():
        if entry.get("status") in ("error", "running"):
            state = "killed (time box?)" if entry["status"] == "running" else entry.get("reason", "")
            lines.append(f"SECTION {section}: {entry['status']}: {state}")
    for step, entry in results.get("steps", {}).items():
        lines.append(f"STEP {step}: rc={entry.get('rc')} wall_s={entry.get('wall_s')} {entry.get('note', '')}".rstrip())
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: native Triton (fails without a GPU); cpu: the interpreter, fp32; auto: cuda if any")
    p.add_argument("--small", action="store_true", help="small shapes (a smoke run; the CPU test uses it)")
    p.add_argument("--out", type=Path, default=None, help="evidence folder (results.json and the rl_* files); "
                   "default $OUT, else ./gpu_check_out")
    p.add_argument("--sections", default="all", help="comma-separated section names (see --list), or 'all'")
    p.add_argument("--list", action="store_true", help="print the sections and exit")
    p.add_argument("--summarize", type=Path, metavar="RESULTS_JSON",
                   help="print the pass/fail lines of a results.json and exit")
    p.add_argument("--record-step", nargs=4, metavar=("RESULTS_JSON", "NAME", "RC", "WALL_S"),
                   help="record a shell step's exit code and seconds in results.json (gpu_check.sh)")
    p.add_argument("--note", default="", help="with --record-step: a short note")
    return p.parse_args(argv)


def _select(spec: str) -> list[str]:
    table = sections()
    if spec == "all":
        return list(table)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"error: unknown section(s) {unknown}; expected some of {list(table)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, fn in sections().items():
            print(f"{name:16s} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return 0
    if args.summarize is not None:
        if not args.summarize.exists():
            print(f"no {args.summarize}: no section ran")
            return 1
        print("\n".join(summarize(json.loads(args.summarize.read_text()))))
        return 0
    if args.record_step is not None:
        path, name, rc, wall_s = args.record_step
        results = Results(Path(path))
        results.data["steps"][name] = {"rc": int(rc), "wall_s": float(wall_s), "note": args.note}
        results.flush()
        return 0
    names = _select(args.sections)  # before any CUDA work: a typo fails fast
    from tools.check_common import Ctx

    ctx = Ctx.make(args.device, args.small, args.out or Path(os.environ.get("OUT") or "gpu_check_out"))
    results = Results(ctx.out / "results.json")
    results.data["meta"].update(ctx.describe())
    results.flush()
    failed = run_sections(names, ctx, results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
