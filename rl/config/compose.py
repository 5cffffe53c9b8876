"""Composition: configs/*.yaml onto the `RunConfig` schema (rl/config/__init__.py) through Hydra, then the
validated dataclasses built from it, every value error naming its key; and the schema's own defaults
by key path (what a resume compares against)."""
from __future__ import annotations

import json
import os
import re
from dataclasses import MISSING as FIELD_MISSING
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from models.config import ModelConfig
from rl.config import RunConfig
from rl.config.checks import check_optional_groups, check_sandbox, check_world, task_params_overrides


NO_DEFAULT = object()
"""`schema_default` of a path that is no field with a default."""


def schema_default(path: str) -> Any:
    """The schema's default of a leaf key path ("rollout.max_staleness", "engine.prefix_cache.hash_block")
    as `resolved_config` writes values (JSON), walking RunConfig's dataclass fields (an optional node:
    its dataclass's defaults); NO_DEFAULT when the path names no field with a default."""
    cls: Any = RunConfig
    parts = path.split(".")
    for i, name in enumerate(parts):
        field_ = {f.name: f for f in fields(cls)}.get(name) if is_dataclass(cls) else None
        if field_ is None:
            return NO_DEFAULT
        if i == len(parts) - 1:
            if isinstance(field_.default, str) and field_.default == MISSING:  # "???": a group's selection
                return NO_DEFAULT
            if field_.default is not FIELD_MISSING:
                value = field_.default
            elif field_.default_factory is not FIELD_MISSING:
                value = field_.default_factory()
            else:
                return NO_DEFAULT
            return json.loads(json.dumps(asdict(value) if is_dataclass(value) else value, default=str))
        hint = get_type_hints(cls)[name]
        cls = next((a for a in (get_args(hint) or (hint,)) if is_dataclass(a)), None)
    return NO_DEFAULT


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def writable(node: Any) -> None:
    """Clear the read-only flag frozen dataclasses put on their nodes (composition must write
    into them; the frozen objects are built afterwards by `to_run_config`)."""
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
        for key in node.keys():
            writable(node._get_node(key))
    elif isinstance(node, ListConfig) and not node._is_missing() and not node._is_none():
        for i in range(len(node)):
            writable(node._get_node(i))


def register_configs() -> None:
    """Put the schema in Hydra's ConfigStore as `base_config` (the first entry of configs/config.yaml)."""
    node = OmegaConf.structured(RunConfig)
    writable(node)
    ConfigStore.instance().store(name="base_config", node=node)


def _build_groups(node: DictConfig, path: str) -> None:
    """Build every dataclass node under `node`, deepest first, so a value error names its key: the
    component's own message ("max_model_len=1, expected >= 2") becomes "engine.max_model_len=1, ..."."""
    for key in node.keys():
        child = node._get_node(key)
        if (isinstance(child, DictConfig) and not child._is_none() and not child._is_missing()
                and is_dataclass(OmegaConf.get_type(child))):
            _build_groups(child, f"{path}{key}.")
    if not path:
        return
    try:
        OmegaConf.to_object(node)
    except ValueError as err:
        message = str(err).removeprefix(path).removeprefix(path.split(".")[-2] + ".")
        first = re.match(r"\w+", message)  # the field the message starts with, if it names one
        if first and first[0] in {f.name for f in fields(OmegaConf.get_type(node))}:
            raise ValueError(f"{path}{message}") from None
        raise ValueError(f"{path[:-1]}: {message}") from None


def to_run_config(cfg: DictConfig, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The composed Hydra config as validated dataclasses (value errors name the key). With
    experiment.checkpoint and no `model` group or `model.*` key among the command line's `overrides`,
    the model config is the checkpoint's config.json (`adopt_checkpoint_model`). The rules on the
    number of ranks are checked for WORLD_SIZE (torchrun's; 1 without it)."""
    adopt_checkpoint_model(cfg, overrides)
    _build_groups(cfg, "")
    run_config = OmegaConf.to_object(cfg)
    check_world(run_config, int(os.environ.get("WORLD_SIZE", "1")))
    check_sandbox(run_config)
    return run_config


def adopt_checkpoint_model(cfg: DictConfig, overrides: list[str] | tuple[str, ...] = ()) -> None:
    """Start from a checkpoint without repeating its shape: its config.json becomes the `model` node,
    unless the command line chose a model group or model keys (then rl/train.py's
    check_checkpoint_model refuses any difference, naming each key)."""
    start = cfg.experiment.get("checkpoint")
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    if start is None or any(k == "model" or k.startswith("model.") for k in keys):
        return
    stored = Path(start) / "config.json"
    if not stored.exists():
        raise FileNotFoundError(f"experiment.checkpoint={start!r} has no config.json (a Hugging Face checkpoint "
                                f"directory is expected)")
    cfg.model = OmegaConf.structured(ModelConfig.from_hf_dict(json.loads(stored.read_text())))


def compose_run_config(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The run config `python -m rl.train *overrides` runs: for tools and tests that compose outside
    Hydra's main (and rl.train's precheck, before Hydra writes anything)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    overrides = task_params_overrides(overrides)
    check_optional_groups(overrides)
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return to_run_config(compose("config", overrides=overrides), overrides)
