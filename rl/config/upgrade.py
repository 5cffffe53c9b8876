"""Keys renamed when the config groups became the components' own configs, accepted for one release:
`upgrade_overrides` rewrites command-line overrides (with a `DeprecatedKeyWarning` naming the new key),
`upgrade_stored_config` reads an older checkpoint's stored run config in today's names. Re-exported by
rl/config/__init__.py."""
from __future__ import annotations

import copy
import json
import re
import warnings
from dataclasses import asdict

from rollout.engine_config import EngineConfig
from rollout.kv_eviction import KVBudgetConfig
from rollout.prefix_config import PrefixCacheConfig

# ---- keys renamed when the groups became the components' own configs (accepted for one release) ----
RENAMED_KEYS = {"memory.pool_mb": "engine.pool_mb", "memory.host_pool_mb": "engine.host_pool_mb",
                "rollout.max_model_len": "engine.max_model_len",
                "rollout.max_num_batched_tokens": "engine.max_num_batched_tokens",
                "rollout.kernel_impl": "engine.kernel_impl", "rollout.kda_state_dtype": "engine.kda_state_dtype",
                "task.tokenizer": "tokenizer.path", "rollout.env_timeout_s": "env.timeout_s"}
"""Old key -> new key, same value. Three more old keys map to config groups (`upgrade_overrides`):
rollout.prefix_hash_block, rollout.kv_budget_tokens and rollout.kv_policy; and the value
rollout.max_concurrency=auto is now null."""

PREFIX_CACHE_MODEL_ID = "policy"
"""The RL run's prefix-cache salt (configs/prefix_cache/on.yaml sets it)."""


class DeprecatedKeyWarning(FutureWarning):
    """An override used a renamed key; the message names the new one. (A FutureWarning: Python
    shows it to the user of a command by default, a DeprecationWarning it hides.)"""


_OVERRIDE = re.compile(r"^(\+{0,2})([A-Za-z_][\w.]*)=(.*)$")
_NULL = ("null", "None", "~", "")


def upgrade_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides with the renamed keys rewritten (one DeprecatedKeyWarning each, naming
    the new key): RENAMED_KEYS; rollout.prefix_hash_block=N -> prefix_cache=on
    engine.prefix_cache.hash_block=N (null: nothing); rollout.kv_budget_tokens=N with
    rollout.kv_policy=P -> kv_budget=P engine.kv_budget.budget_tokens=N (P defaults to h2o; null:
    nothing); rollout.kv_policy without a budget selected nothing then and is dropped;
    rollout.max_concurrency=auto -> null. The `+key=` / `++key=` forms keep their prefix; every other
    argument passes unchanged. Called wherever a run config is composed (compose_run_config, rl/train.py)."""
    parsed = [_OVERRIDE.match(arg) for arg in overrides]
    policy = next((m[3] for m in parsed if m and m[2] == "rollout.kv_policy"), "h2o")
    budget = any(m and m[2] == "rollout.kv_budget_tokens" and m[3] not in _NULL for m in parsed)
    out = []
    for arg, m in zip(overrides, parsed):
        plus, key, value = m.groups() if m else ("", None, None)
        if key in RENAMED_KEYS:
            new = [f"{plus}{RENAMED_KEYS[key]}={value}"]
        elif key == "rollout.prefix_hash_block":
            new = [] if value in _NULL else ["prefix_cache=on", f"{plus}engine.prefix_cache.hash_block={value}"]
        elif key == "rollout.kv_budget_tokens":
            new = [] if value in _NULL else [f"kv_budget={policy}", f"{plus}engine.kv_budget.budget_tokens={value}"]
        elif key == "rollout.kv_policy":
            new = []
        elif key == "rollout.max_concurrency" and value.strip("'\"") == "auto":
            new = [f"{plus}rollout.max_concurrency=null"]
        else:
            out.append(arg)
            continue
        if key == "rollout.kv_policy":
            instead = (f"kv_budget={value} (selected with rollout.kv_budget_tokens' replacement)" if budget else
                       f"nothing: without rollout.kv_budget_tokens it selected no KV budget (kv_budget={value} "
                       f"engine.kv_budget.budget_tokens=N selects one)")
        else:
            instead = " ".join(new) or "nothing (null is the default: off)"
        warnings.warn(f"{arg} is deprecated (the old form goes in the next release): use {instead}",
                      DeprecatedKeyWarning, stacklevel=2)
        out.extend(new)
    _check_optional_groups(out)
    return out


def _check_optional_groups(overrides: list[str]) -> None:
    """The engine's prefix cache and KV budget are null until their group is selected, and OmegaConf
    cannot set a key inside null: name the selection instead of its "Unexpected type for root"."""
    selected = {m[2] for m in map(_OVERRIDE.match, overrides) if m and "." not in m[2]}
    for arg in overrides:
        m = _OVERRIDE.match(arg)
        for group, option in (("prefix_cache", "on"), ("kv_budget", "h2o|infinigen")):
            if m and m[2].startswith(f"engine.{group}.") and group not in selected:
                raise ValueError(f"{arg}: engine.{group} is off (null) unless its group is selected; select it "
                                 f"first: {group}={option} {arg}")


def upgrade_stored_config(tree: dict) -> dict:
    """A run config as an older version stored it (a checkpoint's run_config.json: rollout and memory
    holding the engine's knobs) in today's layout, as `resolved_config` would write it now: the
    engine's other knobs at the values that version's build() used (the EngineConfig defaults), its
    prefix cache salted PREFIX_CACHE_MODEL_ID. A tree with an `engine` group is returned as is."""
    tree = copy.deepcopy(tree)
    if "tokenizer" in tree.get("task", {}) and "tokenizer" not in tree:  # task.tokenizer -> tokenizer.path
        tree["tokenizer"] = {"path": tree["task"].pop("tokenizer")}
    if "engine" in tree:
        return tree
    rollout = tree.get("rollout", {})
    moved = {}
    for old, new in RENAMED_KEYS.items():
        if not new.startswith("engine."):
            continue
        group, key = old.split(".")
        if key in tree.get(group, {}):
            moved[new.split(".")[1]] = tree[group].pop(key)
    hash_block, budget = rollout.pop("prefix_hash_block", None), rollout.pop("kv_budget_tokens", None)
    policy = rollout.pop("kv_policy", "h2o")
    engine = EngineConfig(**moved, prefix_cache=None if hash_block is None else PrefixCacheConfig(
        hash_block=hash_block, model_id=PREFIX_CACHE_MODEL_ID),
        kv_budget=None if budget is None else KVBudgetConfig(budget_tokens=budget, policy=policy))
    tree["engine"] = json.loads(json.dumps(asdict(engine), default=str))
    if rollout.get("max_concurrency") == "auto":
        rollout["max_concurrency"] = None
    return tree
