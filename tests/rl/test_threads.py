"""experiment.num_threads=null is chosen from the machine (rl/run/threads.py): the usable cores (affinity,
cgroup quota) shared among the node's ranks, at most the cores idle at start; OMP_NUM_THREADS kept."""
import os
import subprocess
import sys

import pytest

from rl.run import threads


def test_the_usable_cores_are_shared_among_ranks_and_capped_by_the_idle_ones():
    assert threads.choose_threads(1, 2, 2.0) == 2      # an idle 2-core host: both
    assert threads.choose_threads(1, 2, 0.9) == 1      # one core busy elsewhere: one thread (1.8x faster measured)
    assert threads.choose_threads(2, 8, 8.0) == 4      # two ranks on 8 idle cores: 4 each
    assert threads.choose_threads(2, 8, 2.6) == 1      # 2.6 idle cores for 2 ranks: 1.3 each -> 1
    assert threads.choose_threads(1, 4, 0.0) == 1      # never 0
    assert threads.choose_threads(3, 2, None) == 1     # idle unknown: the share alone, at least 1


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads._cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads._cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads._cgroup_quota(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads._cgroup_quota(tmp_path) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_core_kept_busy_by_another_process_is_not_counted_idle():
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    burner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        os.sched_setaffinity(0, {cpu})
        threads.idle_cores(0.1)  # the burner is running by now
        assert threads.idle_cores(0.5) < 0.5
    finally:
        os.sched_setaffinity(0, mine)
        burner.kill()
        burner.wait()


def test_omp_num_threads_is_the_users_choice(monkeypatch):
    threads.machine_threads.cache_clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    try:
        assert threads.machine_threads() == (None, "OMP_NUM_THREADS=3")
    finally:
        threads.machine_threads.cache_clear()
    monkeypatch.delenv("OMP_NUM_THREADS")
    chosen, why = threads.machine_threads()
    assert 1 <= chosen <= threads.usable_cores() and "usable cores" in why and "idle" in why
