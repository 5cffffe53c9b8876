"""The script a sandbox worker runs (`python -I -S -B -u -X utf8 -c <this file's text> SPEC_JSON`).

It is sent as text: inside bubblewrap the project tree does not exist, only the interpreter and its standard
library. It imports nothing of ours. Order: rlimits (while still root, so RLIMIT_NPROC binds once the uid
is the slot's; root ignores it), the uid drop (as root only: bubblewrap started it with CAP_SETUID and
CAP_SETGID, which the drop clears), no_new_privs, a fresh anonymous session keyring (nothing of the
caller's keyring is reachable, filter or not), the seccomp filter (its compiled program comes in the spec:
rl/envs/tools/seccomp.py; nothing after it needs a denied call), the audit hook last (the set-up itself
uses ctypes). Then "READY {notes}" on stdout, one job read from stdin, run, exit: one worker, one job.

The audit hook is a second layer only: code that corrupts the interpreter's memory removes it, and the
boundary is the OS (bubblewrap's namespaces, the uid, the rlimits). It refuses what model code has no use
for and what escapes were built from: opens outside the scratch dir (read-only opens of the standard
library excepted), opening a directory outside it (a `dir_fd` base), `os.chdir`, reaching frames
(`tb_frame`, `sys._getframe`, tracers), processes, signals to others, sockets, ctypes, raising rlimits.
Its tables are immutable (a frame reached anyway finds nothing to switch off).
"""
import ctypes
import io
import json
import os
import resource
import sys


def limit(spec):
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = int(used.ru_utime + used.ru_stime + spec["cpu_time_s"] + 0.999)
    for which, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),
                         (resource.RLIMIT_AS, spec["memory_bytes"]), (resource.RLIMIT_FSIZE, spec["max_file_bytes"]),
                         (resource.RLIMIT_NOFILE, spec["num_files"]), (resource.RLIMIT_NPROC, spec["max_processes"])):
        resource.setrlimit(which, value if isinstance(value, tuple) else (value, value))


def drop(spec):
    """The uid drop (root only), no_new_privs; what was applied, for the pool's report."""
    if spec["drop_to"] is not None:
        os.setgroups([])
        os.setgid(spec["drop_to"])
        os.setuid(spec["drop_to"])
    libc = ctypes.CDLL(None, use_errno=True)
    nnp = libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS: exec never gains privileges
    for path in sys.path:
        if os.path.isdir(path) and not os.access(path, os.R_OK | os.X_OK):
            raise SystemExit(f"sandbox: uid {os.getuid()} cannot read {path}; see docs/sandbox.md")
    return {"uid": os.getuid(), "pid": os.getpid(), "no_new_privs": nnp, "root": os.getuid() == 0,
            "session_keyring": new_keyring(libc, spec["keyctl_nr"])}


def new_keyring(libc, keyctl_nr):
    """Join a new anonymous session keyring (KEYCTL_JOIN_SESSION_KEYRING, no name); its serial, or None
    where the host refuses keyctl already (e.g. a container's own filter) or the architecture is unknown."""
    if keyctl_nr is None:
        return None
    serial = libc.syscall(keyctl_nr, 1, None)
    return serial if serial > 0 else None


def filter_calls(spec):
    """Load the seccomp program (hex of struct sock_filter[]) with prctl(PR_SET_SECCOMP, FILTER); needs
    no_new_privs. A refusal is a start failure: the pool reports it, no job runs unfiltered."""
    program = bytes.fromhex(spec["seccomp"])

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(program, len(program))
    fprog = Fprog(len(program) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise SystemExit(f"sandbox: the seccomp filter was refused: {os.strerror(ctypes.get_errno())}")


def install_hook(workdir):
    realpath, sep, isdir = os.path.realpath, os.sep, os.path.isdir
    reads = tuple({realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path) if p})
    devices = frozenset(("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"))
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    denied = ("socket.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
              "os.forkpty", "os.kill", "os.killpg", "os.chdir", "signal.pthread_kill", "ctypes.",
              "resource.setrlimit", "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
              "pty.", "sqlite3.enable_load_extension", "sqlite3.load_extension", "os.setuid", "os.chroot",
              "sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile", "sys._current_exceptions",
              "cpython._PySys_ClearAuditHooks", "code.__new__", "function.__new__")
    frames = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"))
    changes = (("os.mkdir", (0,)), ("os.remove", (0,)), ("os.rmdir", (0,)), ("os.rename", (0, 1)),
               ("os.link", (0, 1)), ("os.symlink", (1,)), ("os.truncate", (0,)), ("os.chmod", (0,)),
               ("os.chown", (0,)), ("os.utime", (0,)), ("os.mkfifo", (0,)), ("os.mknod", (0,)),
               ("sqlite3.connect", (0,)))

    def under(path, roots):
        return any(path == r or path.startswith(r + sep) for r in roots)

    def where(path, follow):
        path = os.path.join(workdir, os.fsdecode(path))  # relative to the scratch dir: chdir is refused
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
            if under(full, (workdir,)) or (not write and not isdir(full) and (under(full, reads) or full in devices)):
                return
            raise PermissionError(f"sandbox: open({full!r}) for {'writing' if write else 'reading'} is not allowed")
        if event in ("os.listdir", "os.scandir"):
            path = args[0] if args and args[0] is not None else "."
            if not isinstance(path, int) and not under(where(path, True), (workdir, *reads)):
                raise PermissionError(f"sandbox: listing {where(path, True)!r} is not allowed")
        elif any(event == name for name, _ in changes):
            for i in next(where_ for name, where_ in changes if name == event):
                path = args[i]
                if isinstance(path, (str, bytes, os.PathLike)) and path != ":memory:" and not under(
                        where(path, False), (workdir,)):
                    raise PermissionError(f"sandbox: {event} on {where(path, False)!r} is not allowed")
        elif event.startswith(denied):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event == "object.__getattr__" and args[1] in frames:
            raise PermissionError(f"sandbox: reading .{args[1]} is not allowed")
        elif event == "import" and args[0] in ("ctypes", "_ctypes", "_posixsubprocess"):
            raise PermissionError(f"sandbox: import {args[0]} is not allowed")

    sys.addaudithook(hook)


def main():
    spec = json.loads(sys.argv[1])
    limit(spec)
    notes = drop(spec)
    os.chdir(spec["workdir"])
    if spec["seccomp"] is not None:
        filter_calls(spec)
    notes["seccomp"] = spec["seccomp"] is not None
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
    # any other exception: the interpreter prints its traceback (in C, past the hook) and exits 1


if __name__ == "__main__":  # `python -c`: the text runs as __main__; an import runs nothing
    main()
