"""The red-team driver: run every attack of ATTACKS through the public `Sandbox` API, as whatever user starts
it (root, or an unprivileged uid under `setpriv`), observe what each one did to its caller and the host,
and print one JSON object {attack: observations}. tests/rl/test_sandbox_escape.py runs it and asserts.

    python -B redteam_driver.py REPO PYTHON OUT_JSON [SRC]     (stdlib only: any Python >= 3.10)

REPO is the project tree the attacks aim at; SRC (default REPO) the tree `rl.envs.tools` is imported from.

It imports only rl/envs/tools/ (stdlib modules), and uses only `Sandbox`, `SandboxConfig(cpu_time_s,
wall_time_s, memory_mb, max_output_bytes, max_processes, workers, python, audit_hook)` and `ExecResult`'s
ok/reason/stdout/stderr, so the same suite runs against an older sandbox to show what it let through
(the system call classes take their numbers from rl/envs/tools/seccomp.py's table, the kernel's).
"""
import contextlib
import json
import os
import secrets
import select
import signal
import socket
import sys
import tempfile
import threading
import time

TAG = "rt" + secrets.token_hex(6)  # a marker no host file or process holds unless an attack put it there


SYSCALL_CLASSES = {  # the kernel interfaces the seccomp filter denies, by class: (call, its arguments)
    "kernel keyring": [("keyctl", (0, -3, 0)), ("add_key", (b"user", b"k", b"v", 1, -3)),
                       ("request_key", (b"user", b"k", None, -3))],
    "bpf and perf counters": [("bpf", (0, 0, 0)), ("perf_event_open", (0, 0, -1, -1, 0))],
    "userfaultfd": [("userfaultfd", (0,))],
    "another process's memory": [("process_vm_readv", (1, 0, 0, 0, 0, 0)), ("process_vm_writev", (1, 0, 0, 0, 0, 0)),
                                 ("kcmp", (1, 1, 0, 0, 0))],
    "mount": [("mount", (b"none", b"/tmp", b"tmpfs", 0, 0)), ("umount2", (b"/tmp", 0)), ("pivot_root", (b"/", b"/")),
              ("fsopen", (b"tmpfs", 0)), ("open_tree", (-100, b"/", 0))],
    "new namespaces": [("unshare", (0x10000000,)), ("setns", (-1, 0)), ("clone", (0x10000011, 0, 0, 0, 0))],
    "kernel replacement and modules": [("kexec_load", (0, 0, 0, 0)), ("kexec_file_load", (-1, -1, 0, 0, 0)),
                                       ("init_module", (0, 0, b"")), ("finit_module", (-1, b"", 0)),
                                       ("delete_module", (b"x", 0))],
    "host administration": [("swapon", (b"/tmp/x", 0)), ("swapoff", (b"/tmp/x",)), ("reboot", (0, 0, 0, 0)),
                            ("acct", (None,)), ("quotactl", (0, None, 0, 0)), ("settimeofday", (0, 0)),
                            ("clock_settime", (0, 0)), ("syslog", (10, None, 0))],
    "io_uring": [("io_uring_setup", (1, 0))],
    "open by handle": [("open_by_handle_at", (-1, 0, 0)), ("name_to_handle_at", (-100, b"/", 0, 0, 0))],
}


def syscall_job(calls: list) -> str:
    """A job calling each (name, args) by number through libc.syscall and printing `name result`
    (-errno on failure); a clone that went through exits its child at once."""
    try:
        from rl.envs.tools.seccomp import SYSCALLS, host_arch
        table = SYSCALLS.get(host_arch(), {})
    except ImportError:  # an older sandbox: no table here
        table = {}
    lines = ["import ctypes, os", "libc = ctypes.CDLL(None, use_errno=True)",
             "libc.syscall.restype = ctypes.c_long"]
    for name, args in calls:
        if name in table:
            lines.append(f"r = libc.syscall({table[name]}, *{args!r})")
            lines.append("if r == 0 and os.getpid() != PID:\n    os._exit(0)")
            lines.append(f"print({name!r}, r if r >= 0 else -ctypes.get_errno(), flush=True)")
    return "\n".join(["import os", "PID = os.getpid()", *lines])


def attacks(repo: str, caller: dict) -> list[dict]:
    """(name, job code, audit hook on?, the sibling job to run beside it or None)."""
    run_dir, home, venv = caller["run_dir"], caller["home"], caller["venv"]
    sibling = f"import time\ntime.sleep(2.0)\nprint('sibling {TAG} ok')"
    probe = ("def probe(f):\n    try:\n        print('got', f())\n    except BaseException as e:\n"
             "        print('refused', type(e).__name__)\n")
    return [
        dict(name="dir_fd read and write", hook=True, code=probe + (  # the kernel resolves from fd, a hook from cwd
            "import os\nfds = []\nfor base in ('/', '.', os.path.dirname(os.__file__)):\n    try:\n"
            "        fds.append(os.open(base, os.O_RDONLY))\n    except OSError as e:\n        print('refused', e)\n"
            "try:\n    os.makedirs('/'.join('d' * 16))\n    os.chdir('/'.join('d' * 16))\nexcept OSError as e:\n"
            "    print('refused', e)\nup = '../' * 16\nfor fd in fds:\n"
            f"    probe(lambda: os.read(os.open(up + '{repo.lstrip('/')}/rl/envs/tools/sandbox.py', os.O_RDONLY, dir_fd=fd), 99))\n"
            "    probe(lambda: os.read(os.open(up + 'etc/passwd', os.O_RDONLY, dir_fd=fd), 99))\n"
            f"    probe(lambda: os.write(os.open(up + '{run_dir.lstrip('/')}/dirfd-{TAG}', os.O_WRONLY | os.O_CREAT, dir_fd=fd), b'x'))\n"
            f"    probe(lambda: os.write(os.open(up + '{caller['host_tmp'].lstrip('/')}/dirfd-{TAG}', os.O_WRONLY | os.O_CREAT, dir_fd=fd), b'x'))\n")),
        dict(name="frames to switch the hook off", hook=True, code=probe + (  # a refused call's traceback leads to the hook
            "import sys\nevents = ['os.system', 'subprocess.Popen', 'os.fork', 'os.exec', 'os.posix_spawn', 'ctypes.dlopen']\n"
            "def off():\n    try:\n        open('/etc/shadow')\n    except PermissionError as e:\n"
            "        tb, n = e.__traceback__, 0\n        while tb is not None:\n"
            "            for v in list(tb.tb_frame.f_locals.values()):\n"
            "                for table in (v, getattr(v, '__self__', None)):\n"
            "                    if isinstance(table, dict):\n"
            "                        table.update({k: () for k in events})\n                        n += 1\n"
            "            tb = tb.tb_next\n    return n\nprobe(off)\nimport os\n"
            f"probe(lambda: os.system('echo x > {run_dir}/hook-{TAG}; echo x > {caller['host_tmp']}/hook-{TAG}'))\n"
            f"probe(lambda: __import__('subprocess').run(['/bin/sh', '-c', 'echo x > {caller['host_tmp']}/sub-{TAG}']))\n")),
        dict(name="setsid and double-fork survivors", hook=False, code=(
            "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep-{TAG}', '30'])\n    os._exit(0)\nos.wait()\nprint('forked')")),
        dict(name="kill a sibling worker", hook=False, sibling=sibling, code=(
            "import os, signal, time\ntime.sleep(0.3)\nn = 0\nfor pid in range(2, 1 << 16):\n    try:\n"
            "        if pid != os.getpid():\n            os.kill(pid, signal.SIGKILL)\n            n += 1\n"
            "    except OSError:\n        pass\nprint('signalled', n)")),
        dict(name="signal the caller", hook=False, code=(
            f"import os, signal\nfor pid in (os.getppid(), {caller['pid']}, -1):\n    try:\n"
            "        os.kill(pid, signal.SIGUSR1)\n    except OSError as e:\n        print('refused', e)\n")),
        dict(name="fork bomb", hook=False, code="import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
        dict(name="after the fork bomb, a fork", hook=False, code=(
            "import os\npid = os.fork()\nif pid == 0:\n    os._exit(7)\nprint('child exit', os.waitpid(pid, 0)[1] >> 8)")),
        dict(name="read the project tree", hook=False, code=probe + (
            f"probe(lambda: open('{repo}/rl/envs/tools/sandbox.py').read()[:200])\n"
            f"import os\nprobe(lambda: os.listdir('{repo}'))\nprobe(lambda: os.listdir('{os.path.dirname(repo)}'))\n")),
        dict(name="read the caller's home", hook=False, code=probe + (
            f"probe(lambda: open('{home}/.secret-{TAG}').read())\nimport os\nprobe(lambda: os.listdir('{home}'))\n")),
        dict(name="read /proc of others", hook=False, sibling=sibling, code=probe + (
            "import os, time\ntime.sleep(0.3)\nfor pid in os.listdir('/proc'):\n    if pid.isdigit() and int(pid) != os.getpid():\n"
            "        for entry in ('environ', 'cmdline'):\n"
            "            probe(lambda: open(f'/proc/{pid}/{entry}', 'rb').read())\n"
            "print('pids', len([p for p in os.listdir('/proc') if p.isdigit()]))\n")),
        dict(name="write into the caller's venv and run_dir", hook=False, code=probe + (
            f"probe(lambda: open('{venv}/evil-{TAG}.pth', 'w').write('import os'))\n"
            f"probe(lambda: open('{run_dir}/planted-{TAG}', 'w').write('x'))\n")),
        dict(name="connect to the caller's listener", hook=False, code=probe + (
            f"import socket\nprobe(lambda: socket.create_connection(('127.0.0.1', {caller['port']}), timeout=2))\n")),
        dict(name="/dev/shm", hook=False, code=probe + (
            f"import os\nprobe(lambda: os.listdir('/dev/shm'))\nprobe(lambda: open('/dev/shm/planted-{TAG}', 'w').write('x'))\n")),
        dict(name="ptrace a sibling", hook=False, sibling=sibling, code=(
            "import ctypes, os, time\ntime.sleep(0.3)\nlibc = ctypes.CDLL(None, use_errno=True)\nattached = []\n"
            "for pid in range(2, 1 << 16):\n    if pid != os.getpid() and libc.ptrace(16, pid, 0, 0) == 0:\n"
            "        attached.append(pid)\nprint('attached', attached)")),
        dict(name="10 GB allocation", hook=False, code="x = bytearray(10 * 1024 ** 3)\nprint('allocated')"),
        dict(name="100 MB of output", hook=False, code="import sys\nfor _ in range(100):\n    sys.stdout.write('y' * (1 << 20))"),
        dict(name="an infinite loop", hook=False, code="while True:\n    pass"),
        dict(name="leave files for the next call", hook=False, code=(
            f"open('left-{TAG}', 'w').write('x')\nopen('/tmp/left2-{TAG}', 'w').write('x')\nprint('left')")),
        dict(name="find files left by the last call", hook=False, code=probe + (
            f"import os\nprobe(lambda: open('left-{TAG}').read())\nprobe(lambda: open('/tmp/left2-{TAG}').read())\n"
            f"probe(lambda: [n for n in os.listdir('.') if '{TAG}' in n])\n")),
        *(dict(name=f"system calls: {name}", hook=False, code=syscall_job(calls)) for name, calls in SYSCALL_CLASSES.items()),
    ]


def host_traces(roots: list[str]) -> dict:
    """What of the attacks is visible on the host now: files named with TAG in the directories `roots`,
    processes whose command line holds TAG (survivors)."""
    files = []
    for root in roots:
        with contextlib.suppress(OSError):
            files += [os.path.join(root, n) for n in os.listdir(root) if TAG in n and not n.startswith((".secret", "hostshm"))]
    procs = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if pid.isdigit() and TAG.encode() in cmd:
            procs.append(int(pid))
    return {"files": files, "processes": procs}


def main(repo: str, python: str, out_path: str, src: str | None = None) -> None:
    sys.path.insert(0, src or repo)
    from rl.envs.tools.sandbox import Sandbox, SandboxConfig

    received = []
    signal.signal(signal.SIGUSR1, lambda *_: received.append(time.monotonic()))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    run_dir = tempfile.mkdtemp(prefix="redteam-run-")
    home = os.path.expanduser("~")
    with open(os.path.join(home, f".secret-{TAG}"), "w") as f:
        f.write(f"secret {TAG}")
    venv = os.environ.get("REDTEAM_VENV") or next(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    caller = {"pid": os.getpid(), "port": listener.getsockname()[1], "run_dir": run_dir, "home": home,
              "venv": venv, "host_tmp": tempfile.gettempdir()}
    os.environ["REDTEAM_SECRET"] = f"env-{TAG}"
    shm = f"/dev/shm/hostshm-{TAG}"
    with open(shm, "w") as f:
        f.write("host")
    common = dict(cpu_time_s=3.0, wall_time_s=4.0, memory_mb=256, max_output_bytes=65536, max_processes=32,
                  python=python)
    report = {}
    try:
        with Sandbox(SandboxConfig(workers=2, audit_hook=False, **common)) as off, \
                Sandbox(SandboxConfig(workers=1, audit_hook=True, **common)) as on:
            seen = {"files": set(), "processes": set()}  # traces an earlier attack left are not this one's
            for attack in attacks(repo, caller):
                report[attack["name"]] = run_one(on if attack["hook"] else off, attack, received, listener)
                now = host_traces([run_dir, home, venv, tempfile.gettempdir(), "/dev/shm", repo])
                report[attack["name"]]["host"] = {k: sorted(set(v) - seen[k]) for k, v in now.items()}
                for k, v in now.items():
                    seen[k] |= set(v)
    finally:
        os.remove(os.path.join(home, f".secret-{TAG}"))
        os.remove(shm)
    report["_tag"] = TAG
    with open(out_path, "w") as f:
        json.dump(report, f)


def run_one(sandbox, attack: dict, received: list, listener: socket.socket) -> dict:
    """Run one attack (and its sibling job beside it); what the caller saw."""
    sibling = {}
    thread = None
    if attack.get("sibling"):
        thread = threading.Thread(target=lambda: sibling.update(result=sandbox.run(attack["sibling"])))
        thread.start()
        time.sleep(0.1)
    before, start = len(received), time.monotonic()
    result = sandbox.run(attack["code"])
    seconds = time.monotonic() - start
    if thread is not None:
        thread.join(timeout=30)
    time.sleep(0.2)  # a signal or a survivor's write would land by now
    connected = bool(select.select([listener], [], [], 0)[0])
    if connected:
        listener.accept()[0].close()
    out = {"ok": result.ok, "reason": result.reason, "stdout": result.stdout[-4000:], "stderr": result.stderr[-2000:],
           "bytes": len(result.stdout.encode()) + len(result.stderr.encode()), "seconds": seconds,
           "signals": len(received) - before, "connected": connected}
    if thread is not None:
        sib = sibling.get("result")
        out["sibling"] = {"ok": sib is not None and sib.ok, "stdout": sib.stdout if sib is not None else ""}
    return out


if __name__ == "__main__":
    main(*sys.argv[1:5])
