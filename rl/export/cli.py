"""`python -m rl.export run_dir=<dir> [iteration=N] [dtype=bf16] [max_shard_size=5GB] [out=<dir>] [tokenizer=<dir>|byte]`

Exports one published checkpoint of an RL run as a Hugging Face `kimi_linear` directory
(rl/export/__init__.py: the files). Arguments are key=value, like rl.train's:

    run_dir         the run (its checkpoints are run_dir/checkpoints/iter_N); required
    iteration       which checkpoint; default: the newest that verifies against its manifest (as a resume
                    picks it); a named one must exist and verify
    dtype           the weights' dtype: bf16 (default) or fp32
    max_shard_size  the most bytes of one safetensors file: 5GB (default), 500MB, 2GiB, a byte count
    out             the directory to create (absent or empty); default run_dir/export/iter_N
    tokenizer       default: the run's tokenizer.path (a directory's files are copied; byte: none)

Exit status 0 on success, 2 on a bad argument or a checkpoint that cannot be exported (one line on
stderr naming the value); nothing is left under `out` then.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path

from rl.run.checkpoint import CheckpointDamaged, checkpoint_name, complete_checkpoints, find_resumable, verify
from rl.export import ExportError, export_checkpoint, parse_size


@dataclass(frozen=True, kw_only=True)
class ExportArgs:
    run_dir: str
    """The run directory."""
    iteration: int | None = None
    """The checkpoint's iteration; None = the newest that verifies."""
    dtype: str = "bf16"
    """"bf16" or "fp32"."""
    max_shard_size: str = "5GB"
    """Most bytes per safetensors file."""
    out: str | None = None
    """Output directory; None = run_dir/export/iter_N."""
    tokenizer: str | None = None
    """"byte" or a tokenizer directory; None = the run's."""


def parse_args(argv: list[str]) -> ExportArgs:
    """key=value arguments -> ExportArgs; ExportError naming the bad argument."""
    known = [f.name for f in fields(ExportArgs)]
    values: dict[str, object] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in known:
            raise ExportError(f"argument {arg!r}, expected key=value with key one of {', '.join(known)}")
        values[key] = value
    if not values.get("run_dir"):
        raise ExportError("run_dir is missing: python -m rl.export run_dir=<the run's directory> ...")
    if values.get("iteration") in ("latest", "", None):
        values.pop("iteration", None)
    else:
        try:
            values["iteration"] = int(values["iteration"])
        except ValueError:
            raise ExportError(f"iteration={values['iteration']!r}, expected an integer or latest") from None
    return ExportArgs(**values)


def pick_checkpoint(run_dir: Path, iteration: int | None, say=print) -> Path:
    """The checkpoint directory to export: `iteration`'s (which must exist and verify), or the newest
    that verifies (skipped ones reported through `say`). ExportError naming what is missing."""
    if not run_dir.is_dir():
        raise ExportError(f"run_dir={str(run_dir)!r} is not a directory")
    checkpoint_dir = run_dir / "checkpoints"
    have = complete_checkpoints(checkpoint_dir)
    if not have:
        raise ExportError(f"run_dir={str(run_dir)!r} holds no complete checkpoint ({checkpoint_dir}/iter_N)")
    if iteration is None:
        try:
            return find_resumable(checkpoint_dir, say)
        except CheckpointDamaged as err:
            raise ExportError(str(err)) from None
    if iteration not in have:
        raise ExportError(f"iteration={iteration}: no checkpoint {checkpoint_name(iteration)} in {checkpoint_dir}; "
                          f"available: {', '.join(str(i) for i in sorted(have))}")
    reason = verify(have[iteration])
    if reason is not None:
        raise ExportError(f"iteration={iteration}: checkpoint {have[iteration]} does not verify against its "
                          f"manifest: {reason}")
    return have[iteration]


def run_command(name: str, doc: str, argv: list[str] | None, body, refused: tuple[type, ...] = (),
                ours: tuple[type, ...] = ()) -> int:
    """The shape of our `python -m` commands: `-h`/`--help` prints `doc`; `body(argv, err_say)` does the
    work and returns the exit status; an ExportError, FileNotFoundError or one of `refused` becomes
    one line `<name>: ...` on stderr (the type named unless ExportError or one of `ours`), exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(doc)
        return 0
    err_say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    try:
        return body(argv, err_say)
    except (ExportError, FileNotFoundError, *refused) as err:
        plain = isinstance(err, (ExportError, *ours))
        err_say(f"{name}: {err}" if plain else f"{name}: {type(err).__name__}: {err}")
        return 2


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit status (0 exported, 2 refused)."""
    return run_command("rl.export", __doc__, argv, _export)


def _export(argv: list[str], err_say) -> int:
    args = parse_args(argv)
    max_shard_bytes = parse_size(args.max_shard_size)
    run_dir = Path(args.run_dir)
    checkpoint = pick_checkpoint(run_dir, args.iteration, err_say)
    out = Path(args.out) if args.out else run_dir / "export" / checkpoint.name
    out = export_checkpoint(checkpoint, out, dtype=args.dtype, max_shard_bytes=max_shard_bytes,
                            tokenizer=args.tokenizer)
    print(f"rl.export: wrote {out}\n" + (out / "README.txt").read_text(), end="")
    return 0
