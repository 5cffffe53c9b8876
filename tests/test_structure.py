"""The code's shape, checked on its own source: no import circles (TYPE_CHECKING and function-level
imports included), no file over 500 lines, no function over 80 lines outside Triton kernels."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "models", "memory", "rollout", "trainer", "rl", "benchmarks")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def sources() -> dict[str, Path]:
    """Module name -> file, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = path
    return out


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere (top level, under TYPE_CHECKING, inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if m in known}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan, iterative), plus self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = [[m] for m, deps in graph.items() if m in deps]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(map(sorted, import_cycles(graph))) == [["a", "b", "c"], ["e"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    known = sources()
    graph = {name: imported_modules(path, known) - {name} for name, path in known.items()}
    assert import_cycles(graph) == []


def _is_triton_kernel(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in fn.decorator_list)


@pytest.mark.parametrize("path", sorted(sources().values()), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_and_function_lengths(path: Path):
    text = path.read_text()
    assert text.count("\n") <= MAX_FILE_LINES, f"{path.name}: {text.count(chr(10))} lines > {MAX_FILE_LINES}"
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and not _is_triton_kernel(node)]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines: {long}"


ENGINE_CORE = sorted(p for p in (ROOT / "rollout").glob("*.py"))
"""The engine core: the files at the top of rollout/ (its rooms kv/ and speculative/ sit below)."""


def test_the_engine_core_uses_the_cache_facade_only():
    """Every file of the engine core calls CacheManager's phase methods: never its prefix cache, its evictor's
    internals, or the scheduler's queues from outside the scheduler."""
    pattern = re.compile(r"cache\.prefix\b|\.evictor\.|scheduler\.running\[")
    assert len(ENGINE_CORE) >= 8 and pattern.search("self.cache.prefix.index")
    hits = [f"{path.name}:{i}: {line.strip()}" for path in ENGINE_CORE
            for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
