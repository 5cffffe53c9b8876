"""How many CPU threads a rank's torch ops get when `experiment.num_threads` is null: chosen from the machine.

torch's own default is one thread per core of the whole host, blind to the cores this process may use
(its affinity, its cgroup's CPU quota), to the other ranks on the node and to other work already running.
Threads beyond the free cores spin-wait on each other: measured on a 2-core host with the tiny model's
train phase (a scored task, 8 groups of 16), 1.6 s per iteration with 2 threads on idle cores, 2.5 s with
1; with one core busy elsewhere 2 threads took 4.5 s and 1 thread 2.5 s. So the rule is: the usable
cores (affinity, capped by the cgroup quota) shared among the node's ranks (LOCAL_WORLD_SIZE), and no
more than the cores measured idle over a short sample of /proc/stat at start. OMP_NUM_THREADS, when
set, is the user's choice and is kept. Chosen once per process (two runs in one process use the same).
"""
from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (v2 cpu.max,
    v1 cpu.cfs_quota_us) when one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cgroup's CPU quota in cores, None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # v1: -1 = unlimited
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def idle_cores(sample_s: float = 0.2, stat: Path = Path("/proc/stat")) -> float | None:
    """The cores idle over `sample_s` seconds, measured from /proc/stat's per-CPU counters (the CPUs
    of this process's affinity); None when they cannot be read."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    def read() -> dict[int, tuple[int, int]]:  # cpu -> (idle + iowait, total) jiffies
        out = {}
        for line in stat.read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and (mine is None or int(name[3:]) in mine):
                values = [int(v) for v in fields[:8]]
                out[int(name[3:])] = (values[3] + values[4], sum(values))
        return out

    try:
        before = read()
        time.sleep(sample_s)
        after = read()
    except (OSError, ValueError, IndexError):
        return None
    idle = 0.0
    for cpu, (i1, t1) in after.items():
        i0, t0 = before.get(cpu, (i1, t1))
        idle += (i1 - i0) / (t1 - t0) if t1 > t0 else 1.0
    return idle if after else None


def choose_threads(local_ranks: int, usable: int, idle: float | None) -> int:
    """Threads per rank: the usable cores shared among `local_ranks`, at most the idle cores (rounded,
    shared the same way), at least 1."""
    share = max(1, usable // max(1, local_ranks))
    if idle is None:
        return share
    return max(1, min(share, int(idle / max(1, local_ranks) + 0.5)))


@functools.cache
def machine_threads() -> tuple[int | None, str]:
    """(threads to set, None = keep OMP_NUM_THREADS's; a line saying why), once per process."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    usable, idle = usable_cores(), idle_cores()
    threads = choose_threads(local_ranks, usable, idle)
    idle_text = "unknown" if idle is None else f"{idle:.1f}"
    return threads, (f"{usable} usable cores, {idle_text} idle, {local_ranks} rank{'s' if local_ranks > 1 else ''} "
                     f"on this node")
