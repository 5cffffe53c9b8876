"""The `python_exec` tool: model-written Python run in the sandbox (rl/envs/tools/sandbox.py).

The code runs as a script; when its last statement is an expression, its value is printed (as a
notebook cell shows it), so `37*8` answers 296 without a print. The tool's result is the job's
stdout, or one line naming the failure (`ExecResult.feedback`), cut to `max_chars`.

Environments share one Sandbox per configuration and process (`shared_sandbox`): each trajectory
builds its own environment, and a warm pool per environment would start hundreds of interpreters.
"""
from __future__ import annotations

import ast
import atexit
import os
import threading

from rl.envs.tools.calls import Tool
from rl.envs.tools.sandbox import Sandbox, SandboxConfig

_SANDBOXES: dict[tuple[int, SandboxConfig], Sandbox] = {}
_LOCK = threading.Lock()


def shared_sandbox(config: SandboxConfig) -> Sandbox:
    """This process's Sandbox for `config`, started at the first call and shared by every caller
    (thread-safe); keyed by the pid too, so a forked child starts its own pool."""
    key = (os.getpid(), config)
    with _LOCK:
        sandbox = _SANDBOXES.get(key)
        if sandbox is None:
            sandbox = _SANDBOXES[key] = Sandbox(config)
        return sandbox


def close_sandboxes() -> None:
    """Close this process's shared sandboxes (their workers are killed); a later `step` starts new ones."""
    with _LOCK:
        mine = [k for k in _SANDBOXES if k[0] == os.getpid()]
        sandboxes = [_SANDBOXES.pop(k) for k in mine]
    for sandbox in sandboxes:
        sandbox.close()


atexit.register(close_sandboxes)


def with_printed_value(code: str) -> str:
    """`code` with its last statement printed when it is an expression (`repr` for non-strings); the
    code unchanged when it does not parse (the sandbox then reports the SyntaxError) or ends otherwise."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    show = ast.Expr(ast.Call(ast.Name("print", ast.Load()), [last.value], []))
    tree.body[-1] = ast.copy_location(show, last)
    return ast.unparse(ast.fix_missing_locations(tree))


def run_python(sandbox: Sandbox, code: str, max_chars: int = 200) -> str:
    """The tool's result for `code` (module docstring)."""
    text = sandbox.run(with_printed_value(code)).feedback.strip()
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def python_exec_tool(sandbox: Sandbox, name: str = "python_exec", max_chars: int = 200) -> Tool:
    """The tool as a registry entry: one required string argument, `code`."""
    return Tool(name=name, description="Run Python code in a sandbox and return what it prints (the value of a "
                                       "final expression is printed).",
                parameters={"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                fn=lambda code: run_python(sandbox, code, max_chars))
