"""Every `python -m rl.train` command of docs/your_own_task.md composes (keys and values valid), and
the export command's arguments parse; the steps themselves run in tests/rl/test_first_day.py."""
import re
import shlex
from pathlib import Path

from rl.export.cli import parse_args
from tests.rl.test_config import composed
from tests.tokenizer_dirs import build_bpe_tokenizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "your_own_task.md"


def commands(prefix: str) -> list[list[str]]:
    text = DOC.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    joined = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line)[len(prefix.split()):] for line in joined if line.startswith(prefix)]


def test_the_train_commands_compose(tmp_path):
    """The files the commands name are made here (a jsonl, a tokenizer directory): composition checks
    that they exist."""
    train = commands("python -m rl.train")
    assert len(train) == 2
    (tmp_path / "train.jsonl").write_text('{"prompt": "What is 2+3?", "label": "5"}\n')
    build_bpe_tokenizer(tmp_path / "my_tokenizer")
    for args in train:
        here = {"train.jsonl": str(tmp_path / "train.jsonl"), "my_tokenizer": str(tmp_path / "my_tokenizer")}
        args = [a.replace("train.jsonl", here["train.jsonl"]).replace("my_tokenizer", here["my_tokenizer"]) for a in args]
        cfg = composed(*args)
        assert cfg.task.name == "scored" and cfg.algo.ppo_epochs == 2 and cfg.tokenizer.path.endswith("my_tokenizer")
        assert cfg.trainer.optimizer.lr_schedule == "cosine"


def test_the_export_command_parses():
    (export,) = commands("python -m rl.export")
    options = parse_args(export)
    assert options.dtype == "bf16" and options.out == "exports/my_task" and options.max_shard_size == "5GB"
