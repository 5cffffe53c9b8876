"""`python -m rl.data <the run's arguments>`: check and preview the rows a run will train and validate on
(`preview`); exit status 0, or 2 with one line naming the bad value."""
import sys

from models.tokenizer import load_tokenizer
from rl.config.compose import compose_run_config
from rl.config.checks import check_tokenizer
from rl.envs.data import LABEL, PROMPT, load_rows
from rl.envs.tasks import make_task
from rl.episodes.runner import render_prompt


def preview(overrides: list[str], say=print, sample_rows: int = 100) -> dict[str, dict[str, float]]:
    """`python -m rl.data`: the run config of `overrides` composed (every check of rl.train), its
    training and validation rows loaded as the run loads them, and per split: rows kept, rows dropped
    as too long, prompt tokens (min / mean / max), the first prompt as the model receives it; with
    task=scored, the mean reward of each label given as the answer (a reward that does not accept
    its own labels is worth knowing before training). Returns the figures per split."""
    cfg = compose_run_config(overrides)
    if not cfg.data.train_files and not cfg.data.val_files:
        raise ValueError("data.train_files and data.val_files are empty: expected the files to check")
    tokenizer = load_tokenizer(cfg.tokenizer)
    check_tokenizer(cfg, tokenizer)  # as rl.train's build does: the same refusal, before any row is read

    def encode(prompt):
        return render_prompt(tokenizer, prompt)

    figures = {}
    for split, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        if not files:
            continue
        loaded = load_rows(files, cfg.data, encode)
        lengths = [len(encode(r[PROMPT])) for r in loaded.rows]
        out = {"rows": len(loaded.rows), "dropped_too_long": loaded.num_dropped_too_long,
               "prompt_tokens_min": min(lengths), "prompt_tokens_mean": sum(lengths) / len(lengths),
               "prompt_tokens_max": max(lengths)}
        if cfg.task.name == "scored":
            task, scores = make_task(cfg.task.name, **cfg.task.params), []
            for i, row in enumerate(loaded.rows[:sample_rows]):
                task.reset(i, row=row)
                scores.append(task.step(str(row[LABEL])).reward)
            out["reward_of_label_as_answer"] = sum(scores) / len(scores)
        figures[split] = out
        say(f"{split}: {', '.join(files)}")
        say("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))
        first = loaded.rows[0]
        say(f"  first prompt as the model receives it ({lengths[0]} tokens):\n"
            + "\n".join("    | " + line for line in tokenizer.decode(encode(first[PROMPT])).splitlines())
            + f"\n  its label: {first[LABEL]!r}")
    return figures


def main(argv: list[str] | None = None) -> int:
    """The command; exit status 0 (checked), 2 (a bad value, named on stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(preview.__doc__)
        return 0
    try:
        preview(argv)
    except Exception as err:  # config and data errors of every type: one line, no traceback
        print(f"rl.data: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
