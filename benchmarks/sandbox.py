"""Sandbox call cost: bubblewrap workers (backend bwrap) vs plain processes (backend none: the same warm pool
and runner with no OS isolation, which is how the sandbox ran before bubblewrap, less its namespace set-up
at worker start), in the same run.

    python -m benchmarks.sandbox [--quick] [--calls 40] [--workers 4] [--threads 8] [--baseline-tree DIR]

Each backend runs the agentic task's tool call (`37*8`, printed: rl/envs/tools/python_exec.py) three ways:
paced (the pool refilled before each call, as when tool calls are spread over a rollout: the caller's wait),
back to back from one thread (refills race the calls; some start cold), and `--threads` threads at once.
`--baseline-tree DIR` also measures the `Sandbox` of another checkout (e.g. a `git worktree` of an older
commit), imported from DIR. It also times how the limits end bad code, scored by `task=code_reward` in
bubblewrap: an endless loop against the run's wall limit (2 s), and 4 tests of which 2 hang against 2 x the
per-test limit (0.5 s each; the run's wall limit would be 2 s). Final line:
sandbox_call_ratio=... back_to_back_ratio=... concurrent_ratio=... endless_loop_vs_wall_limit=...
hanging_tests_vs_test_limits=... sandbox_call_ms=... process_call_ms=... back_to_back_ms=...
concurrent_calls_s=... cold_start_ms=... endless_loop_s=... hanging_tests_s=...
[tree_call_ms=... call_ratio_vs_tree=...]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks import parse_args
from rl.envs.tasks.base import make_task
from rl.envs.tools.python_exec import close_sandboxes, with_printed_value
from rl.envs.tools.sandbox import Sandbox, SandboxConfig

CODE = with_printed_value("37*8")


def measure(make, calls: int, threads: int) -> dict[str, float]:
    """Per-call milliseconds (paced, back to back), calls/s from `threads` threads, one cold start's ms."""
    with make() as box:
        box.wait_warm(60.0)
        paced = []
        for _ in range(calls):
            box.wait_warm(60.0)
            t0 = time.perf_counter()
            result = box.run(CODE)
            paced.append(time.perf_counter() - t0)
            assert result.ok and result.stdout == "296\n", result
        box.wait_warm(60.0)
        t0 = time.perf_counter()
        for _ in range(calls):
            assert box.run(CODE).ok
        back = (time.perf_counter() - t0) / calls
        box.wait_warm(60.0)
        per_thread = max(1, calls // threads)
        t0 = time.perf_counter()
        pool = [threading.Thread(target=lambda: [box.run(CODE) for _ in range(per_thread)]) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        concurrent = per_thread * threads / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        cold = box._start_worker()
        cold_s = time.perf_counter() - t0
        box._discard(cold)
    return {"call_ms": 1e3 * statistics.median(paced), "back_ms": 1e3 * back, "calls_s": concurrent,
            "cold_ms": 1e3 * cold_s}


LIMITS = dict(wall_time_s=2.0, test_time_s=0.5, memory_mb=256, max_output_bytes=4096, workers=2)
ADD1 = "def add1(x):\n    return x + 1\n"
HANGING = ["assert add1(1) == 2", "while True: pass", "assert add1(2) == 3", "assert slow()"]
SLOW = "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef slow():\n    time.sleep(5)\n    return True\n"


def limit_seconds() -> dict[str, float]:
    """Seconds `task=code_reward` takes to score an endless loop, and 4 tests of which 2 hang (each checked)."""
    def timed(answer: str, label: list[str]) -> tuple[float, object]:
        env = make_task("code_reward", partial_credit=1.0, **LIMITS)
        env.reset(0, row={"prompt": "p", "label": label})
        t0 = time.perf_counter()
        out = env.step(answer)
        return time.perf_counter() - t0, out

    timed(ADD1, ["assert add1(1) == 2"])  # the pool warm
    loop_s, loop = timed(ADD1 + "while True:\n    pass\n", ["assert add1(1) == 2"])
    assert loop.components["timeout"] == 1.0 and loop.reward == 0.0, loop
    hang_s, hang = timed(ADD1 + SLOW, HANGING)
    assert hang.components["tests_timed_out_frac"] == 0.5 and hang.reward == 0.5, hang
    close_sandboxes()
    return {"endless_loop_s": loop_s, "hanging_tests_s": hang_s}


def tree_sandbox(tree: str):
    """The Sandbox and SandboxConfig classes of the checkout at `tree` (its rl/envs/tools/sandbox.py)."""
    path = Path(tree) / "rl" / "envs" / "tools" / "sandbox.py"
    sys.path.insert(0, str(Path(tree)))
    spec = importlib.util.spec_from_file_location("tree_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.path.pop(0)
    return module.Sandbox, module.SandboxConfig


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--baseline-tree", default=None)
    args = parse_args(p, argv, {"calls": 8, "threads": 4})
    limits = dict(wall_time_s=5.0, cpu_time_s=5.0, workers=args.workers)
    ours = measure(lambda: Sandbox(SandboxConfig(backend="bwrap", **limits)), args.calls, args.threads)
    plain = measure(lambda: Sandbox(SandboxConfig(backend="none", **limits)), args.calls, args.threads)
    ended = limit_seconds()
    figures = {"sandbox_call_ratio": ours["call_ms"] / plain["call_ms"],
               "back_to_back_ratio": ours["back_ms"] / plain["back_ms"],
               "concurrent_ratio": ours["calls_s"] / plain["calls_s"],
               "endless_loop_vs_wall_limit": ended["endless_loop_s"] / LIMITS["wall_time_s"],
               "hanging_tests_vs_test_limits": ended["hanging_tests_s"] / (2 * LIMITS["test_time_s"]),
               "sandbox_call_ms": ours["call_ms"], "process_call_ms": plain["call_ms"], "back_to_back_ms": ours["back_ms"],
               "concurrent_calls_s": ours["calls_s"], "cold_start_ms": ours["cold_ms"], **ended}
    if args.baseline_tree:
        tree_box, tree_config = tree_sandbox(args.baseline_tree)
        tree = measure(lambda: tree_box(tree_config(**limits)), args.calls, args.threads)
        figures |= {"tree_call_ms": tree["call_ms"], "call_ratio_vs_tree": ours["call_ms"] / tree["call_ms"],
                    "tree_back_to_back_ms": tree["back_ms"], "tree_concurrent_calls_s": tree["calls_s"]}
    for name, m in (("bwrap", ours), ("none", plain)):
        print(f"{name}: paced {m['call_ms']:.1f} ms/call, back to back {m['back_ms']:.1f} ms/call, "
              f"{m['calls_s']:.0f} calls/s from {args.threads} threads, cold start {m['cold_ms']:.1f} ms")
    print(f"code_reward limits: an endless loop ended in {ended['endless_loop_s']:.2f} s (wall limit "
          f"{LIMITS['wall_time_s']:.1f} s), 2 hanging tests of 4 in {ended['hanging_tests_s']:.2f} s "
          f"({LIMITS['test_time_s']:.1f} s each)")
    print(" ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    return figures


if __name__ == "__main__":
    main()
