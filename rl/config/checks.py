"""Config checks that need more than the composed values: the command line's overrides (an optional
group's keys set without selecting it), the number of ranks, the loaded tokenizer. Each raises
ValueError naming the key and what to set; RunConfig.__post_init__ holds the checks across groups
that the values alone decide. `cfg` is a RunConfig (rl/config/__init__.py, which imports this module)."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

_OVERRIDE = re.compile(r"^(\+{0,2})([A-Za-z_][\w.]*)=(.*)$")
OPTIONAL_GROUPS = {"prefix_cache": "on", "kv_budget": "h2o|infinigen"}
"""The engine's optional nodes (null until their group is selected) and their options."""


def task_params_overrides(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """`task.params.<key>=<value>` as `++task.params.<key>=<value>`: a task's keywords are its constructor's,
    not the schema's, so any of them may be set whether its group file lists it or not (TaskConfig builds
    the task with them: an unknown one is refused there, naming it)."""
    return [f"++{arg}" if re.match(r"^task\.params\.[\w.]+=", arg) else arg for arg in overrides]


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


def task_reads_rows(name: str) -> bool:
    """Task `name`'s environments take a data row (`reset(seed, row=...)`), as the driver passes it."""
    from rl.envs.tasks import resolve_task

    factory = resolve_task(name)
    reset = getattr(factory, "reset", None)
    try:
        return reset is None or "row" in inspect.signature(reset).parameters
    except (TypeError, ValueError):
        return True


def check_world(cfg, world: int) -> None:
    """The rules that depend on the number of data-parallel ranks (`world`: WORLD_SIZE at
    composition, the run's ranks when its parts are built)."""
    if world % cfg.parallel.context:
        raise ValueError(f"parallel.context={cfg.parallel.context} does not divide the {world} rank(s) of the run; "
                         f"expected a divisor of the world size (world = data-parallel ranks x parallel.context)")
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


LABELS_SAMPLED = 10_000
"""The training rows whose labels size a scored task's answers (the first ones of the files)."""


_TOKENIZERS: dict[str, object] = {}


def _tokenizer(config):
    """The tokenizer of `config`, loaded once per process (a config is composed more than once)."""
    from models.tokenizer import load_tokenizer

    path = Path(str(getattr(config, "path", "")))
    key = repr(config) + (f"@{path.stat().st_mtime_ns}" if path.exists() else "")
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(config)
    return _TOKENIZERS[key]


def check_inputs(cfg) -> int | None:
    """The composition-time checks of what the run reads: the tokenizer loads and fits the model
    (`check_tokenizer`), every row of every data file has its columns and a well-formed prompt
    (rl/envs/data.py `load_rows`; the build reuses what was read). Returns the answer length when
    rollout.max_new_tokens is null: the task's (`answer_tokens`, an int or a function of the training
    rows and the tokenizer's encode, as the scored task sizes them from the labels); else None."""
    from dataclasses import replace

    from rl.envs.data import load_rows
    from rl.envs.tasks import resolve_task

    tokenizer = _tokenizer(cfg.tokenizer)
    check_tokenizer(cfg, tokenizer)
    rows = None
    for key in ("train_files", "val_files"):
        files = list(getattr(cfg.data, key))
        if files:
            try:
                loaded = load_rows(files, replace(cfg.data, max_prompt_tokens=None)).rows
            except ValueError as err:
                raise ValueError(f"data.{key}: {err}") from None
            rows = loaded if key == "train_files" else rows
    if cfg.rollout.max_new_tokens is not None:
        return None
    answer = getattr(resolve_task(cfg.task.name), "answer_tokens", None)
    if callable(answer) and rows is not None:
        answer = answer(rows[:LABELS_SAMPLED], lambda text: tokenizer.encode(text, add_bos=False))
    if not isinstance(answer, int) or isinstance(answer, bool) or answer < 1:
        raise ValueError(f"rollout.max_new_tokens=null takes the task's answer length, but task.name={cfg.task.name!r} "
                         f"states none (an `answer_tokens` attribute); set rollout.max_new_tokens=<tokens per turn>")
    return min(answer, cfg.engine.max_model_len // 2)


def check_algo(cfg) -> None:
    """The algorithm's rules across groups: what context parallelism, expert parallelism and the rollout's
    knobs leave room for; the Dr. GRPO normaliser's default (rollout.max_new_tokens) filled in."""
    from dataclasses import replace

    a, r = cfg.algo, cfg.rollout
    if cfg.parallel.context > 1:
        whole = [name for name, on in (
            (f"algo.advantage={a.advantage}", a.token_level), ("algo.kl_in_reward.coef > 0", a.kl_in_reward.coef > 0),
            ("algo.loss.policy_loss=gspo", a.loss.policy_loss == "gspo"),
            ("algo.loss.rollout_is_level=sequence", a.loss.rollout_is_level == "sequence"),
            ("algo.critic.enable=true", a.critic.enable)) if on]
        if whole:
            raise ValueError(f"parallel.context={cfg.parallel.context} with {', '.join(whole)}: these read whole "
                             f"sequences (token-level returns, a sequence ratio), which context parallelism splits over "
                             f"ranks; expected parallel.context=1 with them (or an outcome estimator, token-level losses)")
    if a.critic.enable and cfg.parallel.expert > 1:
        raise ValueError(f"algo.critic.enable=true with parallel.expert={cfg.parallel.expert}: the critic is built "
                         f"whole on every rank for now; expected parallel.expert=1 for PPO with a critic")
    if a.filter_groups.enable:
        if r.max_groups_in_flight is not None or r.budget_tokens is not None or r.budget_seconds is not None:
            raise ValueError(f"algo.filter_groups.enable=true refills the batch by starting more groups, but "
                             f"rollout.max_groups_in_flight={r.max_groups_in_flight}, budget_tokens={r.budget_tokens}, "
                             f"budget_seconds={r.budget_seconds} leave it no headroom (a cap on groups in flight, "
                             f"partial rollouts carried across rounds); expected all three null with dynamic sampling")
    if a.overlong.enable and a.overlong.buffer_tokens > r.max_new_tokens:
        raise ValueError(f"algo.overlong.buffer_tokens={a.overlong.buffer_tokens} exceeds rollout.max_new_tokens="
                         f"{r.max_new_tokens} (the limit it buffers); expected at most {r.max_new_tokens}")
    if a.loss.aggregation == "seq-mean-token-sum-norm" and a.loss.agg_norm_tokens is None:
        loss = replace(a.loss, agg_norm_tokens=r.max_new_tokens)
        object.__setattr__(cfg, "algo", replace(a, loss=loss))
