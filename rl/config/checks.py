"""Config checks that need more than the composed values: the command line's overrides (an optional
group's keys set without selecting it), the number of ranks, the loaded tokenizer. Each raises
ValueError naming the key and what to set; RunConfig.__post_init__ holds the checks across groups
that the values alone decide. `cfg` is a RunConfig (rl/config/__init__.py, which imports this module)."""
from __future__ import annotations

import re

_OVERRIDE = re.compile(r"^(\+{0,2})([A-Za-z_][\w.]*)=(.*)$")
OPTIONAL_GROUPS = {"prefix_cache": "on", "kv_budget": "h2o|infinigen"}
"""The engine's optional nodes (null until their group is selected) and their options."""


def check_optional_groups(overrides: list[str] | tuple[str, ...]) -> None:
    """The engine's prefix cache and KV budget are null until their group is selected, and OmegaConf
    cannot set a key inside null: name the selection instead of its "Unexpected type for root"."""
    parsed = [_OVERRIDE.match(arg) for arg in overrides]
    selected = {m[2] for m in parsed if m and "." not in m[2]}
    for arg, m in zip(overrides, parsed):
        for group, option in OPTIONAL_GROUPS.items():
            if m and m[2].startswith(f"engine.{group}.") and group not in selected:
                raise ValueError(f"{arg}: engine.{group} is off (null) unless its group is selected; select it "
                                 f"first: {group}={option} {arg}")


def check_world(cfg, world: int) -> None:
    """The rules that depend on the number of data-parallel ranks (`world`: WORLD_SIZE at
    composition, the run's ranks when its parts are built)."""
    if world % cfg.parallel.expert:
        raise ValueError(f"parallel.expert={cfg.parallel.expert} does not divide the {world} rank(s) of the run; "
                         f"expected a divisor of the world size (torchrun --nproc_per_node x nodes)")
    if world > 1 and cfg.algo.mini_batches > 1:
        raise ValueError(f"algo.mini_batches={cfg.algo.mini_batches} with {world} ranks: each mini-batch is "
                         f"normalised by its own counts, which needs one rank for now; expected algo.mini_batches=1 "
                         f"(algo.ppo_epochs works on several ranks)")


def check_tokenizer(cfg, tokenizer) -> None:
    """The loaded tokenizer fits the model: every id it produces has an embedding row."""
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer.path={cfg.tokenizer.path!r} has {tokenizer.vocab_size} tokens but the model's "
                         f"vocab_size is {cfg.model.vocab_size}: ids past it have no embedding; expected a tokenizer "
                         f"of at most {cfg.model.vocab_size} tokens (or a model config that matches it)")


def check_sandbox(cfg) -> None:
    """Make `sandbox.backend` the process's sandbox backend, and refuse (SandboxUnavailable, one line saying
    what to install or enable) a task that runs model-written code when that backend cannot run here."""
    from rl.envs.tasks import resolve_task
    from rl.envs.tools.sandbox import check_backend, set_default_backend

    set_default_backend(cfg.sandbox.backend)
    if getattr(resolve_task(cfg.task.name), "uses_sandbox", False):
        check_backend(cfg.sandbox.backend)
