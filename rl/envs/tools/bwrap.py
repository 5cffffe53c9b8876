"""The OS boundary of a sandbox worker: bubblewrap's command line, whether this host allows it, the uid of
each slot, and cgroup v2 limits where the host delegates them (rl/envs/tools/sandbox.py uses these).

A worker runs as `bwrap ... -- python -I -S ... <runner>`: new PID, network, IPC, UTS (and cgroup) namespaces
and a new mount namespace whose root holds only /usr, the interpreter and its standard library (read-only),
a fresh /proc of the new PID namespace, a minimal /dev, and two size-capped tmpfs (/tmp, the only place the
job may write, and /dev/shm). As root there is no user namespace: bubblewrap hands the runner CAP_SETUID and
CAP_SETGID, and the runner drops to the slot's host uid (a distinct one per concurrent worker, claimed
machine-wide). As non-root a user namespace maps the slot's uid onto the caller's, and `--disable-userns`
stops the job from making further ones. `--die-with-parent` ends the sandbox with its caller; killing the
namespace's init (pid 1, whose host pid `--info-fd` reports) ends every process of the call at once.
"""
from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import pwd
import shutil
import subprocess
import tempfile
import threading

LOG = logging.getLogger("rl.sandbox")
BACKENDS = ("bwrap", "none")
SCRATCH = "/tmp"  # the job's working dir inside the sandbox: a fresh tmpfs per call
UID_BASE, UID_SPAN = 61000, 4000  # the slots' host uids when root: 61000, 61001, ... (skipping /etc/passwd's)
_PYINFO = "import json, sys; print(json.dumps([sys.base_prefix, sys.path]))"


class SandboxUnavailable(RuntimeError):
    """The chosen backend cannot run here; the message is one line saying what to install or enable."""


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.lru_cache(maxsize=None)
def interpreter(python: str) -> tuple[str, tuple[str, ...]]:
    """(the interpreter's real path, the directories to bind read-only for it: its standard library's
    entries of `sys.path` under -I -S, and the prefix's lib/ when it holds a shared libpython)."""
    exe = os.path.realpath(python)
    out = subprocess.run([exe, "-I", "-S", "-c", _PYINFO], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SandboxUnavailable(f"sandbox: {python} -I -S does not start: {out.stderr.strip()[-300:]}")
    prefix, path = json.loads(out.stdout)
    roots = {os.path.realpath(p) for p in path if os.path.isdir(p)}
    lib = os.path.join(prefix, "lib")
    if os.path.isdir(lib) and any(n.startswith("libpython") and ".so" in n for n in os.listdir(lib)):
        roots.add(os.path.realpath(lib))
    roots.add(os.path.dirname(exe))
    return exe, tuple(sorted(r for r in roots if not r.startswith("/usr/")))


def _root_entries() -> list[str]:
    """/usr read-only, and the top-level /bin, /lib, /lib64, /sbin as the host has them (links into /usr on a
    merged-/usr system, else read-only binds)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    return args


def command(python: str, *, uid: int, root: bool, scratch_bytes: int, info_fd: int, runner: str,
            spec: str) -> list[str]:
    """The bwrap command line of one worker (module docstring)."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxUnavailable(missing_message())
    exe, binds = interpreter(python)
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try"]
    if root:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--disable-userns", "--uid", str(uid), "--gid", str(uid)]
    args += _root_entries()
    made = {"/"}
    for path in binds:  # each parent made searchable (0755): the host's may be private (e.g. /root)
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            parent = "/" + "/".join(parts[:i])
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
    for path in binds:
        args += ["--ro-bind", path, path]
        if os.path.isdir(os.path.join(path, "site-packages")):  # the base install's packages stay hidden
            args += ["--size", "4096", "--tmpfs", os.path.join(path, "site-packages")]
    size = str(scratch_bytes)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm",
             "--size", size, "--perms", "1777", "--tmpfs", SCRATCH, "--chdir", SCRATCH, "--clearenv",
             "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", SCRATCH,
             "--setenv", "LANG", "C.UTF-8", "--info-fd", str(info_fd), "--",
             exe, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", runner, spec]
    return args


def missing_message() -> str:
    return ("sandbox: bubblewrap (`bwrap`) is not installed: `apt-get install bubblewrap` (the Makefile's "
            "`make apt` does), or set sandbox.backend=none to run model-written code WITHOUT isolation")


_CHECKED: set[str] = set()


def check(python: str) -> None:
    """Raise SandboxUnavailable (one line) unless bwrap can build a worker's namespaces for `python` here;
    a success is remembered for the process."""
    if python in _CHECKED:
        return
    if bwrap_path() is None:
        raise SandboxUnavailable(missing_message())
    r, w = os.pipe()
    try:
        argv = command(python, uid=UID_BASE, root=os.geteuid() == 0, scratch_bytes=1 << 16, info_fd=w,
                       runner="pass", spec="{}")
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, pass_fds=(w,))
    finally:
        os.close(r)
        os.close(w)
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        raise SandboxUnavailable(
            f"sandbox: bubblewrap cannot build the sandbox's namespaces here ({why}); allow unprivileged user "
            f"namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1; in a container, "
            f"a seccomp/AppArmor profile that permits them) or run as root, or set sandbox.backend=none to run "
            f"model-written code WITHOUT isolation")
    _CHECKED.add(python)


class SlotUids:
    """The uid of each concurrent worker. As root: host uids from UID_BASE, each claimed machine-wide by an
    flock on a file in a root-only directory, held while the uid is in use (two pools, in one process or
    several, never share one, so RLIMIT_NPROC is each slot's own). As non-root: uids inside each call's
    user namespace (distinct per slot; no two calls share a namespace, so nothing is claimed)."""

    def __init__(self, root: bool) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._held: dict[int, int] = {}  # uid -> fd of its lock file
        self._dir = os.path.join(tempfile.gettempdir(), "rl-sandbox-uids")

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            if not self.root:
                uid = UID_BASE + len(self._held)
                self._held[uid] = -1
                return uid
            os.makedirs(self._dir, mode=0o700, exist_ok=True)
            for uid in range(UID_BASE, UID_BASE + UID_SPAN):
                if uid in self._held or _has_user(uid):
                    continue
                fd = os.open(os.path.join(self._dir, f"{uid}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held[uid] = fd
                return uid
        raise RuntimeError(f"sandbox: all {UID_SPAN} slot uids from {UID_BASE} are in use")

    def give(self, uid: int) -> None:
        """`uid` is free again (its worker's processes are all gone)."""
        with self._lock:
            if uid in self._held:
                self._free.append(uid)

    def close(self) -> None:
        with self._lock:
            for fd in self._held.values():
                if fd >= 0:
                    os.close(fd)
            self._held.clear()
            self._free.clear()


def _has_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


@functools.lru_cache(maxsize=1)
def cgroup_parent() -> str | None:
    """The cgroup v2 directory under which each worker gets a child with memory, pids and cpu limits: this
    process's own cgroup when those controllers are delegated to its children and it is writable; else
    None, said once in the log."""
    try:
        mount = next((line.split()[4] for line in open("/proc/self/mountinfo") if " - cgroup2 " in line), None)
        own = next((line.strip()[3:] for line in open("/proc/self/cgroup") if line.startswith("0::")), None)
    except OSError:
        mount = own = None
    why = "no cgroup2 hierarchy is mounted"
    if mount is not None and own is not None:
        base = os.path.join(mount, own.lstrip("/"))
        try:
            enabled = open(os.path.join(base, "cgroup.subtree_control")).read().split()
        except OSError:
            enabled = []
        if {"memory", "pids", "cpu"} <= set(enabled) and os.access(base, os.W_OK):
            return base
        why = f"{base} delegates {' '.join(enabled) or 'no controllers'} to its children"
    LOG.warning("sandbox: cgroup v2 memory/pids/cpu limits are not available here (%s); each call is "
                "limited by its rlimits (address space, CPU time, processes per slot uid) only", why)
    return None


def make_cgroup(parent: str, name: str, *, memory_bytes: int, pids: int, cpus: float = 1.0) -> str:
    """A child cgroup of `parent` with the call's limits; the worker is started inside it by `in_cgroup`."""
    path = os.path.join(parent, name)
    os.mkdir(path)
    for key, value in (("memory.max", str(memory_bytes)), ("memory.swap.max", "0"), ("pids.max", str(pids)),
                       ("cpu.max", f"{int(cpus * 100000)} 100000")):
        if key != "memory.swap.max" or os.path.exists(os.path.join(path, key)):
            with open(os.path.join(path, key), "w") as f:
                f.write(value)
    return path


def in_cgroup(path: str, argv: list[str]) -> list[str]:
    """`argv` started by a shell that first moves itself into cgroup `path` (so every process of the call,
    bwrap's included, is in it from the start), then execs."""
    return ["/bin/sh", "-c", 'echo 0 > "$0/cgroup.procs" && exec "$@"', path, *argv]


def remove_cgroup(path: str) -> None:
    """Remove a worker's cgroup once its processes are gone (a busy one is left, and said in the log)."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        LOG.warning("sandbox: could not remove cgroup %s: %s", path, err)
