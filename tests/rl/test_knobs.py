"""One name and one default per knob, checked on the dataclasses (RunConfig's tree, the optional
engine nodes included, and the planner's ClusterConfig) against configs/**.yaml:

(a) no YAML value restates the default of its key (a task's params: its constructor's defaults);
(b) no knob is reachable under two names: the former aliases stay gone, and a field name at two
    paths of the tree is one of the reviewed pairs of distinct meanings;
(c) every YAML key is a field of the dataclass it configures (a task param: a constructor keyword).

Each check is a function of the trees it reads (`schema`, `options`); the planted-tree tests below
feed it a restated default, an unknown key and an alias and see each one reported.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from rl.config import RunConfig
from rl.config.compose import CONFIGS
from rl.envs.tasks import resolve_task
from rl.plan.cluster import ClusterConfig

NO_DEFAULT = object()
"""A field (or task keyword) without a default: any value states something."""

ROOTS = {"": RunConfig, "cluster.": ClusterConfig}
"""The trees the YAML files configure: the run's, and the planner's cluster (configs/cluster)."""

DESCRIPTIONS = ("model", "cluster")
"""Groups whose files describe an artefact completely (a checkpoint's config.json field for field,
a machine's spec sheet): they may list a value equal to the field's default. Keys are still checked."""

REMOVED_ALIASES = {
    "rollout.reuse_stale_prefix": "engine.prefix_cache.reuse_stale",
    "engine.seed": "seed (the run's; the Engine's `seed` argument)",
    "engine.show_progress": "tracking.progress (the Engine's generate(progress=...))",
    "engine.num_pages": "engine.pool_mb (EngineConfig.for_pages for an exact page count)",
    "engine.host_num_pages": "engine.host_pool_mb",
}
"""Second names a knob once had, and the one it keeps."""

DISTINCT = {
    "backend": "trainer.optimizer.backend (where the optimizer runs) vs sandbox.backend (how model code is isolated)",
    "budget_tokens": "rollout.budget_tokens (generated tokens per iteration) vs engine.kv_budget.budget_tokens "
                     "(MLA slots per sequence)",
    "every": "eval.every vs checkpoint.every: two cadences",
    "enable": "algo.filter_groups.enable, algo.overlong.enable, algo.critic.enable: three switches",
    "lr": "warmup.lr (the warm-up's; null = the trainer's) vs trainer.optimizer.lr",
    "max_new_tokens": "eval.max_new_tokens (null = the rollout's) vs rollout.max_new_tokens",
    "name": "task.name vs experiment.name",
    "seed": "seed (the run's) vs data.seed (the rows' shuffle) vs engine.kv_budget.seed (InfiniGen's calibration)",
    "temperature": "eval.temperature (0 = greedy) vs rollout.temperature (trained on)",
    "top_p": "eval.top_p vs rollout.top_p",
}
"""Field names at more than one path of the tree, each pair reviewed: different knobs, not one knob
under two names. A new shared name fails `test_no_knob_has_two_names` until it is reviewed here."""


# ---- the trees --------------------------------------------------------------------------------------
@dataclass
class Schema:
    nodes: dict[str, type]
    """Path -> dataclass of every node (optional ones: the dataclass they hold when selected)."""
    leaves: dict[str, Any]
    """Path -> default (NO_DEFAULT: none) of every leaf field."""


def schema(cls: type, prefix: str = "") -> Schema:
    """The dataclass tree under `cls`, recursively (an `X | None` node: X's fields)."""
    out = Schema({}, {})
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, hint = prefix + f.name, hints[f.name]
        node = next((a for a in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(a)), None)
        if node is not None:
            out.nodes[path] = node
            inner = schema(node, path + ".")
            out.nodes |= inner.nodes
            out.leaves |= inner.leaves
            continue
        default = (f.default if f.default is not dataclasses.MISSING
                   else f.default_factory() if f.default_factory is not dataclasses.MISSING else NO_DEFAULT)
        out.leaves[path] = NO_DEFAULT if default == "???" else default
    return out


def full_schema() -> Schema:
    trees = [schema(cls, prefix) for prefix, cls in ROOTS.items()]
    return Schema({k: v for t in trees for k, v in t.nodes.items()}, {k: v for t in trees for k, v in t.leaves.items()})


@dataclass
class Option:
    """One YAML file: the values it sets, by path."""
    file: str
    group: str
    values: dict[str, Any]
    task: str | None = None
    """The task whose params it sets (its task.name, or the task option it selects)."""
    is_global: bool = False
    """A `# @package _global_` preset, applied on top of the group options."""


def flatten(tree: dict, prefix: str, nodes: dict[str, type]) -> dict[str, Any]:
    """Leaf path -> value; a dict under a node path is walked, task.params into its keywords."""
    out = {}
    for key, value in tree.items():
        path = prefix + str(key)
        if isinstance(value, dict) and (path in nodes or path == "task.params"):
            out |= flatten(value, path + ".", {**nodes, path: dict} if path == "task.params" else nodes)
        else:
            out[path] = value
    return out


def options(root: Path = Path(CONFIGS), nodes: dict[str, type] | None = None) -> list[Option]:
    """Every configs/**.yaml as an Option (configs/config.yaml: its own keys, Hydra's left out)."""
    nodes = full_schema().nodes if nodes is None else nodes
    task_names = {}
    out = []
    for path in sorted(root.rglob("*.yaml")):
        text = path.read_text()
        package = next((line.split("@package", 1)[1].strip() for line in text.splitlines()
                        if line.startswith("# @package")), None)
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
        selects = [d for d in tree.pop("defaults", []) if isinstance(d, dict)]
        group = "" if path.parent == root else path.parent.name
        if not group:
            tree.pop("hydra", None)
            prefix = ""
        else:
            prefix = "" if package == "_global_" else f"{package}." if package else f"{group}."
        values = flatten(tree, prefix, nodes)
        option = Option(str(path.relative_to(root)), group, values, values.get("task.name"), package == "_global_")
        if option.task is None:  # a preset's task: the option it selects
            chosen = next((v for d in selects for k, v in d.items() if k.endswith("/task")), None)
            option.task = f"option:{chosen}" if chosen else None
        if group == "task":
            task_names[path.stem] = option.task
        out.append(option)
    for option in out:
        if option.task and option.task.startswith("option:"):
            option.task = task_names.get(option.task.removeprefix("option:"))
    return out


def task_keywords(name: str) -> tuple[dict[str, Any], bool]:
    """(keyword -> default (NO_DEFAULT: none), whether it takes **kwargs) of task `name`'s constructor."""
    params = inspect.signature(resolve_task(name)).parameters.values()
    keywords = {p.name: NO_DEFAULT if p.default is inspect.Parameter.empty else p.default for p in params
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return keywords, any(p.kind is p.VAR_KEYWORD for p in params)


# ---- the checks -------------------------------------------------------------------------------------
def same(a: Any, b: Any) -> bool:
    """YAML value == default, as JSON values (a tuple is a list; True is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return json.dumps(a, default=str, sort_keys=True) == json.dumps(b, default=str, sort_keys=True)


def default_of(path: str, option: Option, tree: Schema, keywords=task_keywords) -> Any:
    """The default a path of `option` takes without it; KeyError for a key with no field."""
    if path.startswith("task.params."):
        if option.task is None:
            raise KeyError(path)
        known, open_ended = keywords(option.task)
        key = path.removeprefix("task.params.")
        if key not in known:
            if open_ended:
                return NO_DEFAULT
            raise KeyError(path)
        return known[key]
    return tree.leaves[path]


def restated(opts: list[Option], tree: Schema, keywords=task_keywords) -> list[str]:
    """(a) A YAML value equal to its key's default. A preset's value is exempt where a group option
    sets the same key (the preset then resets that option's choice)."""
    set_by_groups = {p for o in opts if not o.is_global for p in o.values}
    found = []
    for o in opts:
        if o.group in DESCRIPTIONS:
            continue
        for path, value in o.values.items():
            try:
                default = default_of(path, o, tree, keywords)
            except KeyError:
                continue  # (c) reports it
            if default is not NO_DEFAULT and same(value, default) and not (o.is_global and path in set_by_groups):
                found.append(f"{o.file}: {path}={value!r} restates the default")
    return found


def unknown(opts: list[Option], tree: Schema, keywords=task_keywords) -> list[str]:
    """(c) A YAML key that names no field (no task keyword)."""
    found = []
    for o in opts:
        for path in o.values:
            try:
                default_of(path, o, tree, keywords)
            except KeyError:
                found.append(f"{o.file}: {path} is no field")
    return found


def aliases(tree: Schema, removed: dict[str, str] = REMOVED_ALIASES, distinct: dict[str, str] = DISTINCT) -> list[str]:
    """(b) A former alias back in the tree, or a field name at two paths that is not a reviewed pair."""
    found = [f"{old} is back: the knob is {new}" for old, new in removed.items() if old in tree.leaves]
    paths: dict[str, list[str]] = {}
    for path in tree.leaves:
        # descriptions: one dataclass each; the critic's optimizer is a second OptimizerConfig (its own model's)
        if not path.startswith(("model.", "cluster.", "algo.critic.optimizer.")):
            paths.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    found += [f"{name} at {', '.join(ps)}: one knob under two names? (else review it into DISTINCT)"
              for name, ps in sorted(paths.items()) if len(ps) > 1 and name not in distinct]
    return found


# ---- the repository ---------------------------------------------------------------------------------
def test_no_yaml_value_restates_its_default():
    assert restated(options(), full_schema()) == []


def test_every_yaml_key_is_a_field():
    assert unknown(options(), full_schema()) == []


def test_no_knob_has_two_names():
    tree = full_schema()
    assert aliases(tree) == []
    assert "engine.prefix_cache.reuse_stale" in tree.leaves and "seed" in tree.leaves
    assert not any(p.endswith(".seed") and p.startswith(("engine.", "rollout.")) and p != "engine.kv_budget.seed"
                   for p in tree.leaves)  # the run's seed is settable once
    assert all(p in tree.leaves for p in ("engine.pool_mb", "engine.host_pool_mb"))  # one size knob per pool


def test_the_trees_are_read_whole():
    """The walk reaches the optional engine nodes and every group file (so a passing check means something)."""
    tree, opts = full_schema(), options()
    assert {"engine.prefix_cache", "engine.kv_budget", "algo.loss", "trainer.optimizer"} <= set(tree.nodes)
    assert tree.leaves["engine.prefix_cache.model_id"] == "policy" and tree.leaves["task.name"] is NO_DEFAULT
    files = {o.file for o in opts}
    assert {"config.yaml", "algo/grpo.yaml", "task/key_lookup.yaml", "prefix_cache/on.yaml",
            "experiment/cpu_demo.yaml", "cluster/h200x8.yaml", "model/tiny.yaml"} <= files
    by_file = {o.file: o for o in opts}
    assert by_file["algo/grpo.yaml"].values == {"algo.loss.clip_eps_high": 0.28}
    assert by_file["experiment/agentic.yaml"].task == "tool_arith" and by_file["experiment/agentic.yaml"].is_global
    assert by_file["cluster/h200x8.yaml"].values["cluster.gpus_per_node"] == 8


# ---- each check reports what it should (planted trees) ----------------------------------------------
def planted_keywords(name: str):
    return ({"length": 3, "format_reward": 0.1}, False) if name == "digits" else ({}, True)


PLANTED = Schema({"rollout": dict, "engine": dict}, {"rollout.max_new_tokens": 4, "engine.pool_mb": 64,
                                                      "engine.max_model_len": 4096, "task.name": NO_DEFAULT,
                                                      "task.params": {}, "seed": 0})


def test_a_restated_default_is_reported():
    opts = [Option("rollout/x.yaml", "rollout", {"rollout.max_new_tokens": 4}),
            Option("engine/x.yaml", "engine", {"engine.pool_mb": 64.0, "engine.max_model_len": 64}),
            Option("task/digits.yaml", "task", {"task.name": "digits", "task.params.length": 3,
                                                 "task.params.format_reward": 0.2}, task="digits")]
    assert restated(opts, PLANTED, planted_keywords) == [
        "rollout/x.yaml: rollout.max_new_tokens=4 restates the default",
        "engine/x.yaml: engine.pool_mb=64.0 restates the default",
        "task/digits.yaml: task.params.length=3 restates the default"]


def test_a_preset_resetting_a_group_options_choice_and_a_description_are_not_restatements():
    opts = [Option("rollout/x.yaml", "rollout", {"rollout.max_new_tokens": 8}),
            Option("experiment/x.yaml", "experiment", {"rollout.max_new_tokens": 4}, is_global=True),
            Option("model/x.yaml", "model", {"engine.max_model_len": 4096})]
    assert restated(opts, PLANTED, planted_keywords) == []
    opts[0] = Option("rollout/x.yaml", "rollout", {})  # no option sets it: the preset restates the default
    assert restated(opts, PLANTED, planted_keywords) == ["experiment/x.yaml: rollout.max_new_tokens=4 restates the "
                                                          "default"]


def test_an_unknown_key_is_reported():
    opts = [Option("rollout/x.yaml", "rollout", {"rollout.max_new_tokns": 3}),
            Option("task/digits.yaml", "task", {"task.name": "digits", "task.params.lenght": 5}, task="digits"),
            Option("task/open.yaml", "task", {"task.name": "open", "task.params.anything": 1}, task="open")]
    assert unknown(opts, PLANTED, planted_keywords) == ["rollout/x.yaml: rollout.max_new_tokns is no field",
                                                        "task/digits.yaml: task.params.lenght is no field"]


def test_an_alias_is_reported():
    aliased = Schema(PLANTED.nodes, {**PLANTED.leaves, "rollout.reuse_stale_prefix": False, "engine.seed": 0})
    assert aliases(aliased, distinct={}) == [
        "rollout.reuse_stale_prefix is back: the knob is engine.prefix_cache.reuse_stale",
        "engine.seed is back: the knob is seed (the run's; the Engine's `seed` argument)",
        "seed at seed, engine.seed: one knob under two names? (else review it into DISTINCT)"]
    shared = Schema(PLANTED.nodes, {**PLANTED.leaves, "engine.max_new_tokens": 8})
    assert aliases(shared, distinct={}) == ["max_new_tokens at rollout.max_new_tokens, engine.max_new_tokens: one knob "
                                            "under two names? (else review it into DISTINCT)"]
    assert aliases(shared, distinct={"max_new_tokens": "reviewed"}) == []


@dataclass
class PlantedInner:
    size: int = 3


@dataclass
class PlantedOuter:
    inner: PlantedInner | None = None
    name: str = "???"
    items: list = dataclasses.field(default_factory=list)


def test_the_schema_walk_sees_optional_nodes_and_missing_defaults():
    tree = schema(PlantedOuter)
    assert tree.nodes == {"inner": PlantedInner}
    assert tree.leaves == {"inner.size": 3, "name": NO_DEFAULT, "items": []}


def test_the_yaml_walk_reads_packages_presets_and_task_params(tmp_path):
    (tmp_path / "task").mkdir()
    (tmp_path / "experiment").mkdir()
    (tmp_path / "prefix_cache").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - base_config\nhydra:\n  run:\n    dir: x\nseed: 1\n")
    (tmp_path / "task" / "digits.yaml").write_text("name: digits\nparams:\n  length: 5\n")
    (tmp_path / "experiment" / "x.yaml").write_text("# @package _global_\ndefaults:\n  - override /task: digits\n"
                                                   "rollout:\n  max_new_tokens: 2\n")
    (tmp_path / "prefix_cache" / "on.yaml").write_text("# @package engine.prefix_cache\nhash_block: 4\n")
    by_file = {o.file: o for o in options(tmp_path, {"rollout": dict, "engine": dict, "engine.prefix_cache": dict})}
    assert by_file["config.yaml"].values == {"seed": 1}
    assert by_file["task/digits.yaml"].values == {"task.name": "digits", "task.params.length": 5}
    assert by_file["experiment/x.yaml"].values == {"rollout.max_new_tokens": 2}
    assert by_file["experiment/x.yaml"].task == "digits" and by_file["experiment/x.yaml"].is_global
    assert by_file["prefix_cache/on.yaml"].values == {"engine.prefix_cache.hash_block": 4}


@pytest.mark.parametrize("value, default, equal", [(0.0, 0, True), (True, 1, False), ([0.9, 0.99], (0.9, 0.99), True),
                                                   (None, None, True), ("fp32", "fp32", True), (16, 16.5, False)])
def test_values_compare_as_json(value, default, equal):
    assert same(value, default) is equal
