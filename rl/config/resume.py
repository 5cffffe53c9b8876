"""The rules a run's start checks against what is on disk: a resume's config against the one its
checkpoint stored (only RESUME_MAY_CHANGE may differ), the weights' dtype of a start or resume
checkpoint against experiment.dtype, a start checkpoint's model against the `model` group."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from models.checkpoint import checkpoint_dtype
from models.config import ModelConfig
from models.precision import DTYPES, dtype_name
from rl.config import RunConfig, task_params
from rl.config.compose import NO_DEFAULT, schema_default
from rl.run.checkpoint import RUN_CONFIG


RESUME_MAY_CHANGE = ("experiment.iterations", "experiment.collective_timeout_s", "experiment.max_idle_iterations",
                     "tracking.", "checkpoint.", "rollout.budget_tokens", "rollout.budget_seconds",
                     "rollout.max_drop_fraction", "env.timeout_s", "env.workers", "env.max_retries",
                     "env.backoff_s", "resume", "run_dir",
                     "experiment.checkpoint", "experiment.num_threads", "warmup.", "eval.",
                     "parallel.expert", "sandbox.backend")
"""Config keys (or prefixes, ending in ".") a resume may change: how long and how loudly the run goes
on, its checkpoints' cadence, its budgets and fault limits, its CPU threads (and experiment.checkpoint
and the warm-up, read only by a new run), and how the experts are split (parallel.expert: a checkpoint
loads at any expert-parallel size), and the sandbox's backend. Any other change is refused."""


def resolved_config(cfg: RunConfig) -> dict:
    """The run's config as plain JSON values (what the tracker logs and each checkpoint stores), the
    task's params complete: every constructor keyword with the value it runs with."""
    return _complete_task(json.loads(json.dumps(asdict(cfg), default=str)))


def _complete_task(tree: dict) -> dict:
    """`tree` (a resolved config) with task.params completed by the task constructor's defaults."""
    task = tree.get("task")
    if isinstance(task, dict) and isinstance(task.get("name"), str):
        task["params"] = json.loads(json.dumps(task_params(task["name"], task.get("params") or {}), default=str))
    return tree


def _flatten(tree, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def check_checkpoint_model(cfg: RunConfig) -> None:
    """Refuse experiment.checkpoint when its config.json describes another model than the `model`
    group (every differing field named: a shape-preserving difference such as rms_norm_eps or the
    routing scale would otherwise load silently)."""
    path = Path(cfg.experiment.checkpoint)
    stored = path / "config.json"
    if not stored.exists():
        raise FileNotFoundError(f"experiment.checkpoint={str(path)!r} has no config.json (a Hugging Face checkpoint "
                                f"directory is expected)")
    theirs = asdict(ModelConfig.from_hf_dict(json.loads(stored.read_text())))
    ours = asdict(cfg.model)
    diff = [f"{k}: {theirs[k]!r} in the checkpoint, {ours.get(k)!r} in the model group"
            for k in sorted(theirs) if theirs[k] != ours.get(k)]
    if diff:
        raise ValueError(f"experiment.checkpoint={str(path)!r} is another model than the config's `model` group: "
                         + "; ".join(diff) + ". Choose the model group that matches it (or override those keys)")


def check_config_drift(cfg: RunConfig, resume_path: Path) -> None:
    """Refuse a resume whose config differs from the one the checkpoint was written with, outside
    RESUME_MAY_CHANGE, naming every differing key with both values. A checkpoint from before configs
    were stored is resumed with a warning. A key the stored config lacks (a knob added since, a task
    param it left at the constructor's default) is compared at today's default, the behaviour the
    checkpoint ran with."""
    stored = resume_path / RUN_CONFIG
    if not stored.exists():
        print(f"WARNING: {resume_path} stores no run config (written before {RUN_CONFIG}); the resume cannot "
              f"check that the config is unchanged", file=sys.stderr)
        return
    before, now = _flatten(_complete_task(json.loads(stored.read_text()))), _flatten(resolved_config(cfg))
    for key in now.keys() - before.keys():  # a knob added since: the checkpoint ran with its default
        default = schema_default(key)
        if default is not NO_DEFAULT:
            before[key] = default
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k, "<absent>") != now.get(k, "<absent>")
                     and not any(k == w or (w.endswith(".") and k.startswith(w)) for w in RESUME_MAY_CHANGE))
    if changed:
        diff = "; ".join(f"{k}: {before.get(k, '<absent>')!r} in the checkpoint, {now.get(k, '<absent>')!r} now"
                         for k in changed)
        raise ValueError(f"resume from {resume_path} with a changed config: {diff}. A resume may change only "
                         f"{', '.join(RESUME_MAY_CHANGE)}; start a new run_dir (experiment.checkpoint=<a "
                         f"checkpoint's dir> starts from its weights) to change anything else")


def check_checkpoint_dtypes(cfg: RunConfig, resume_path: Path | None) -> None:
    """Refuse, before anything is built or written, a start checkpoint (experiment.checkpoint) or a run
    checkpoint to resume whose weights' dtype is not experiment.dtype."""
    want = cfg.experiment.torch_dtype
    if cfg.experiment.checkpoint is not None:
        have = checkpoint_dtype(cfg.experiment.checkpoint)
        if have is not None and have != want:
            raise ValueError(f"experiment.checkpoint={cfg.experiment.checkpoint!r} holds {have} weights but "
                             f"experiment.dtype={cfg.experiment.dtype!r} ({want}); set experiment.dtype to the "
                             f"checkpoint's ({dtype_name(have) if have in DTYPES.values() else have}) or convert it")
    if resume_path is not None:
        meta = json.loads((resume_path / "trainer.json").read_text())
        saved = meta.get("dtype", "fp32")  # written before the dtype knob existed: fp32
        if saved != cfg.experiment.dtype:
            raise ValueError(f"run_dir {str(cfg.run_dir)!r} was trained with experiment.dtype={saved!r}; resuming it "
                             f"with experiment.dtype={cfg.experiment.dtype!r} is refused (its optimizer state and "
                             f"weights are those of a {saved} run): pass experiment.dtype={saved}")
