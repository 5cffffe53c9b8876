"""The sandbox against real escape attempts, in real processes: every attempt ends as a failed result with
the right reason, within its limits, and leaves the host (processes, temp dirs, the caller) untouched."""
import glob
import os
import signal
import subprocess
import threading
import time

import pytest

from rl.envs.tools import bwrap
from rl.envs.tools.sandbox import (REASONS, ExecResult, Sandbox, SandboxConfig, SandboxSettings,
                                   SandboxUnavailable, check_backend)

IS_ROOT = os.geteuid() == 0
SMALL = dict(cpu_time_s=2.0, wall_time_s=4.0, memory_mb=256, max_output_bytes=4096, max_file_bytes=65536,
             max_processes=16, workers=2)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(**SMALL)) as sb:
        yield sb


def namespace_members(pidns: int) -> list[int]:
    """Host pids of the live (non-zombie) processes in PID namespace `pidns` (by inode), read from /proc."""
    out = []
    for link in glob.glob("/proc/[0-9]*/ns/pid"):
        try:
            if os.readlink(link) == f"pid:[{pidns}]":
                pid = int(link.split("/")[2])
                if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            continue
    return out


def group_members(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes whose process group is `pgid`, read from /proc."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.split("/")[2]))
    return out


def test_config_rejects_bad_values_naming_them():
    for kwargs, words in (({"wall_time_s": 0}, "wall_time_s=0"), ({"cpu_time_s": "5"}, "cpu_time_s='5'"),
                          ({"memory_mb": 8}, "memory_mb=8"), ({"workers": -1}, "workers=-1"),
                          ({"max_output_bytes": 1.5}, "max_output_bytes=1.5"),
                          ({"python": "/no/such/python"}, "/no/such/python")):
        with pytest.raises(ValueError, match="expected") as info:
            SandboxConfig(**kwargs)
        assert words in str(info.value)


def test_a_job_gets_its_stdin_and_its_output_back(sandbox):
    result = sandbox.run("import json, sys\nprint(json.dumps(sys.stdin.read()[::-1]))\nprint('warn', file=sys.stderr)",
                         stdin="abc")
    assert result.ok and result.reason == "ok" and result.exit_code == 0
    assert result.stdout == '"cba"\n' and result.stderr == "warn\n" and result.feedback == result.stdout


def test_an_exception_is_an_error_with_its_traceback(sandbox):
    result = sandbox.run("def f():\n    raise ValueError('bad input 7')\nf()")
    assert not result.ok and result.reason == "error" and result.exit_code == 1
    assert "Traceback" in result.stderr and 'File "<sandbox>", line 2' in result.stderr
    assert result.feedback == "error: ValueError: bad input 7"
    assert sandbox.run("import sys; sys.exit(3)").reason == "error"


def test_the_callers_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    with Sandbox(SandboxConfig(**{**SMALL, "workers": 1})) as sb:  # built after the secret is set
        result = sb.run("import os; print(dict(os.environ))")
    assert result.ok and "hunter2" not in result.stdout and "SANDBOX_TEST_SECRET" not in result.stdout
    assert set(eval(result.stdout)) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD"}


def test_allowed_things_work_and_nothing_leaks_between_jobs(sandbox):
    first = sandbox.run("import os\nopen('note.txt', 'w').write('hi')\nos.mkdir('d')\n"
                        "print(os.getcwd(), sorted(os.listdir('.')), open('note.txt').read())")
    assert first.ok and first.stdout.split() == ["/tmp", "['d',", "'note.txt']", "hi"]
    second = sandbox.run("import os; print(os.getcwd(), os.listdir('.'))")
    assert second.ok and second.stdout.split() == ["/tmp", "[]"]  # a fresh tmpfs per call
    assert first.pidns != second.pidns and namespace_members(first.pidns) == []


def test_an_infinite_loop_is_stopped_at_the_wall_time():
    with Sandbox(SandboxConfig(wall_time_s=1.0, cpu_time_s=30.0, workers=1)) as sb:
        start = time.monotonic()
        result = sb.run("print('started', flush=True)\nwhile True:\n    pass")
        assert time.monotonic() - start < 10.0
    assert result.reason == "timeout" and not result.ok and result.stdout == "started\n"
    assert result.exit_code == -signal.SIGKILL and namespace_members(result.pidns) == []


def test_cpu_time_is_limited_separately_from_wall_time():
    with Sandbox(SandboxConfig(cpu_time_s=1.0, wall_time_s=20.0, workers=1)) as sb:
        start = time.monotonic()
        result = sb.run("while True:\n    pass")
        assert time.monotonic() - start < 15.0
    assert result.reason == "cpu_limit" and result.feedback == "error: CPU-time limit exceeded"


def test_allocating_10_gb_is_a_memory_failure(sandbox):
    result = sandbox.run("x = bytearray(10 * 1024 ** 3)")
    assert result.reason == "memory" and not result.ok and "MemoryError" in result.stderr


def test_huge_output_is_cut_at_the_cap_and_the_job_killed(sandbox):
    result = sandbox.run("while True:\n    print('y' * 1000)")
    assert result.reason == "output_limit" and not result.ok
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= SMALL["max_output_bytes"]
    assert result.stdout.startswith("y" * 1000) and namespace_members(result.pidns) == []


def test_a_worker_killed_from_outside_costs_only_its_call(sandbox):
    results = []
    thread = threading.Thread(target=lambda: results.append(sandbox.run("while True:\n    pass")))
    thread.start()
    deadline = time.monotonic() + 10
    while not sandbox.busy_pids() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(sandbox.busy_pids()[0], signal.SIGKILL)
    thread.join(timeout=15)
    assert results[0].reason == "killed" and results[0].exit_code == -signal.SIGKILL
    assert sandbox.run("print(6 * 7)").stdout == "42\n"


def test_eight_threads_get_eight_correct_distinct_outputs():
    with Sandbox(SandboxConfig(**{**SMALL, "workers": 4})) as sb:
        results: dict[int, ExecResult] = {}

        def call(i):
            results[i] = sb.run("import os, sys\nn = int(sys.stdin.read())\nprint(n * n, os.getpid())",
                                stdin=str(i))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert sorted(results) == list(range(8)) and all(r.ok for r in results.values())
    assert [int(results[i].stdout.split()[0]) for i in range(8)] == [i * i for i in range(8)]
    assert len({results[i].pidns for i in range(8)}) == 8  # one worker (one PID namespace) per job
    assert sb.stats().num_calls == 8


def test_a_warm_pool_starts_workers_ahead_of_calls():
    with Sandbox(SandboxConfig(**{**SMALL, "workers": 2})) as sb:
        for _ in range(3):
            assert sb.wait_warm(30.0)
            assert sb.run("print('hi')").ok
        stats = sb.stats()
    assert stats.num_calls == 3 and stats.num_cold_starts == 0  # no call started an interpreter itself
    assert stats.num_started <= stats.num_calls + 2  # one replacement per call, plus the initial pool


def test_close_kills_ready_workers():
    sb = Sandbox(SandboxConfig(**{**SMALL, "workers": 2}))
    assert sb.wait_warm(30.0)
    ready = list(sb._ready)
    assert len(ready) == 2 and all(namespace_members(w.pidns) for w in ready)
    sb.close()
    assert all(namespace_members(w.pidns) == [] for w in ready)
    with pytest.raises(RuntimeError, match="after close"):
        sb.run("print(1)")


def test_every_os_layer_is_applied(sandbox):
    sandbox.wait_warm(30.0)
    iso = sandbox.isolation
    assert iso["backend"] == "bwrap" and iso["pid"] == 2 and iso["no_new_privs"] and iso["audit_hook"]
    assert set(iso["namespaces"]) >= {"pid", "net", "ipc", "uts", "mount"} and not iso["root"]
    assert iso["uid"] >= bwrap.UID_BASE


def test_concurrent_workers_have_distinct_uids_across_pools():
    with Sandbox(SandboxConfig(**{**SMALL, "workers": 2})) as a, Sandbox(SandboxConfig(**{**SMALL, "workers": 2})) as b:
        assert a.wait_warm(30.0) and b.wait_warm(30.0)
        uids = [w.uid for w in [*a._ready, *b._ready]]
    assert len(set(uids)) == 4


def test_a_fork_bomb_costs_only_its_own_slot():
    with Sandbox(SandboxConfig(**{**SMALL, "workers": 2, "audit_hook": False})) as sb:
        results = {}
        bomb = threading.Thread(target=lambda: results.update(bomb=sb.run(
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")))
        bomb.start()
        time.sleep(0.5)
        results["fork"] = sb.run("import os\npid = os.fork()\nif pid == 0:\n    os._exit(3)\n"
                                 "print(os.waitpid(pid, 0)[1] >> 8)")
        bomb.join(timeout=30)
    assert results["fork"].ok and results["fork"].stdout == "3\n", results["fork"]
    assert not results["bomb"].ok and namespace_members(results["bomb"].pidns) == []


def test_backend_none_warns_at_every_start(caplog):
    for _ in range(2):
        with Sandbox(SandboxConfig(**{**SMALL, "workers": 1, "backend": "none"})) as sb:
            assert sb.run("print(6 * 7)").stdout == "42\n"
    warned = [r for r in caplog.records if "WITHOUT isolation" in r.getMessage()]
    assert len(warned) == 2 and all(r.levelname == "WARNING" for r in warned)


def test_without_bubblewrap_a_sandbox_refuses_to_start_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    monkeypatch.setattr(bwrap, "_CHECKED", set())
    with pytest.raises(SandboxUnavailable) as info:
        Sandbox(SandboxConfig(**{**SMALL, "workers": 1}))
    message = str(info.value)
    assert "\n" not in message and "apt-get install bubblewrap" in message and "sandbox.backend=none" in message
    with pytest.raises(SandboxUnavailable):
        check_backend("bwrap")
    check_backend("none")  # isolates nothing, so it always can


def test_refused_namespaces_are_one_line_naming_what_to_enable(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(bwrap, "_CHECKED", set())
    with pytest.raises(SandboxUnavailable, match="uid map: Permission denied.*user namespaces") as info:
        check_backend("bwrap")
    assert "\n" not in str(info.value)


def test_settings_and_config_reject_an_unknown_backend():
    with pytest.raises(ValueError, match="backend='docker', expected one of bwrap, none"):
        SandboxSettings(backend="docker")
    with pytest.raises(ValueError, match="SandboxConfig.backend='x'"):
        SandboxConfig(backend="x")


def test_a_cgroup_gets_the_calls_limits_and_the_worker_enters_it(tmp_path):
    """Where the host delegates cgroup v2 (not here: the files are plain files in a temp dir), each worker
    gets a child cgroup with its limits and its first process moves itself in before bwrap starts."""
    path = bwrap.make_cgroup(str(tmp_path), "w1", memory_bytes=300 << 20, pids=18)
    assert (tmp_path / "w1" / "memory.max").read_text() == str(300 << 20)
    assert (tmp_path / "w1" / "pids.max").read_text() == "18"
    assert (tmp_path / "w1" / "cpu.max").read_text() == "100000 100000"
    done = subprocess.run(bwrap.in_cgroup(path, ["/bin/echo", "started"]), capture_output=True, text=True)
    assert done.stdout == "started\n" and (tmp_path / "w1" / "cgroup.procs").read_text() == "0\n"
    for f in (tmp_path / "w1").iterdir():
        f.unlink()
    bwrap.remove_cgroup(path)
    assert not (tmp_path / "w1").exists()


def test_reasons_are_the_documented_set():
    assert REASONS == ("ok", "error", "timeout", "cpu_limit", "memory", "output_limit", "killed", "crashed")


def test_close_gives_back_every_slot_uid():
    sb = Sandbox(SandboxConfig(**{**SMALL, "workers": 2}))
    assert sb.wait_warm(30.0) and sb.run("print(1)").ok
    held = dict(sb._uids._held)
    sb.close()
    assert held and sb._uids._held == {}
    for fd in held.values():  # the lock files' descriptors are closed, so another pool may claim the uids
        with pytest.raises(OSError):
            os.fstat(fd)
