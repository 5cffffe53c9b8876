"""docs/your_own_task.md runs as written: every command of its ```bash blocks, in order, in a fresh
directory holding the files it names (train.jsonl, val.jsonl, reward.py, a tokenizer directory),
each a real `python -m ...` process; the training commands get small sizes appended (2 groups of 2,
3 new tokens, 2 validation prompts) and nothing else changes."""
import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tokenizer_dirs import build_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "your_own_task.md"
SMALL = ["rollout.groups_per_iteration=2", "algo.group_size=2", "rollout.max_new_tokens=3", "eval.num_prompts=2",
         "tracking.wandb_mode=disabled", "tracking.progress=false", "tracking.plots=false", "experiment.num_threads=1"]


def commands() -> list[list[str]]:
    """The page's shell commands, continuation lines joined, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    return [shlex.split(line) for block in blocks for line in block.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def write_user_files(where: Path) -> None:
    rng = random.Random(0)
    for name, count in (("train.jsonl", 16), ("val.jsonl", 4)):
        with open(where / name, "w") as f:
            for _ in range(count):
                a, b = rng.randint(0, 4), rng.randint(0, 4)
                f.write(json.dumps({"prompt": f"What is {a}+{b}?", "label": str(a + b), "level": 1}) + "\n")
    reward = re.search(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[1]  # the page's own reward.py
    (where / "reward.py").write_text(reward)
    build_bpe_tokenizer(where / "my_tokenizer")


@pytest.mark.slow
def test_every_command_of_the_page_runs(tmp_path):
    write_user_files(tmp_path)
    cmds = commands()
    modules = [c[2] for c in cmds]
    assert modules == ["rl.data", "rl.train", "rl.train", "rl.evaluate", "rl.export"], modules
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    outputs = {}
    for cmd in cmds:
        assert cmd[:2] == ["python", "-m"]
        args = cmd[3:] + (SMALL if cmd[2] == "rl.train" else [])
        done = subprocess.run([sys.executable, "-m", cmd[2], *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs.setdefault(cmd[2], []).append(done.stdout)
    assert "train: train.jsonl" in outputs["rl.data"][0] and "reward_of_label_as_answer=1" in outputs["rl.data"][0]
    assert "rows=16" in outputs["rl.data"][0] and "rows=4" in outputs["rl.data"][0]
    run = tmp_path / "runs" / "my_task"
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*"))[-1] == "iter_000003"  # resumed: 4 in all
    assert (run / "evaluate" / "metrics_iter_3.json").exists() and "val/pass@1" in outputs["rl.evaluate"][0]
    assert (tmp_path / "exports" / "my_task" / "config.json").exists()
