"""docs/your_own_task.md runs as written, in an empty directory: each ```python block is saved under the
name on its first line (make_data.py, reward.py, make_tokenizer.py), and every command of its ```bash
blocks runs in order, exactly as printed (`python` is this interpreter), as a real process: nothing is
appended, and the environment carries no WANDB_MODE and no OMP_NUM_THREADS (wandb logs offline, the
threads are chosen from the machine)."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "your_own_task.md"


def commands() -> list[list[str]]:
    """The page's shell commands, continuation lines joined, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    return [shlex.split(line) for block in blocks for line in block.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def files() -> dict[str, str]:
    """The page's Python files: each ```python block whose first line is `# <name>.py`."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    named = {m[1]: block for block in blocks if (m := re.match(r"# (\S+\.py)\n", block))}
    assert len(named) == len(blocks), "every python block of the page names its file on its first line"
    return named


@pytest.mark.slow
def test_every_command_of_the_page_runs_as_printed(tmp_path):
    for name, text in files().items():
        (tmp_path / name).write_text(text)
    cmds = commands()
    assert [c[1] if c[1] != "-m" else c[2] for c in cmds] == [
        "make_data.py", "make_tokenizer.py", "rl.data", "rl.train", "rl.train", "rl.evaluate", "rl.export"], cmds
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "OMP_NUM_THREADS", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(ROOT)
    outputs: dict[str, list[str]] = {}
    for cmd in cmds:
        assert cmd[0] == "python"
        done = subprocess.run([sys.executable, *cmd[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs.setdefault(cmd[2] if cmd[1] == "-m" else cmd[1], []).append(done.stdout)
    data = outputs["rl.data"][0]
    assert "train: train.jsonl" in data and "reward_of_label_as_answer=1" in data
    assert "rows=40" in data and "rows=8" in data
    first = outputs["rl.train"][0]
    assert "CPU threads per rank" in first and "validation after the last update (iteration 3)" in first
    run = tmp_path / "runs" / "my_task"
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*"))[-1] == "iter_000003"  # resumed: 4 in all
    stored = json.loads((run / "checkpoints" / "iter_000003" / "run_config.json").read_text())
    assert stored["rollout"]["max_new_tokens"] == 8  # from the labels (one token each): the stated floor of 8
    assert list((run / "wandb").glob("offline-run-*")), "wandb logged offline under run_dir"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_val/iteration"] == 4 and summary["final_val/num_prompts"] == 8
    assert (run / "evaluate" / "metrics_iter_3.json").exists() and "val/pass@1" in outputs["rl.evaluate"][0]
    export = tmp_path / "exports" / "my_task"
    config = json.loads((export / "config.json").read_text())
    assert config["eos_token_id"] == 1 and (export / "tokenizer.json").exists()  # the page's tokenizer's </s>
