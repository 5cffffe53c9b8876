"""Host DRAM time-multiplexed for real: one ledger budget too small for the training states
and the host KV pool together, larger than either; the run completes using both, the pool's
contents crossing the train phase on NVMe."""
import json
from pathlib import Path

import pytest

from memory.host_ledger import HostBudgetExceeded
from rl.plan.cli import make_plan
from rl.plan.cluster import ClusterConfig, PlanOptions
from rl.train import run
from tests.rl.test_config import composed
from tests.rl.test_plan import prompt_len

SMALL = ["experiment=single_turn", "tracking.wandb_mode=disabled", "tracking.progress=false",
         "rollout.groups_per_iteration=4", "algo.group_size=4", "rollout.max_new_tokens=6",
         "rollout.budget_tokens=40", "rollout.partial_resume=kv", "prefix_cache=on",
         "engine.prefix_cache.hash_block=16", "algo.loss.kl_coef=0"]
MiB = 1 << 20
BUDGET_MB, POOL_MB = 11, 6  # the tiny model's AdamW states are ~7.3 MiB


def phases(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "phases.jsonl").read_text().splitlines()]


def states(memory: dict) -> int:
    return memory["host_masters"] + memory["host_moments"]


def test_states_and_host_pool_take_turns_in_a_budget_that_cannot_hold_both(tmp_path):
    overrides = [*SMALL, "experiment.iterations=4", f"memory.host_budget_mb={BUDGET_MB}",
                 f"engine.host_pool_mb={POOL_MB}"]
    with pytest.raises(HostBudgetExceeded):  # without the spill, both stay: the budget is too small
        run(composed(f"run_dir={tmp_path / 'fixed'}", *overrides))
    cfg = composed(f"run_dir={tmp_path / 'mux'}", *overrides, "memory.spill_dir=nvme")
    history = run(cfg)
    records = phases(tmp_path / "mux")
    plan = make_plan(cfg, ClusterConfig(), PlanOptions(seq_len=prompt_len() + 6))
    pairs = []  # the planner follows the multiplexed loop, phase by phase: iteration 0 up to its
    trained = sorted({r["iteration"] for r in records if r["phase"] == "train"})
    assert trained and trained[0] < 3, "some iteration before the last should train"
    for it, plan_it in ((0, 0), (trained[0] + 1, 1)):  # update (its budget leaves no group finished), then the steady state
        ran = [r for r in records if r["iteration"] == it]
        planned = [p for p in plan.phases if p.iteration == plan_it]
        if it == 0:
            ran = ran[:ran.index(next(r for r in ran if r["phase"] == "restore")) + 1]
            planned = planned[:len(ran)]
        assert [p.phase for p in planned] == [r["phase"] for r in ran]
        pairs += zip(planned, ran)
    for p, r in pairs:
        want, got = p.memory, r["memory"]
        for k in ("host_pool", "host_masters", "disk_spilled", "device_pool", "device_weights"):
            assert want[k] == got[k], (r["iteration"], r["phase"], k, want[k], got[k])
        for k in ("host_parked", "disk_kv_pool"):  # the planner's figures are upper bounds of these
            assert got[k] <= want[k], (r["iteration"], r["phase"], k, got[k], want[k])
    steady = [r["memory"] for r in records if r["phase"] == "train"]
    assert max(states(m) for m in steady) > (BUDGET_MB - POOL_MB) * MiB, "the states alone must not fit beside the pool"
    for r in records:
        m = r["memory"]
        assert m["host_pool"] + states(m) <= BUDGET_MB * MiB, (r["iteration"], r["phase"])
        if r["phase"] in ("rollout", "sleep"):  # the pool is leased, the states are on NVMe
            assert POOL_MB * MiB * 0.99 < m["host_pool"] <= POOL_MB * MiB and states(m) == 0 and m["disk_spilled"] > 0
        if r["phase"] == "train":  # the states are back, the pool's DRAM returned, its contents on NVMe
            assert m["host_pool"] == 0 and m["host_masters"] > 0
    assert [r["phase"] for r in records if r["iteration"] == 1][:3] == ["host_in", "wake", "load_weights"]
    assert sum(h["trajectories_carried"] for h in history[:-1]) > 0, "the budget should leave work parked"
    moved_in = [r["bytes_moved"] for r in records if r["phase"] == "host_in"]
    moved_out = [r["bytes_moved"] for r in records if r["phase"] == "host_out"]
    assert moved_in[1:] == moved_out[:-1] and sum(moved_out) > 0, "what goes to NVMe comes back"
    assert any(r["memory"]["disk_kv_pool"] > 0 for r in records if r["phase"] == "train")


def test_an_auto_pool_takes_what_the_spilled_states_freed(tmp_path):
    run(composed(f"run_dir={tmp_path}", *SMALL, "experiment.iterations=2", f"memory.host_budget_mb={BUDGET_MB}",
                 "engine.host_pool_mb=auto", "memory.spill_dir=nvme"))
    records = phases(tmp_path)
    train = max(states(r["memory"]) for r in records if r["phase"] == "checkpoint")  # the states in DRAM
    pools = [r["memory"]["host_pool"] for r in records if r["phase"] == "rollout"]
    assert train > 0 and all(p >= 0.9 * (BUDGET_MB * MiB - train) for p in pools), (pools, train)
    assert all(p + train > BUDGET_MB * MiB for p in pools), "the pool uses DRAM the states hold while training"
    assert all(r["memory"]["host_pool"] == 0 for r in records if r["phase"] in ("train", "checkpoint"))
    with pytest.raises(ValueError, match="memory.spill_dir"):
        composed(*SMALL, "engine.host_pool_mb=auto")
