"""The agentic example (rl/envs/tasks/tool_arith.py) and its python_exec tool (rl/envs/tools/python_exec.py): the
tool runs model-written code in the sandbox, the task needs it, and the preset's run keeps the
engine's tokens as the trainer's and reuses each first turn's KV for the second."""
import json
import os
import subprocess
import sys

import pytest

from rl.envs.tasks import make_task
from rl.envs.tools import bwrap
from rl.envs.tools.python_exec import run_python, shared_sandbox, with_printed_value
from rl.envs.tools.sandbox import SandboxConfig, SandboxUnavailable, set_default_backend
from rl.train import run
from tests.rl.test_config import composed


def test_the_last_expression_is_printed_and_the_code_runs_in_the_sandbox():
    assert with_printed_value("37*8") == "print(37 * 8)"
    assert with_printed_value("x = 3\nx + 1") == "x = 3\nprint(x + 1)"
    assert with_printed_value("print(1)\nx = 2") == "print(1)\nx = 2"  # ends with a statement: unchanged
    assert with_printed_value("1 +") == "1 +"  # does not parse: the sandbox reports the SyntaxError
    box = shared_sandbox(SandboxConfig(wall_time_s=2.0, cpu_time_s=2.0, workers=2))
    assert run_python(box, "37*8") == "296"
    assert run_python(box, "1 +").startswith("error: SyntaxError")
    assert run_python(box, "open('/etc/passwd').read()").startswith("error: PermissionError")
    assert run_python(box, "while True: pass") == "error: wall-time limit exceeded"
    assert run_python(box, "print('x' * 1000)", max_chars=10) == "x" * 10 + "..."


def test_the_task_needs_the_call_and_the_reading_of_its_output():
    env = make_task("tool_arith", workers=2)
    assert [t["function"]["name"] for t in env.tools.schemas()] == ["py"]
    for seed in range(3):
        call, answer = env.demonstration(seed)
        first = env.step(call)
        assert first.observation == f"={answer};" and first.role == "tool" and not first.done
        last = env.step(answer + "x")
        assert last.reward == 1.0 and last.is_correct and last.done
    env.reset(0)
    product = env.product
    assert env.step(f"[py:{env._a}*{env._b}]").observation == f"={product};"
    wrong_first = product[0] + ("0" if product[1] != "0" else "1") + product[2:]  # one leading digit right
    assert env.step(wrong_first).reward == pytest.approx(0.2 + 0.8 / len(product))
    env.reset(0)
    env.step("[py:1+1]")  # a call computing something else: its output is not the product
    assert env.step(product).reward == 1.0  # the answer alone counts when right
    env.reset(0)
    env.step("[py:1+1]")
    assert env.step("2").reward == 0.0
    for bad in ("no call", "[py:]", "[sh:ls]", "[py:1][py:2]"):
        env.reset(1)
        result = env.step(bad)
        assert result.done and result.reward == 0.0 and result.components == {"call_ok": 0.0}, bad
    env.reset(2)
    escape = env.step("[py:import socket; socket.socket()]")
    assert escape.observation.startswith("=error: Permissio") and not escape.done  # the sandbox said no


SMALL = ["warmup.steps=0", "experiment.iterations=1", "rollout.groups_per_iteration=2", "algo.group_size=4",
         "tracking.wandb_mode=disabled", "tracking.progress=false", "tracking.plots=false"]


def test_the_agentic_preset_runs_its_tools_on_workers(tmp_path):
    """From a random init (no warm-up here) few calls are well formed: the run's prefix hits across
    turns are in docs/agentic.md's figures of the full preset; tests/rl/test_env_async.py has them on workers."""
    cfg = composed("experiment=agentic", f"run_dir={tmp_path / 'run'}", *SMALL)
    assert cfg.env.workers > 0 and cfg.engine.prefix_cache is not None and cfg.task.name == "tool_arith"
    (h,) = run(cfg)  # the driver asserts, turn by turn, that the engine's prompts are the trainer's tokens
    assert h["env_calls"] >= 2 + 8 and h["trajectories_finished"] + h["trajectories_dropped"] == 8
    assert h["env_timeouts"] == 0 and h["env_busy_seconds"] > 0  # the tools ran on the workers, none timed out
    stored = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert stored["env_calls"] == h["env_calls"]


def test_a_sandboxed_task_refuses_to_start_without_bubblewrap_unless_backend_none(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a host without bwrap
    monkeypatch.setattr(bwrap, "_CHECKED", set())
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap.*sandbox.backend=none"):
            composed("experiment=agentic")
        assert composed("experiment=agentic", "sandbox.backend=none").sandbox.backend == "none"
        assert composed("experiment=cpu_demo").task.name == "key_lookup"  # no model code: it starts anyway
    finally:
        set_default_backend("bwrap")


def test_the_refusal_is_one_line_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rl.train", "experiment=agentic", f"run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PATH": str(tmp_path)})
    assert done.returncode == 1 and not run_dir.exists()
    assert done.stderr.strip().splitlines() == [
        "error: SandboxUnavailable: " + bwrap.missing_message()], done.stderr
