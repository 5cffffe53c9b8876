"""The loop's NVMe traffic with memory.spill_dir: each optimizer state is written once (offload) and
read once (restore) per iteration; the checkpoint reads the states from host memory, before the
offload, never from the spill."""
import json
from pathlib import Path

from rl.train import run
from tests.rl.test_config import composed

SMALL = ["tracking.wandb_mode=disabled", "tracking.progress=false", "rollout.groups_per_iteration=4",
         "algo.group_size=4", "rollout.max_new_tokens=3"]


def test_a_spilled_run_writes_and_reads_each_state_once_per_iteration(tmp_path: Path):
    run(composed(f"run_dir={tmp_path}", "experiment.iterations=3", "memory.spill_dir=nvme", *SMALL))
    phases = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
    by_iteration = {}
    for r in phases:
        by_iteration.setdefault(r["iteration"], []).append(r)
    state_bytes = None
    for it, recs in sorted(by_iteration.items()):
        names = [r["phase"] for r in recs]
        assert names.index("checkpoint") < names.index("offload"), names
        offload = next(r for r in recs if r["phase"] == "offload")
        checkpoint = next(r for r in recs if r["phase"] == "checkpoint")
        # the checkpoint ran with every state resident: nothing of them on disk, all in host memory
        assert checkpoint["memory"]["disk_spilled"] == 0 and checkpoint["memory"]["host_masters"] > 0
        assert offload["memory"]["host_masters"] == 0 and offload["memory"]["disk_spilled"] > 0
        state_bytes = state_bytes or offload["bytes_moved"]
        assert offload["bytes_moved"] == state_bytes > 0  # every state, once
        restores = [r for r in recs if r["phase"] == "restore"]
        # read back once per iteration that follows a spill (the first iteration starts resident)
        assert [r["bytes_moved"] for r in restores] == ([] if it == 0 else [state_bytes])
        # no other phase moves the states: the NVMe traffic is exactly one write and one read
        others = [r["phase"] for r in recs if r["bytes_moved"] and r["phase"] not in ("offload", "restore", "sleep")]
        assert others == [], others
