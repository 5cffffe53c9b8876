"""Run untrusted, model-written Python in a separate, locked-down process.

`Sandbox.run(code, stdin)` hands the code to a WARM worker: under the default backend a bubblewrap sandbox
(rl/envs/tools/bwrap.py: its own PID, network, IPC, UTS and mount namespaces, only the interpreter and its
standard library visible, a fresh size-capped tmpfs as the only writable place, a uid of its slot's own)
running `python -I -S` that has applied its rlimits and blocks reading one job from stdin. It runs that one
job and exits, and the pool starts a replacement at once (start-up is off the caller's path). `run` caps the
output, kills the sandbox's PID namespace at the wall-time limit (every process of the call goes with it),
and always returns an `ExecResult` naming why the job ended. Guarantees and limits: docs/sandbox.md."""
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from rl.envs.tools import bwrap, seccomp
from rl.envs.tools.bwrap import BACKENDS, SCRATCH, SandboxUnavailable

__all__ = ["BACKENDS", "REASONS", "ExecResult", "PoolStats", "Sandbox", "SandboxConfig", "SandboxSettings",
           "SandboxUnavailable", "check_backend", "set_default_backend"]

REASONS = ("ok", "error", "timeout", "cpu_limit", "memory", "output_limit", "killed", "crashed")
MEMORY_EXIT = 86  # the runner's exit code for an uncaught MemoryError (a job's own sys.exit(86) reads alike)
NUM_FILES = 64  # RLIMIT_NOFILE inside the worker
READY_TIMEOUT_S = 60.0  # a worker that has not finished its set-up by then is a start failure
RUNNER = (Path(__file__).parent / "sandbox_worker.py").read_text()  # sent as text: no project tree inside
LOG = logging.getLogger("rl.sandbox")
_DEFAULT_BACKEND = ["bwrap"]


def set_default_backend(name: str) -> None:
    """The backend of every SandboxConfig that names none (`backend=None`): the run's `sandbox.backend`."""
    if name not in BACKENDS:
        raise ValueError(f"sandbox.backend={name!r}, expected one of {', '.join(BACKENDS)}")
    _DEFAULT_BACKEND[0] = name


def check_backend(name: str | None = None, python: str = sys.executable) -> None:
    """Raise SandboxUnavailable (one line: what to install or enable) unless backend `name` (None: the
    default) can run workers here; "none" always can (it isolates nothing)."""
    if (name or _DEFAULT_BACKEND[0]) == "bwrap":
        bwrap.check(python)


@dataclass(frozen=True, kw_only=True)
class SandboxSettings:
    """The run's `sandbox` group: how every sandboxed task of the run isolates model-written code."""
    backend: str = "bwrap"
    """"bwrap": each call in a bubblewrap sandbox (docs/sandbox.md); a host without bubblewrap refuses the
    run. "none": a plain process with rlimits and the audit hook, NO isolation (warned at every start)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}, expected one of {', '.join(BACKENDS)}")


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed job and the size of the warm pool."""

    cpu_time_s: float = 5.0  # RLIMIT_CPU of the job (rounded up to whole seconds): SIGXCPU -> "cpu_limit"
    wall_time_s: float = 10.0  # from sending the job to its exit; past it every process of the call is killed
    memory_mb: int = 512  # RLIMIT_AS, the address space (not resident memory) of the worker
    max_output_bytes: int = 65536  # stdout + stderr kept; past it the job is killed ("output_limit")
    max_file_bytes: int = 1 << 20  # RLIMIT_FSIZE: the largest file the job may write
    max_processes: int = 16  # RLIMIT_NPROC: processes + threads of the call (its slot's uid)
    scratch_mb: int = 16  # size of each call's tmpfs /tmp (and of its /dev/shm), the only writable places
    workers: int = 4  # warm workers kept ready ahead of calls
    python: str = sys.executable  # interpreter that runs the jobs
    audit_hook: bool = True  # the Python-level second line of defence; False only to test the OS layers
    seccomp: bool = True  # the system call filter (rl/envs/tools/seccomp.py) under the bwrap backend
    backend: str | None = None  # "bwrap" or "none" (no isolation); None: the run's `sandbox.backend`

    def __post_init__(self):
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        integer = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        checks = [("cpu_time_s", lambda v: number(v) and v > 0, "a number of seconds > 0"),
                  ("wall_time_s", lambda v: number(v) and v > 0, "a number of seconds > 0"),
                  ("python", lambda v: isinstance(v, str) and os.access(v, os.X_OK), "an executable Python"),
                  ("audit_hook", lambda v: isinstance(v, bool), "True or False"),
                  ("seccomp", lambda v: isinstance(v, bool), "True or False"),
                  ("backend", lambda v: v is None or v in BACKENDS, f"None or one of {', '.join(BACKENDS)}")]
        for name, least in (("memory_mb", 32), ("max_output_bytes", 1), ("max_file_bytes", 0),
                            ("max_processes", 1), ("workers", 0), ("scratch_mb", 1)):
            checks.append((name, lambda v, least=least: integer(v) and v >= least, f"an int >= {least}"))
        for name, good, expected in checks:
            if not good(getattr(self, name)):
                raise ValueError(f"SandboxConfig.{name}={getattr(self, name)!r}: expected {expected}")


@dataclass
class ExecResult:
    """What one job did. `reason` is one of REASONS; `exit_code` is negative for a signal, None if unknown."""

    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None
    reason: str
    seconds: float  # wall time from taking a worker to the job's end
    pid: int | None = None  # host pid of the worker's init (bwrap: its PID namespace's pid 1); gone by now
    pidns: int | None = None  # inode of the call's PID namespace (bwrap): no process is left in it

    @property
    def feedback(self) -> str:
        """A short text for the model: stdout when ok, else one line naming the failure."""
        if self.ok:
            return self.stdout
        if self.reason == "error":
            lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
            return f"error: {lines[-1].strip() if lines else f'exit code {self.exit_code}'}"
        words = {"timeout": "wall-time limit exceeded", "cpu_limit": "CPU-time limit exceeded",
                 "memory": "memory limit exceeded", "output_limit": "output limit exceeded",
                 "killed": "the process was killed", "crashed": f"the process crashed ({self.exit_code})"}
        return f"error: {words[self.reason]}"


@dataclass(frozen=True)
class PoolStats:
    """Counters since the Sandbox was built: a warm pool starts about one process per call, ahead of it."""

    num_calls: int
    num_started: int  # worker processes started, warm or cold
    num_cold_starts: int  # workers started inside `run` because none was ready (start-up on the caller's path)


@dataclass
class _Worker:
    proc: subprocess.Popen  # bwrap (or, backend none, the interpreter itself: its process group's leader)
    sandboxed: bool
    init_pid: int = 0  # bwrap: host pid of the PID namespace's init; none: proc.pid
    pidfd: int | None = None  # of the init: signalled without a pid-reuse race
    pidns: int | None = None
    uid: int | None = None  # the slot's uid (given back once every process of the worker is gone)
    workdir: str | None = None  # backend none: the host temp dir it runs in
    cgroup: str | None = None
    notes: dict = field(default_factory=dict)  # which isolation layers the worker applied

    def exited(self) -> bool:
        """True once the process we started has exited (left unreaped until `Sandbox._reap`)."""
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def kill(self) -> None:
        """SIGKILL every process of the worker: its PID namespace's init (the kernel then kills the rest of
        the namespace), or, backend none, its process group."""
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        elif not self.sandboxed:
            _kill_group(self.proc.pid)


def _kill_group(pid: int, sweep: bool = False) -> None:
    """SIGKILL every process of the group `pid` leads; with `sweep` (after the leader is reaped) repeat until
    the group is empty (a fork bomb's last children). Backend none only: it has no namespace to kill."""
    for _ in range(200 if sweep else 1):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.001)


def _remove_dir(path: str) -> None:
    def unlock(func, failed, _exc):  # a job may have chmod 000 a dir it made
        os.chmod(os.path.dirname(failed), 0o700)
        func(failed)

    shutil.rmtree(path, onerror=unlock)


def _read_until(fd: int, deadline: float, done) -> bytes:
    """Bytes read from `fd` until `done(data)`, EOF or the deadline."""
    data = b""
    while not done(data) and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data


class Sandbox:
    """A warm pool of one-shot workers. `run` is thread-safe; `close` kills every worker it owns. Raises
    SandboxUnavailable (one line) when its backend cannot run here."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.backend = self.config.backend or _DEFAULT_BACKEND[0]
        self._root = os.geteuid() == 0
        self._cgroup_parent = None
        if self.backend == "bwrap":
            bwrap.check(self.config.python)
            self._cgroup_parent = bwrap.cgroup_parent()
        else:
            LOG.warning("sandbox.backend=none: model-written code runs WITHOUT isolation (a plain process with "
                        "rlimits and an audit hook that code can switch off); use sandbox.backend=bwrap")
        arch = seccomp.machine() if self.backend == "bwrap" and self.config.seccomp else None
        self._filter = seccomp.program(arch).hex() if arch else None  # ValueError names an unknown architecture
        self._keyctl_nr = seccomp.SYSCALLS.get(arch or seccomp.host_arch(), {}).get("keyctl")
        self._uids = bwrap.SlotUids(self._root)
        self._cond = threading.Condition()
        self._ready: deque[_Worker] = deque()
        self._busy: dict[int, _Worker] = {}
        self._num_starting = self._num_calls = self._num_started = self._num_cold = 0
        self._closed = False
        self._failure: str | None = None
        self.isolation: dict = {}  # the first worker's report of the layers it applied
        self._filler = threading.Thread(target=self._fill, name="sandbox-pool", daemon=True)
        self._filler.start()

    def _spawn(self) -> tuple[_Worker, int]:
        """Start one worker process; (the worker, the read end of bwrap's --info-fd or -1)."""
        cfg, sandboxed = self.config, self.backend == "bwrap"
        worker = _Worker(None, sandboxed, uid=self._uids.take() if sandboxed else None,  # type: ignore[arg-type]
                         workdir=None if sandboxed else tempfile.mkdtemp(prefix="sandbox-"))
        spec = json.dumps({"workdir": SCRATCH if sandboxed else worker.workdir, "cpu_time_s": cfg.cpu_time_s,
                           "memory_bytes": cfg.memory_mb << 20, "max_file_bytes": cfg.max_file_bytes,
                           "max_processes": cfg.max_processes, "num_files": NUM_FILES, "memory_exit": MEMORY_EXIT,
                           "drop_to": worker.uid if sandboxed and self._root else None,
                           "audit_hook": cfg.audit_hook, "keyctl_nr": self._keyctl_nr,
                           "seccomp": self._filter if sandboxed else None})
        info_r = info_w = -1
        try:
            if sandboxed:
                info_r, info_w = os.pipe()
                argv = bwrap.command(cfg.python, uid=worker.uid, root=self._root, scratch_bytes=cfg.scratch_mb << 20,
                                     info_fd=info_w, runner=RUNNER, spec=spec)
                if self._cgroup_parent is not None:
                    worker.cgroup = bwrap.make_cgroup(
                        self._cgroup_parent, f"rl-sandbox-{os.getpid()}-{worker.uid}-{self._num_started}",
                        memory_bytes=(cfg.memory_mb + 2 * cfg.scratch_mb) << 20, pids=cfg.max_processes + 2)
                    argv = bwrap.in_cgroup(worker.cgroup, argv)
            else:
                argv = [cfg.python, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", RUNNER, spec]
            env = {"PATH": "/usr/bin:/bin", "HOME": worker.workdir or SCRATCH, "TMPDIR": worker.workdir or SCRATCH,
                   "LANG": "C.UTF-8"}
            worker.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           cwd=worker.workdir or "/", env=env, start_new_session=True, close_fds=True,
                                           pass_fds=(info_w,) if sandboxed else ())
        except BaseException:
            if info_r >= 0:
                os.close(info_r)
            self._release(worker)
            raise
        finally:
            if info_w >= 0:
                os.close(info_w)
        worker.init_pid = worker.proc.pid
        with self._cond:
            self._num_started += 1
        return worker, info_r

    def _start_worker(self) -> _Worker:
        """Start one worker and wait until it reports its isolation applied (or raise RuntimeError)."""
        worker, info_r = self._spawn()
        deadline = time.monotonic() + READY_TIMEOUT_S
        line = b""
        try:
            if info_r >= 0:  # bwrap's report: the host pid of the namespace's init, the namespaces
                info = json.loads(_read_until(info_r, deadline, lambda d: False) or b"{}")
                if "child-pid" in info:
                    worker.pidfd = os.pidfd_open(info["child-pid"])
                    worker.init_pid, worker.pidns = info["child-pid"], info.get("pid-namespace")
            if not worker.sandboxed or worker.pidfd is not None:
                line = _read_until(worker.proc.stdout.fileno(), deadline, lambda d: d.endswith(b"\n"))
        except (OSError, ValueError):
            line = b""
        finally:
            if info_r >= 0:
                os.close(info_r)
        if not line.startswith(b"READY "):
            self._reap(worker)
            err = worker.proc.stderr.read().decode(errors="replace").strip()
            self._release(worker)
            raise RuntimeError(f"sandbox worker failed to start ({self.config.python}, backend "
                               f"{self.backend}): {err or line!r}")
        worker.notes = json.loads(line[6:]) | {"backend": self.backend, "cgroup": worker.cgroup is not None}
        if worker.sandboxed:
            worker.notes["namespaces"] = ["pid", "net", "ipc", "uts", "mount"] + ([] if self._root else ["user"])
        return worker

    def _fill(self) -> None:
        """Background thread: keep `workers` ready workers until closed."""
        while True:
            with self._cond:
                while not self._closed and len(self._ready) + self._num_starting >= self.config.workers:
                    self._cond.wait()
                if self._closed:
                    return
                self._num_starting += 1
            worker = None
            try:
                worker = self._start_worker()
            except Exception as exc:  # reported loudly once; calls then start workers themselves
                if self._failure is None:
                    self._failure = str(exc)
                    warnings.warn(f"sandbox pool could not start a worker: {exc}", RuntimeWarning)
                time.sleep(1.0)
            with self._cond:
                self._num_starting -= 1
                if worker is not None:
                    self.isolation = self.isolation or dict(worker.notes)
                    if self._closed:
                        self._discard(worker)
                    else:
                        self._ready.append(worker)
                self._cond.notify_all()

    def _take(self) -> _Worker:
        """A live ready worker, or a freshly started one when none is ready."""
        with self._cond:
            if self._closed:
                raise RuntimeError("Sandbox.run after close()")
            self._num_calls += 1
            while self._ready:
                worker = self._ready.popleft()
                self._cond.notify_all()
                if not worker.exited():
                    return worker
                self._discard(worker)  # killed while waiting for a job
            self._num_cold += 1
        worker = self._start_worker()
        self.isolation = self.isolation or dict(worker.notes)
        return worker

    def _reap(self, worker: _Worker) -> tuple[int, object]:
        """Kill every process of `worker` and reap it: (wait status, rusage of the call's processes). Once it
        returns, no process of the worker is left (bwrap: its namespace's init has exited, which the kernel
        allows only when the namespace is empty)."""
        worker.kill()
        if worker.proc.returncode is not None:
            return worker.proc.returncode, None
        for _ in range(500):  # bwrap exits once its init has; it is killed itself past 5 s
            if worker.exited():
                break
            time.sleep(0.01)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(worker.proc.pid, 0)
        worker.proc.returncode = os.waitstatus_to_exitcode(status)
        if worker.pidfd is not None:
            select.select([worker.pidfd], [], [], 5.0)  # readable when the init has exited
            with contextlib.suppress(ChildProcessError, OSError):  # handed to us when we are a reaper (pid 1)
                os.waitid(os.P_PIDFD, worker.pidfd, os.WEXITED | os.WNOHANG)
            os.close(worker.pidfd)
            worker.pidfd = None
        elif not worker.sandboxed:
            _kill_group(worker.proc.pid, sweep=True)
        return worker.proc.returncode, usage

    def _release(self, worker: _Worker) -> None:
        """Give back what the worker held (its processes are gone): pipes, uid, cgroup, temp dir."""
        for pipe in (worker.proc.stdin, worker.proc.stdout, worker.proc.stderr) if worker.proc else ():
            pipe.close()
        if worker.uid is not None:
            self._uids.give(worker.uid)
        if worker.cgroup is not None:
            bwrap.remove_cgroup(worker.cgroup)
        if worker.workdir is not None:
            _remove_dir(worker.workdir)

    def _discard(self, worker: _Worker) -> None:
        self._reap(worker)
        self._release(worker)

    def run(self, code: str, stdin: str = "") -> ExecResult:
        """Run `code` (with `stdin` as its standard input) in a fresh worker; always returns a result."""
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise TypeError(f"Sandbox.run(code, stdin) takes two str, got {type(code)}, {type(stdin)}")
        start = time.monotonic()
        worker = self._take()
        with self._cond:
            self._busy[worker.init_pid] = worker
        try:
            return self._execute(worker, code, stdin, start)
        finally:
            with self._cond:
                self._busy.pop(worker.init_pid, None)
            self._discard(worker)

    def _execute(self, worker: _Worker, code: str, stdin: str, start: float) -> ExecResult:
        proc = worker.proc
        deadline = time.monotonic() + self.config.wall_time_s
        with contextlib.suppress(OSError):  # a worker dead before reading its job: its exit status says how
            proc.stdin.write(json.dumps({"code": code, "stdin": stdin}).encode())
            proc.stdin.close()
        out, err, stopped = self._collect(worker, deadline)
        code_, usage = self._reap(worker)
        if worker.sandboxed and code_ > 128:  # bwrap's init exits 128 + n when the job died of signal n
            code_ = -(code_ - 128)
        proc.returncode = code_
        cpu_s = usage.ru_utime + usage.ru_stime if usage is not None else 0.0
        reason = stopped or self._classify(code_, cpu_s)
        return ExecResult(ok=reason == "ok", stdout=out.decode(errors="replace"),
                          stderr=err.decode(errors="replace"), exit_code=code_, reason=reason,
                          seconds=time.monotonic() - start, pid=worker.init_pid, pidns=worker.pidns)

    def _classify(self, exit_code: int, cpu_s: float) -> str:
        if exit_code == 0:
            return "ok"
        if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_s >= self.config.cpu_time_s + 1):
            return "cpu_limit"  # soft limit: SIGXCPU; hard limit (one second later, if SIGXCPU is caught): SIGKILL
        if exit_code == -signal.SIGKILL:
            return "killed"
        if exit_code < 0:
            return "crashed"
        return "memory" if exit_code == MEMORY_EXIT else "error"

    def _collect(self, worker: _Worker, deadline: float) -> tuple[bytes, bytes, str | None]:
        """Read stdout and stderr until both close, the cap, or the deadline; the reason we stopped it."""
        proc, cap = worker.proc, self.config.max_output_bytes
        fds = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        open_fds, total, stopped, exited_at = set(fds), 0, None, None
        while open_fds and stopped is None:
            now = time.monotonic()
            if now >= deadline:
                stopped = "timeout"
                break
            if exited_at is None and worker.exited():
                exited_at = now
                worker.kill()  # children holding the pipes open die with the worker
            elif exited_at is not None and now - exited_at > 1.0:
                break  # something outside the worker still holds a pipe; stop waiting for it
            readable, _, _ = select.select(list(open_fds), [], [], min(0.05, deadline - now))
            for fd in readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.discard(fd)
                    continue
                fds[fd] += chunk[: max(0, cap - total)]
                total += len(chunk)
                if total > cap:
                    stopped = "output_limit"
                    break
        if stopped is not None:
            worker.kill()
        return bytes(fds[proc.stdout.fileno()]), bytes(fds[proc.stderr.fileno()]), stopped

    def busy_pids(self) -> list[int]:
        """Host pids of the workers running a job right now (bwrap: each one's namespace init)."""
        with self._cond:
            return list(self._busy)

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(self._num_calls, self._num_started, self._num_cold)

    def wait_warm(self, timeout_s: float = 30.0) -> bool:
        """Block until `workers` workers are ready (True) or `timeout_s` passes (False)."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while len(self._ready) < self.config.workers:
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """Kill the ready workers and stop refilling; jobs running now are killed too."""
        with self._cond:
            self._closed = True
            ready, self._ready = list(self._ready), deque()
            busy = list(self._busy.values())
            self._cond.notify_all()
        for worker in ready:
            self._discard(worker)
        for worker in busy:
            worker.kill()
        self._filler.join(timeout=READY_TIMEOUT_S)
        self._uids.close()  # the slot uids' lock files (a busy call giving its uid back later is ignored)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
