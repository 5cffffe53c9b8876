"""Run untrusted, model-written Python in a separate, locked-down process.

`Sandbox.run(code, stdin)` hands the code to a WARM worker, a `python -I -S` process started ahead of time
that has applied its isolation and blocks reading one job from stdin; it runs that one job and exits, and
the pool starts a replacement at once (no state leaks between jobs; start-up is off the caller's path).
`run` caps the output, kills the process group at the wall-time limit, removes the working dir, and always
returns an `ExecResult` naming why the job ended. The layers, and what each does not stop: docs/sandbox.md."""
import contextlib
import json
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

REASONS = ("ok", "error", "timeout", "cpu_limit", "memory", "output_limit", "killed", "crashed")
NOBODY = 65534  # uid/gid the worker drops to when started as root
MEMORY_EXIT = 86  # the runner's exit code for an uncaught MemoryError (a job's own sys.exit(86) reads alike)
NUM_FILES = 64  # RLIMIT_NOFILE inside the worker
READY_TIMEOUT_S = 60.0  # a worker that has not finished its set-up by then is a start failure

# The worker's script (`python -I -S -c _RUNNER SPEC_JSON`). It isolates itself rather than via `preexec_fn`,
# which CPython documents as unsafe in a threaded parent such as ours. Order matters: namespaces and mounts
# (need root); rlimits (while root, so RLIMIT_NPROC binds once the uid is nobody; root ignores it); the uid
# drop; the audit hook last, as the set-up itself opens files and calls ctypes.
_RUNNER = r'''
import ctypes, io, json, os, resource, sys, traceback

def isolate(spec):
    notes, why = {}, {}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    def call(name, *args):
        if getattr(libc, name)(*args) != 0:
            raise OSError(ctypes.get_errno(), name + ": " + os.strerror(ctypes.get_errno()))
    root = spec["uid"] is not None
    try:
        if root:
            call("unshare", 0x40000000)  # CLONE_NEWNET: a network with only a loopback, and it is down
        else:
            uid, gid = os.getuid(), os.getgid()
            call("unshare", 0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                with open(path, "w") as f:
                    f.write(text)
        notes["netns"] = True
    except OSError as exc:
        notes["netns"], why["netns"] = False, str(exc)
    if root:
        try:
            call("unshare", 0x20000)  # CLONE_NEWNS, then keep every mount change private to this worker
            call("mount", b"none", b"/", None, (1 << 14) | (1 << 18), None)  # MS_REC | MS_PRIVATE
            notes["hidden"] = expose_python(call)
            notes["mountns"] = True
        except OSError as exc:
            notes["mountns"], why["mountns"] = False, str(exc)
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = int(used.ru_utime + used.ru_stime + spec["cpu_time_s"] + 0.999)
    for limit, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),
                         (resource.RLIMIT_AS, spec["memory_bytes"]), (resource.RLIMIT_FSIZE, spec["max_file_bytes"]),
                         (resource.RLIMIT_NOFILE, spec["num_files"]), (resource.RLIMIT_NPROC, spec["max_processes"])):
        resource.setrlimit(limit, value if isinstance(value, tuple) else (value, value))
    if root:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    notes["uid_dropped"], notes["uid"] = (os.getuid() != 0 if root else None), os.getuid()  # None: not root
    notes["no_new_privs"] = libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS: exec never gains privileges
    for path in sys.path:
        if os.path.isdir(path) and not os.access(path, os.R_OK | os.X_OK):
            raise SystemExit(f"sandbox: uid {os.getuid()} cannot read {path}; see docs/sandbox.md")
    notes["why"] = why
    return notes

def expose_python(call):
    """Cover each directory that hides Python's install from nobody (e.g. /root, mode 700) with an empty
    tmpfs, and bind-mount back, read-only, only the entry that leads to the install."""
    hidden = {}
    for path in [sys.prefix, sys.base_prefix, *sys.path]:
        path = os.path.realpath(path)
        for i in [i for i, c in enumerate(path) if c == "/"]:  # "/", "/root", "/root/.pyenv", ...
            parent = path[:i] or "/"
            if os.path.isdir(parent) and not os.stat(parent).st_mode & 0o001:  # not searchable by others
                hidden.setdefault(parent, set()).add(path[i + 1:].split("/")[0])
                break
    for parent, names in hidden.items():
        fds = {name: os.open(os.path.join(parent, name), os.O_PATH) for name in names}
        call("mount", b"tmpfs", parent.encode(), b"tmpfs", 2 | 4, b"mode=0755,size=64k")  # MS_NOSUID|MS_NODEV
        for name, fd in fds.items():
            target = os.path.join(parent, name).encode()
            os.mkdir(target)
            call("mount", f"/proc/self/fd/{fd}".encode(), target, None, 4096 | (1 << 14), None)  # MS_BIND|MS_REC
            call("mount", None, target, None, 4096 | (1 << 14) | 32 | 1, None)  # ... | MS_REMOUNT | MS_RDONLY
            os.close(fd)
    return sorted(hidden)

def install_hook(workdir):
    realpath, sep = os.path.realpath, os.sep
    reads = tuple({realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path) if p})
    devices = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    denied = ("socket.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
              "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "resource.setrlimit",
              "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "pty.",
              "sqlite3.enable_load_extension", "sqlite3.load_extension", "os.setuid", "os.chroot")
    changes = {"os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
               "os.symlink": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
               "os.mkfifo": (0,), "os.mknod": (0,), "sqlite3.connect": (0,)}

    def under(path, roots):
        return any(path == r or path.startswith(r + sep) for r in roots)
    def where(path, follow):
        path = os.fsdecode(path)
        if not follow:  # the entry itself, not what a symlink there points to
            head, tail = os.path.split(os.path.abspath(path))
            return os.path.join(realpath(head), tail)
        return realpath(path)
    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & writes)
            full = where(path, True)
            if under(full, (workdir,)) or (not write and (under(full, reads) or full in devices)):
                return
            raise PermissionError(f"sandbox: open({full!r}) for {'writing' if write else 'reading'} is not allowed")
        if event in ("os.listdir", "os.scandir"):
            path = args[0] if args and args[0] is not None else "."
            if not isinstance(path, int) and not under(where(path, True), (workdir, *reads)):
                raise PermissionError(f"sandbox: listing {where(path, True)!r} is not allowed")
        elif event in changes:
            for i in changes[event]:
                path = args[i]
                if isinstance(path, (str, bytes, os.PathLike)) and path != ":memory:" and not under(
                        where(path, False), (workdir,)):
                    raise PermissionError(f"sandbox: {event} on {where(path, False)!r} is not allowed")
        elif event.startswith(denied):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event == "import" and args[0] in ("ctypes", "_ctypes", "_posixsubprocess"):
            raise PermissionError(f"sandbox: import {args[0]} is not allowed")

    sys.addaudithook(hook)

def main():
    spec = json.loads(sys.argv[1])
    notes = isolate(spec)
    os.chdir(spec["workdir"])
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # the set-up's ctypes is not handed to the job
    if spec["audit_hook"]:
        install_hook(os.path.realpath(spec["workdir"]))
    notes["audit_hook"] = spec["audit_hook"]
    os.write(1, b"READY " + json.dumps(notes).encode() + b"\n")
    job = json.loads(sys.stdin.buffer.read())
    sys.stdin, sys.argv = io.StringIO(job["stdin"]), ["<sandbox>"]
    sys.modules["__main__"] = module = type(sys)("__main__")  # the job's own, empty __main__
    try:
        exec(compile(job["code"], "<sandbox>", "exec"), module.__dict__)
    except MemoryError:
        print("MemoryError: the sandbox memory limit was reached", file=sys.stderr, flush=True)
        os._exit(spec["memory_exit"])
    except Exception:  # SystemExit passes through: the job's own exit code
        traceback.print_exc()
        sys.exit(1)

main()
'''


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed job and the size of the warm pool."""

    cpu_time_s: float = 5.0  # RLIMIT_CPU of the job (rounded up to whole seconds): SIGXCPU -> "cpu_limit"
    wall_time_s: float = 10.0  # from sending the job to its exit; past it the process group is killed
    memory_mb: int = 512  # RLIMIT_AS, the address space (not resident memory) of the worker
    max_output_bytes: int = 65536  # stdout + stderr kept; past it the job is killed ("output_limit")
    max_file_bytes: int = 1 << 20  # RLIMIT_FSIZE: the largest file the job may write
    max_processes: int = 16  # RLIMIT_NPROC: processes + threads of the worker's uid (shared, see docs)
    workers: int = 4  # warm workers kept ready ahead of calls
    python: str = sys.executable  # interpreter that runs the jobs
    audit_hook: bool = True  # the Python-level second line of defence; False only to test the OS layers

    def __post_init__(self):
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        integer = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        checks = [("cpu_time_s", lambda v: number(v) and v > 0, "a number of seconds > 0"),
                  ("wall_time_s", lambda v: number(v) and v > 0, "a number of seconds > 0"),
                  ("python", lambda v: isinstance(v, str) and os.access(v, os.X_OK), "an executable Python"),
                  ("audit_hook", lambda v: isinstance(v, bool), "True or False")]
        for name, least in (("memory_mb", 32), ("max_output_bytes", 1), ("max_file_bytes", 0),
                            ("max_processes", 1), ("workers", 0)):
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
    pid: int | None = None  # the worker that ran it (gone by the time the result is returned)

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
    proc: subprocess.Popen
    workdir: str
    pid: int
    notes: dict = field(default_factory=dict)  # which isolation layers the worker applied

    def exited(self) -> bool:
        """True once the process has exited (it is left unreaped, so its process group stays valid)."""
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True


def _kill_group(pid: int, sweep: bool = False) -> None:
    """SIGKILL every process of the worker's group (start_new_session made the worker its leader). With
    `sweep` (after the leader is reaped) repeat until the group is empty: a fork bomb's last children."""
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


class Sandbox:
    """A warm pool of one-shot workers. `run` is thread-safe; `close` kills every worker it owns."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self._cond = threading.Condition()
        self._ready: deque[_Worker] = deque()
        self._busy: dict[int, _Worker] = {}
        self._num_starting = self._num_calls = self._num_started = self._num_cold = 0
        self._closed = False
        self._failure: str | None = None
        self.isolation: dict = {}  # the first worker's report of the layers it applied
        self._filler = threading.Thread(target=self._fill, name="sandbox-pool", daemon=True)
        self._filler.start()

    def _start_worker(self) -> _Worker:
        """Start one worker and wait until it reports its isolation applied (or raise RuntimeError)."""
        cfg = self.config
        is_root = os.geteuid() == 0
        workdir = tempfile.mkdtemp(prefix="sandbox-")
        if is_root:
            os.chown(workdir, NOBODY, NOBODY)
        spec = {"workdir": workdir, "cpu_time_s": cfg.cpu_time_s, "memory_bytes": cfg.memory_mb << 20,
                "max_file_bytes": cfg.max_file_bytes, "max_processes": cfg.max_processes,
                "num_files": NUM_FILES, "uid": NOBODY if is_root else None, "audit_hook": cfg.audit_hook,
                "memory_exit": MEMORY_EXIT}
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        args = [cfg.python, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", _RUNNER, json.dumps(spec)]
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=workdir, env=env, start_new_session=True, close_fds=True)
        worker = _Worker(proc, workdir, proc.pid)
        with self._cond:
            self._num_started += 1
        line = b""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 0.1)[0]:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
        if not line.startswith(b"READY "):
            _kill_group(proc.pid)
            proc.wait()
            err = proc.stderr.read().decode(errors="replace").strip()
            self._discard(worker)
            raise RuntimeError(f"sandbox worker failed to start ({cfg.python}): {err or line!r}")
        worker.notes = json.loads(line[6:])
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
                    self._note_isolation(worker.notes)
                    if self._closed:
                        self._discard(worker)
                    else:
                        self._ready.append(worker)
                self._cond.notify_all()

    def _note_isolation(self, notes: dict) -> None:
        if self.isolation:
            return
        self.isolation = dict(notes)
        missing = [k for k in ("uid_dropped", "netns", "mountns") if notes.get(k) is False]
        if missing:
            warnings.warn(f"sandbox isolation layers unavailable here: {', '.join(missing)} "
                          f"({notes.get('why', {})}); see docs/sandbox.md", RuntimeWarning)

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
        self._note_isolation(worker.notes)
        return worker

    def _discard(self, worker: _Worker) -> None:
        _kill_group(worker.pid)
        with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
            worker.proc.wait(timeout=5.0)
        _kill_group(worker.pid, sweep=True)
        for pipe in (worker.proc.stdin, worker.proc.stdout, worker.proc.stderr):
            pipe.close()
        _remove_dir(worker.workdir)

    def run(self, code: str, stdin: str = "") -> ExecResult:
        """Run `code` (with `stdin` as its standard input) in a fresh worker; always returns a result."""
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise TypeError(f"Sandbox.run(code, stdin) takes two str, got {type(code)}, {type(stdin)}")
        start = time.monotonic()
        worker = self._take()
        with self._cond:
            self._busy[worker.pid] = worker
        try:
            return self._execute(worker, code, stdin, start)
        finally:
            with self._cond:
                self._busy.pop(worker.pid, None)
            self._discard(worker)

    def _execute(self, worker: _Worker, code: str, stdin: str, start: float) -> ExecResult:
        proc = worker.proc
        deadline = time.monotonic() + self.config.wall_time_s
        with contextlib.suppress(OSError):  # a worker dead before reading its job: its exit status says how
            proc.stdin.write(json.dumps({"code": code, "stdin": stdin}).encode())
            proc.stdin.close()
        out, err, stopped = self._collect(worker, deadline)
        _kill_group(proc.pid)  # leftovers of a job that exited with children still running
        _, status, usage = os.wait4(proc.pid, 0)
        _kill_group(proc.pid, sweep=True)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu_s = usage.ru_utime + usage.ru_stime
        reason = stopped or self._classify(proc.returncode, cpu_s)
        return ExecResult(ok=reason == "ok", stdout=out.decode(errors="replace"),
                          stderr=err.decode(errors="replace"), exit_code=proc.returncode, reason=reason,
                          seconds=time.monotonic() - start, pid=proc.pid)

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
                _kill_group(proc.pid)  # children holding the pipes open die with the group
            elif exited_at is not None and now - exited_at > 1.0:
                break  # something outside the group still holds a pipe; stop waiting for it
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
            _kill_group(proc.pid)
        return bytes(fds[proc.stdout.fileno()]), bytes(fds[proc.stderr.fileno()]), stopped

    def busy_pids(self) -> list[int]:
        """Pids of the workers running a job right now."""
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
            busy = list(self._busy)
            self._cond.notify_all()
        for worker in ready:
            self._discard(worker)
        for pid in busy:
            _kill_group(pid)
        self._filler.join(timeout=READY_TIMEOUT_S)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
