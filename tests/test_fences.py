"""Fences between the floors, checked on the source: the top floor (rl/) talks to the engine and the
trainer through their own methods, never through their parts (`engine.cache.prefix...`); no file of
rl/ or rollout/ reads another file's private attribute (`other._x`); no file anywhere imports
another's private name (`from x import _name`). Each rule is also fed a planted source it must catch."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = {"engine", "trainer"}
"""Names under which rl/ holds the rollout engine and the trainer."""
OPEN_PARTS = {"config", "model"}
"""Parts of a component rl/ may look into: its config (plain data) and the model it runs (the policy)."""
EXTERNAL_ROOTS = {"torch", "sys", "os", "np", "triton", "tl", "dist", "threading", "weakref", "inspect", "functools",
                  "collections", "typing", "json", "asyncio", "math", "signal", "subprocess", "shutil", "ctypes", "aten"}
"""Modules whose private attributes are theirs to offer (torch._C, sys._getframe ...)."""
LIBRARY_PRIVATES = {
    "rl/config/compose.py": {"_set_flag", "_get_node", "_is_missing", "_is_none"},  # OmegaConf nodes' flags
    "rl/plan/activation.py": {"_schema"},  # a torch op's schema (the meta device's dispatch)
}
"""Private attributes of a library's objects a file relies on, by file (the rule is about ours)."""
PACKAGES = ("kernels", "models", "memory", "rollout", "trainer", "rl", "benchmarks", "tests")


def files(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def chain(node: ast.Attribute) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"]; a chain rooted in a call or subscript starts at the first name after it."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def part_reaches(source: str) -> list[str]:
    """Attribute chains that go through an engine or trainer into one of its parts and on (two
    links past the component, the first not an open part): `p.engine.cache.prefix`,
    `trainer.optimizer.spilled_bytes`; `engine.config.x`, `engine.model.y`, `engine.sleep()` pass."""
    tree, hits = ast.parse(source), []
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # report whole chains once
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            names = chain(node)
            for i, name in enumerate(names[:-2]):
                if i and names[i - 1] in ("cfg", "config"):
                    break  # the config group of that name (cfg.trainer.optimizer), not the component
                if name in COMPONENTS and names[i + 1] not in OPEN_PARTS:
                    hits.append(f"{node.lineno}: {'.'.join(names)}")
                    break
    return hits


def private_reaches(source: str, allowed: set[str] = frozenset()) -> list[str]:
    """`x._name` where `_name` is not defined in this source (no def/class of that name, no
    `anything._name = ...` assignment, no attribute of that name in a class body): another file's
    private state. `self._x` is fine when this file defines `_x`; dunders and external modules'
    privates (`torch._C`) are not the rule's business."""
    tree = ast.parse(source)
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, (ast.AnnAssign, ast.Assign)):
            for target in ([node.target] if isinstance(node, ast.AnnAssign) else node.targets):
                if isinstance(target, ast.Name):
                    defined.add(target.id)
    hits = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and node.attr not in defined and node.attr not in allowed):
            names = chain(node)
            if names and names[0] in EXTERNAL_ROOTS:
                continue
            hits.append(f"{node.lineno}: {'.'.join(names) or node.attr}")
    return hits


def private_imports(source: str) -> list[str]:
    """`from pkg.mod import _name` (a private name imported from another file of the project)."""
    return [f"{node.lineno}: from {node.module} import {a.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


ROOMS = ("rollout.kv", "rollout.speculative")
"""Rooms of rollout/ whose insides only their own files (and their own tests) import; everyone else takes the
names the room's __init__ exports (`__all__`)."""


def room_exports(room: str) -> set[str]:
    tree = ast.parse((ROOT / room.replace(".", "/") / "__init__.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    return set(ast.literal_eval(node.value))


def room_breaches(source: str, room: str, exports: set[str]) -> list[str]:
    """Imports of `room`'s inside (`rollout.kv.prefix_cache`, any depth, in functions too) and names taken from
    `room` that its __init__ does not export."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            hits += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith(room + ".")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith(room + "."):
                hits.append(f"{node.lineno}: from {node.module} import ...")
            elif node.module == room:
                hits += [f"{node.lineno}: from {room} import {a.name} (not exported)" for a in node.names
                         if a.name not in exports]
    return hits


def outside(room: str) -> list[Path]:
    folder = room.replace(".", "/")
    inside = (ROOT / folder, ROOT / "tests" / folder)
    return [p for p in files(*PACKAGES, "tools") if not any(p.is_relative_to(d) for d in inside)]


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_of_rollout_is_reached_through_its_exports_only(room: str):
    exports = room_exports(room)
    hits = {str(p.relative_to(ROOT)): h for p in outside(room) if (h := room_breaches(p.read_text(), room, exports))}
    assert hits == {}


def test_each_fence_catches_a_planted_breach():
    planted = "from rollout.kv.prefix_cache import PrefixCache\nfrom rollout.kv import CacheManager, Secret\n" \
              "def f():\n    import rollout.kv.host_tier\n"
    assert room_breaches(planted, "rollout.kv", {"CacheManager"}) == [
        "1: from rollout.kv.prefix_cache import ...", "2: from rollout.kv import Secret (not exported)",
        "4: import rollout.kv.host_tier"]
    assert part_reaches("x = p.engine.cache.prefix.index\ny = engine.scheduler.running") == [
        "1: p.engine.cache.prefix.index", "2: engine.scheduler.running"]
    assert part_reaches("n = trainer.optimizer.spilled_bytes") == ["1: trainer.optimizer.spilled_bytes"]
    assert part_reaches("b = cfg.trainer.optimizer.backend") == []
    assert part_reaches("a = engine.config.pool_bytes\nb = engine.model.config.eos\nengine.sleep()\nengine.host") == []
    assert private_reaches("def f(store):\n    return store._manifest") == ["2: store._manifest"]
    assert private_reaches("class A:\n    def __init__(self):\n        self._n = 0\n    def g(self, o):\n"
                           "        return o._n + self._n + torch._C.x") == []
    assert private_imports("from memory.nvme_store import _Record, NvmeStore") == [
        "1: from memory.nvme_store import _Record"]
    assert private_imports("from torch.utils.cpp_extension import _get_build_directory") == []


@pytest.mark.parametrize("path", files("rl"), ids=lambda p: str(p.relative_to(ROOT)))
def test_rl_reaches_no_part_of_the_engine_or_the_trainer(path: Path):
    """The loop, the driver, validation, the builders... call the engine's and the trainer's own
    methods (sleep, restore_host, memory(), offload_states ...), never their parts' (the cache,
    the pool, the scheduler, the optimizer, the arena)."""
    assert part_reaches(path.read_text()) == []


@pytest.mark.parametrize("path", files("rl", "rollout"), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_attribute_across_files(path: Path):
    allowed = LIBRARY_PRIVATES.get(str(path.relative_to(ROOT)), set())
    assert private_reaches(path.read_text(), allowed) == []


@pytest.mark.parametrize("path", files("kernels", "models", "memory", "rollout", "trainer", "rl"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_imported_across_files(path: Path):
    assert private_imports(path.read_text()) == []


def loop_shape(source: str, name: str = "run_loop") -> tuple[int, list[int]]:
    """(lines of function `name`, the lines of the lambdas inside it)."""
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name)
    return fn.end_lineno - fn.lineno + 1, [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Lambda)]


def test_the_loop_is_one_screen_of_explicit_calls():
    """run_loop fits one screen (<= 45 lines) and no lambda stands in for a phase in it."""
    assert loop_shape("def run_loop(p):\n    x = lambda: p.engine.sleep()\n    return x\n") == (3, [2])
    lines, lambdas = loop_shape((ROOT / "rl/run/loop.py").read_text())
    assert lines <= 45 and lambdas == [], (lines, lambdas)
