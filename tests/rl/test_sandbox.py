"""The sandbox against real escape attempts, in real processes: every attempt ends as a failed result with
the right reason, within its limits, and leaves the host (processes, temp dirs, the caller) untouched."""
import glob
import os
import signal
import socket
import tempfile
import threading
import time

import pytest

from rl.envs.tools.sandbox import REASONS, ExecResult, Sandbox, SandboxConfig

IS_ROOT = os.geteuid() == 0
SMALL = dict(cpu_time_s=2.0, wall_time_s=4.0, memory_mb=256, max_output_bytes=4096, max_file_bytes=65536,
             max_processes=16, workers=2)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(**SMALL)) as sb:
        yield sb


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


ESCAPES = {
    "read /etc/passwd": "print(open('/etc/passwd').read())",
    "list /root": "import os; print(os.listdir('/root'))",
    "read under /root": "print(open('/root/.bashrc').read())",
    "write outside the cwd": "open('/tmp/sandbox-escape.txt', 'w').write('x')",
    "symlink out of the cwd": "import os; os.symlink('/etc/passwd', 'p'); print(open('p').read())",
    "socket": "import socket; socket.socket()",
    "connect": "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
    "subprocess": "import subprocess; subprocess.run(['id'])",
    "os.system": "import os; os.system('id')",
    "exec": "import os; os.execv('/bin/sh', ['sh'])",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "kill the caller": "import os; os.kill(os.getppid(), 9)",
    "ctypes": "import ctypes; ctypes.CDLL(None).system(b'id')",
    "raise a limit": "import resource; resource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_each_escape_is_refused_with_a_permission_error(sandbox, name):
    start = time.monotonic()
    result = sandbox.run(ESCAPES[name])
    assert not result.ok and result.reason == "error", (name, result)
    assert "PermissionError" in result.stderr and "sandbox:" in result.stderr
    assert time.monotonic() - start < SMALL["wall_time_s"] + 5
    assert not os.path.exists("/tmp/sandbox-escape.txt")


def test_the_callers_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    with Sandbox(SandboxConfig(**{**SMALL, "workers": 1})) as sb:  # built after the secret is set
        result = sb.run("import os; print(dict(os.environ))")
    assert result.ok and "hunter2" not in result.stdout and "SANDBOX_TEST_SECRET" not in result.stdout
    assert set(eval(result.stdout)) <= {"PATH", "HOME", "TMPDIR", "LANG"}


def test_allowed_things_work_and_nothing_leaks_between_jobs(sandbox):
    first = sandbox.run("import os\nopen('note.txt', 'w').write('hi')\nos.mkdir('d')\n"
                        "print(os.getpid(), os.getcwd(), sorted(os.listdir('.')), open('note.txt').read())")
    assert first.ok and first.stdout.split()[2:] == ["['d',", "'note.txt']", "hi"]
    pid, cwd = first.stdout.split()[:2]
    assert not os.path.exists(cwd)  # the working dir is removed after the call
    second = sandbox.run("import os; print(os.getpid(), os.getcwd(), os.listdir('.'))")
    assert second.ok and second.stdout.split()[0] != pid and second.stdout.split()[1] != cwd
    assert second.stdout.split()[2] == "[]"


def test_an_infinite_loop_is_stopped_at_the_wall_time():
    with Sandbox(SandboxConfig(wall_time_s=1.0, cpu_time_s=30.0, workers=1)) as sb:
        start = time.monotonic()
        result = sb.run("print('started', flush=True)\nwhile True:\n    pass")
        assert time.monotonic() - start < 10.0
    assert result.reason == "timeout" and not result.ok and result.stdout == "started\n"
    assert result.exit_code == -signal.SIGKILL and group_members(result.pid) == []


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
    assert result.stdout.startswith("y" * 1000) and group_members(result.pid) == []


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
    assert len({results[i].stdout.split()[1] for i in range(8)}) == 8  # one worker per job
    assert sb.stats().num_calls == 8


def test_a_warm_pool_starts_workers_ahead_of_calls():
    with Sandbox(SandboxConfig(**{**SMALL, "workers": 2})) as sb:
        for _ in range(3):
            assert sb.wait_warm(30.0)
            assert sb.run("print('hi')").ok
        stats = sb.stats()
    assert stats.num_calls == 3 and stats.num_cold_starts == 0  # no call started an interpreter itself
    assert stats.num_started <= stats.num_calls + 2  # one replacement per call, plus the initial pool


def test_close_kills_ready_workers_and_removes_their_dirs():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "sandbox-*")))
    sb = Sandbox(SandboxConfig(**{**SMALL, "workers": 2}))
    assert sb.wait_warm(30.0)
    ours = set(glob.glob(os.path.join(tempfile.gettempdir(), "sandbox-*"))) - before
    assert len(ours) == 2
    sb.close()
    assert not any(os.path.exists(d) for d in ours)
    with pytest.raises(RuntimeError, match="after close"):
        sb.run("print(1)")


@pytest.mark.skipif(not IS_ROOT, reason="the uid drop, mount and network namespaces are applied as root")
def test_as_root_every_os_layer_is_applied(sandbox):
    sandbox.wait_warm(30.0)
    iso = sandbox.isolation
    assert iso["uid_dropped"] and iso["uid"] == 65534 and iso["netns"] and iso["mountns"]
    assert iso["no_new_privs"] and iso["audit_hook"]


@pytest.mark.skipif(not IS_ROOT, reason="without root the OS layers are partial (docs/sandbox.md)")
def test_the_os_layers_hold_without_the_audit_hook():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    probes = {  # each line's result is printed; none may reach what it tries to reach
        "read /root": "try:\n    print(open('/root/.bashrc').read())\nexcept OSError as e:\n    print('refused', e.errno)",
        "connect": f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
                   "except OSError as e:\n    print('refused', e.errno)",
        "kill the caller": "try:\n    os.kill(os.getppid(), 9)\nexcept OSError as e:\n    print('refused', e.errno)",
        "big file": "try:\n    open('big', 'wb').write(b'x' * 200000)\nexcept OSError as e:\n    print('refused', e.errno)",
    }
    with Sandbox(SandboxConfig(**{**SMALL, "workers": 1, "audit_hook": False})) as sb:
        for name, code in probes.items():
            result = sb.run("import os, socket\n" + code)
            assert result.ok and result.stdout.startswith("refused"), (name, result)
        start = time.monotonic()
        bomb = sb.run("import os\nwhile True:\n    os.fork()")
        assert time.monotonic() - start < SMALL["wall_time_s"] + 10
        assert not bomb.ok and bomb.reason in ("error", "timeout")
        assert group_members(bomb.pid) == []  # no process of the bomb survives
        assert sb.run("print('still fine')").stdout == "still fine\n"
    listener.close()


def test_reasons_are_the_documented_set():
    assert REASONS == ("ok", "error", "timeout", "cpu_limit", "memory", "output_limit", "killed", "crashed")
