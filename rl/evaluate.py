"""`python -m rl.evaluate run_dir=<dir> [iteration=N] [out=<dir>] [key=value ...]`

Evaluates one published checkpoint of an RL run on its held-out prompts, outside the run: the run's
stored config (the checkpoint's run_config.json) with the given overrides, the checkpoint's weights
in a fresh engine, one evaluation as the loop's `eval` phase does it (rl/episodes/validation.py).

    run_dir     the run (its checkpoints are run_dir/checkpoints/iter_N); required
    iteration   which checkpoint; default: the newest that verifies (as a resume picks it)
    out         where the generations (val/iter_N.jsonl) and metrics (metrics_iter_N.json) go;
                default run_dir/evaluate
    key=value   any key of the run's config but model.* (the weights fix it), e.g. eval.n=8
                eval.temperature=0 eval.num_prompts=500 data.val_files=[test.jsonl]
                tokenizer.stop_strings=[...] engine.pool_mb=64; checked as at composition

Prints the `val/...` metrics, one per line. Exit status 0 on success, 2 on a bad argument or
checkpoint (one line on stderr naming the value); nothing is written then.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from memory.durable import write_durable
from models.checkpoint import load_checkpoint
from models.tokenizer import load_tokenizer
from rl.run.checkpoint import RUN_CONFIG, checkpoint_info
from rl.config import RunConfig
from rl.config.compose import to_run_config, writable
from rl.envs.data import load_rows
from rl.episodes.env_runner import EnvRunner
from rl.episodes.runner import render_prompt
from rl.export.cli import pick_checkpoint, run_command
from rl.episodes.validation import evaluate
from rl.run.threads import machine_threads
from rollout.engine import Engine

OWN_ARGS = ("run_dir", "iteration", "out")


class EvaluateError(ValueError):
    """A bad argument or checkpoint (exit status 2)."""


def split_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(this command's own arguments, the config overrides); EvaluateError naming a malformed one."""
    own, overrides = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise EvaluateError(f"argument {arg!r}, expected key=value")
        if key.startswith("model.") or key == "model":
            raise EvaluateError(f"{arg!r}: the model is the checkpoint's; expected no model.* key")
        (own.__setitem__(key, value) if key in OWN_ARGS else overrides.append(arg))
    if not own.get("run_dir"):
        raise EvaluateError("run_dir is missing: python -m rl.evaluate run_dir=<the run's directory> ...")
    return own, overrides


def stored_config(checkpoint: Path, overrides: list[str]) -> RunConfig:
    """The run config a checkpoint was trained with, `overrides` applied
    and every value checked as at composition (ValueError naming a bad one)."""
    path = checkpoint / RUN_CONFIG
    if not path.exists():
        raise EvaluateError(f"{checkpoint} stores no {RUN_CONFIG} (written before run configs were stored): "
                            f"evaluate it from a run of this version")
    tree = json.loads(path.read_text())
    cfg = OmegaConf.structured(RunConfig)
    writable(cfg)  # frozen dataclasses make read-only nodes
    cfg = OmegaConf.merge(cfg, tree)
    for override in overrides:  # one at a time, so an error names its override
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override]))
        except Exception as err:  # omegaconf's key and validation errors: not a ValueError
            raise EvaluateError(f"{override!r}: {str(err).splitlines()[0]}") from None
    return to_run_config(cfg)


def run_evaluation(run_dir: str | Path, iteration: int | None = None, overrides: list[str] = (),
                   out: str | Path | None = None, say=print) -> tuple[Path, dict[str, float]]:
    """Evaluate the checkpoint (module docstring); (the dump's directory, the metrics)."""
    run_dir = Path(run_dir)
    checkpoint = pick_checkpoint(run_dir, iteration, say)
    cfg = stored_config(checkpoint, list(overrides))
    it = checkpoint_info(checkpoint)["iteration"]
    out = Path(out) if out is not None else run_dir / "evaluate"
    threads = cfg.experiment.num_threads or machine_threads()[0]  # as rl.train chooses them
    if threads is not None:
        torch.set_num_threads(threads)
    tokenizer = load_tokenizer(cfg.tokenizer)
    rows = None
    if cfg.data.val_files:
        rows = load_rows(cfg.data.val_files, cfg.data, lambda p: render_prompt(tokenizer, p)).rows
    model = load_checkpoint(checkpoint, cfg.experiment.torch_dtype)
    engine = Engine(model, cfg.engine, detokenize=tokenizer.decode, seed=cfg.seed)
    runner = EnvRunner(cfg.env.workers, cfg.env.timeout_s) if cfg.env.workers else None  # as the run's
    try:
        metrics = evaluate(engine, tokenizer, cfg.task.name, cfg.task.params, replace(cfg.eval, dump=True),
                           seed=cfg.seed, iteration=it, out_dir=out, rollout_max_new_tokens=cfg.rollout.max_new_tokens,
                           env_timeout_s=cfg.env.timeout_s, rows=rows, runner=runner)
    finally:
        if runner is not None:
            runner.close()
    write_durable(out / f"metrics_iter_{it}.json", (json.dumps(metrics, indent=1, sort_keys=True) + "\n").encode())
    return out, metrics


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit status (0 evaluated, 2 refused)."""
    return run_command("rl.evaluate", __doc__, argv, _evaluate, refused=(ValueError,), ours=(EvaluateError,))


def _evaluate(argv: list[str], err_say) -> int:
    own, overrides = split_args(argv)
    iteration = own.get("iteration")
    if iteration in (None, "", "latest"):
        iteration = None
    elif not iteration.isdigit():
        raise EvaluateError(f"iteration={iteration!r}, expected an integer or latest")
    out, metrics = run_evaluation(own["run_dir"], None if iteration is None else int(iteration), overrides,
                                  own.get("out"), err_say)
    for key in sorted(metrics):
        print(f"{key} {metrics[key]:.6g}")
    print(f"rl.evaluate: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
