"""`code_reward`: a single-turn environment over data rows whose label holds tests; the answer is
Python code, rewarded by the tests it passes when run in the sandbox (rl/envs/tools/sandbox.py).

A row is {"prompt": text or chat messages, "label": tests}; tests are a list of Python snippets (each
usually one `assert`), or one string of code: its top-level asserts are the tests, each run with the
statements before it (so setup lines between asserts run in order), and a string with no top-level
assert is one test. The code is the answer's last fenced block (```python ... ``` or ``` ... ```; an
unclosed last fence, an answer cut at the token limit, runs to the end), else the whole answer.

One sandbox run per answer: a harness executes the code as `__main__` (a `sys.exit(0)` in it does not
skip the tests), then each test in the code's namespace, each in its own try (a test that raises,
fails or runs past `test_time_s`, a wall-time alarm, counts as failed), and writes one summary line tagged with a random nonce of this call, which
the parent parses: a look-alike line printed by the code does not count, and exactly one tagged line
must come back. What the nonce does not stop: code that walks the interpreter's frames can read it,
and an object whose `__eq__` always returns True passes `assert f(x) == y`; the sandbox bounds what
such code can do, not the reward it claims.

Reward: 1.0 when every test passes, else `partial_credit * passed / total`. Components (the driver's
`reward/<name>`, a mean over trajectories): `tests_passed_frac`, `exec_ok` (the code ran to its end
and the summary came back), `timeout` (the run's wall or CPU limit), `tests_timed_out_frac` (tests
stopped by `test_time_s`, when any were), and on a failure one of `cpu_limit`,
`memory`, `output_limit`, `killed`, `crashed`, `syntax_error`, `error` (the code raised, or the
process exited with an error), `no_summary` (the code ended the process itself, e.g. `os._exit`).
Failures never raise: they score 0. A bad row (no label, malformed tests) raises ValueError at reset.

The sandbox pool is one per process and per limits (`shared_sandbox`), started at the first `step`;
environments are built per trajectory and only hold the config. `step` is thread-safe (it touches
the environment's own state and the thread-safe pool), as the env workers (rl/episodes/env_runner.py) need.
"""
from __future__ import annotations

import ast
import re
import secrets
from dataclasses import dataclass, field
from typing import ClassVar

from rl.envs.data import LABEL, PROMPT
from rl.envs.tasks.base import StepResult, register_task
from rl.envs.tools.python_exec import shared_sandbox
from rl.envs.tools.sandbox import ExecResult, SandboxConfig

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
_OPEN_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n", re.M)
_PYTHON_TAGS = ("", "python", "py", "python3")
STATUSES = ("ok", "syntax_error", "memory", "error")
"""What the harness reports about the code itself (before the tests ran)."""

# The harness after which nothing of the code runs: it keeps its own references to the builtins and to
# a duplicate of stdout before executing the code (which may rebind builtins or replace sys.stdout), and
# ends the process with os._exit right after the summary (no atexit handler of the code runs after it).
_HARNESS = r'''
import builtins as _b, os as _os, signal as _signal

class _TestTimeout(BaseException):
    pass

def _harness(src, tests, tag, test_s, compile=compile, exec=exec, len=len, enumerate=enumerate,
             BaseException=BaseException, SystemExit=SystemExit, MemoryError=MemoryError,
             write=_os.write, exit_now=_os._exit, on_signal=_signal.signal, setitimer=_signal.setitimer,
             ALARM=_signal.SIGALRM, REAL=_signal.ITIMER_REAL, TestTimeout=_TestTimeout):
    def alarm(signum, frame):
        raise TestTimeout()

    out, ns, status, passed, slow = _os.dup(1), {"__name__": "__main__", "__builtins__": _b}, "ok", 0, 0
    try:
        code = compile(src, "<solution>", "exec")
    except BaseException:  # SyntaxError, or ValueError for a null byte
        status = "syntax_error"
    else:
        try:
            exec(code, ns)
        except SystemExit as stop:
            status = "ok" if stop.code in (None, 0) else "error"
        except MemoryError:
            status = "memory"
        except BaseException:
            status = "error"
    if status == "ok":
        for i, test in enumerate(tests):
            try:
                on_signal(ALARM, alarm)  # again before each test: the code may have replaced it
                setitimer(REAL, test_s)
                try:
                    exec(compile(test, "<test %d>" % i, "exec"), ns)
                finally:
                    setitimer(REAL, 0)
            except TestTimeout:
                slow += 1
                continue
            except BaseException:
                continue
            passed += 1
    write(out, ("\n%s %s %d %d %d\n" % (tag, status, passed, len(tests), slow)).encode())
    exit_now(0)
'''


def extract_code(answer: str) -> str:
    """The code of `answer`: its last closed fenced block tagged python/py/python3 or untagged (the
    text between the fences); without one, the text after an unclosed such fence (an answer cut at the
    token limit) when there is any; else the whole answer."""
    blocks = [m.group(2) for m in _FENCE.finditer(answer) if m.group(1).lower() in _PYTHON_TAGS]
    if blocks:
        return blocks[-1]
    opened = [m for m in _OPEN_FENCE.finditer(answer) if m.group(1).lower() in _PYTHON_TAGS]
    if opened and answer[opened[-1].end():].strip():
        return answer[opened[-1].end():]
    return answer


def _split_tests(source: str) -> list[str]:
    """The tests of one string of code: each top-level assert with the statements before it; a
    string without a top-level assert is one test."""
    try:
        body = ast.parse(source).body
    except SyntaxError as err:
        raise ValueError(f"label={source!r:.80}: the tests do not parse as Python ({err.msg}, line "
                         f"{err.lineno}), expected Python code with assert statements") from None
    if len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, (ast.List, ast.Tuple)):
        raise ValueError(f"label={source!r:.80} is a string holding a list literal, expected Python code with "
                         f"asserts or a list of test strings (decode the column, e.g. json.loads, in your data)")
    chunks, pending = [], []
    for stmt in body:
        pending.append(stmt)
        if isinstance(stmt, ast.Assert):
            chunks.append(pending)
            pending = []
    if not chunks:
        return [source]
    chunks[-1] += pending  # statements after the last assert run with it
    return [ast.unparse(ast.Module(body=chunk, type_ignores=[])) for chunk in chunks]


def parse_tests(label: object) -> list[str]:
    """The row label's tests as a list of code strings; ValueError naming the label and what is expected."""
    expected = "a list of Python assert statements (str) or one string of Python code with asserts"
    if label is None:
        raise ValueError(f"the code_reward task needs each row's label to hold its tests, got label=None: expected "
                         f"{expected} (set data.label_key to the column of the tests)")
    if isinstance(label, str):
        if not label.strip():
            raise ValueError(f"label={label!r}: no tests, expected {expected}")
        return _split_tests(label)
    if not isinstance(label, (list, tuple)) or not label:
        raise ValueError(f"label={label!r:.80} ({type(label).__name__}), expected {expected}")
    for i, test in enumerate(label):
        if not isinstance(test, str) or not test.strip():
            raise ValueError(f"label[{i}]={test!r:.80}, expected {expected}")
        try:
            compile(test, f"<test {i}>", "exec")
        except SyntaxError as err:
            raise ValueError(f"label[{i}]={test!r:.80} does not parse as Python ({err.msg}), expected "
                             f"{expected}") from None
    return list(label)


def harness_program(code: str, tests: list[str], tag: str, test_time_s: float = 2.0) -> str:
    """The program one sandbox run executes: `code` as __main__, then each test (a wall-time alarm of
    `test_time_s` fails a test that runs longer), then the summary line
    "<tag> <status> <passed> <total> <timed_out>" on stdout and an immediate exit."""
    return _HARNESS + f"_harness({code!r}, {list(tests)!r}, {tag!r}, {float(test_time_s)!r})\n"


def parse_summary(stdout: str, tag: str, num_tests: int) -> tuple[str, int, int] | None:
    """(status, passed, timed_out) from the one summary line tagged `tag`; None when there is not exactly
    one well-formed tagged line for `num_tests` tests (the code ended the process, or forged the line)."""
    found = [line.split() for line in stdout.splitlines() if line.startswith(tag + " ")]
    if len(found) != 1 or len(found[0]) != 5:
        return None
    _, status, passed, total, slow = found[0]
    if (status not in STATUSES or not passed.isdigit() or not slow.isdigit() or total != str(num_tests)
            or int(passed) + int(slow) > num_tests):
        return None
    return status, int(passed), int(slow)


def score_run(result: ExecResult, tag: str, num_tests: int, partial_credit: float) -> StepResult:
    """The StepResult of one harness run: reward, components and correctness (module docstring)."""
    failure, passed, slow = None, 0, 0
    summary = parse_summary(result.stdout, tag, num_tests) if result.reason == "ok" else None
    if result.reason != "ok":
        failure = result.reason
    elif summary is None:
        failure = "no_summary"
    elif summary[0] != "ok":
        failure = summary[0]
    else:
        passed, slow = summary[1], summary[2]
    frac = passed / num_tests
    components = {"tests_passed_frac": frac, "exec_ok": float(failure is None),
                  "timeout": float(failure in ("timeout", "cpu_limit"))}
    if slow:
        components["tests_timed_out_frac"] = slow / num_tests
    if failure is not None and failure != "timeout":
        components[failure] = 1.0
    reward = 1.0 if passed == num_tests else partial_credit * frac
    return StepResult("", reward, True, components=components, is_correct=passed == num_tests)


@register_task("code_reward")
@dataclass
class CodeReward:
    uses_sandbox: ClassVar[bool] = True
    """Runs model-written code: the run refuses to start when the sandbox backend cannot run here."""
    cpu_time_s: float = 5.0
    """CPU-time limit of one answer's run (code and all its tests)."""
    wall_time_s: float = 10.0
    """Wall-time limit of one answer's run; keep env.timeout_s above it."""
    memory_mb: int = 512
    """Address-space limit of the run's process."""
    max_output_bytes: int = 65536
    """stdout + stderr kept; past it the run is killed and scores 0 (`output_limit`)."""
    workers: int = 4
    """Warm sandbox workers of the process's shared pool."""
    test_time_s: float = 2.0
    """Wall time one test may take (an alarm in the harness); a slower test fails, the others still run."""
    partial_credit: float = 0.0
    """Reward of a partly passing answer is partial_credit * passed / total; 0 = all or nothing."""
    max_turns: int = 1
    """Single turn."""
    _tests: list[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_turns != 1:
            raise ValueError(f"max_turns={self.max_turns!r}, expected 1 (the code_reward task is single-turn)")
        credit = self.partial_credit
        if isinstance(credit, bool) or not isinstance(credit, (int, float)) or not 0.0 <= credit <= 1.0:
            raise ValueError(f"partial_credit={credit!r}, expected a number in [0, 1]")
        limit = self.test_time_s
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ValueError(f"test_time_s={limit!r}, expected a positive number of seconds")
        self.sandbox_config  # validates the limits now, naming the bad one; the pool starts at the first step

    @property
    def sandbox_config(self) -> SandboxConfig:
        return SandboxConfig(cpu_time_s=self.cpu_time_s, wall_time_s=self.wall_time_s, memory_mb=self.memory_mb,
                             max_output_bytes=self.max_output_bytes, workers=self.workers)

    def reset(self, seed: int, row: dict | None = None) -> str | list[dict]:
        """The row's prompt (messages are returned as they are); `seed` is unused: the row decides.
        Raises ValueError when the row has no tests or they are malformed."""
        if row is None:
            raise ValueError("the code_reward task needs a data row: set data.train_files (rows whose label "
                             "holds the tests)")
        self._tests = parse_tests(row.get(LABEL))
        return row[PROMPT]

    def step(self, answer: str) -> StepResult:
        """Run the answer's code and the row's tests in one sandbox run and score it (never raises for
        what the code does)."""
        if self._tests is None:
            raise RuntimeError("step() before reset()")
        tag = "rl.code_reward-" + secrets.token_hex(16)
        program = harness_program(extract_code(answer), self._tests, tag, self.test_time_s)
        result = shared_sandbox(self.sandbox_config).run(program)
        return score_run(result, tag, len(self._tests), float(self.partial_credit))
