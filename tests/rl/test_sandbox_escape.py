"""The red-team suite: every attack of tests/rl/redteam_driver.py, run through the public Sandbox API as root
and as an unprivileged user (setpriv), each asserted by its concrete effect on the caller and the host: the
file is absent, the signal never arrived, the sibling worker finished, no process of the call remains.

Most attacks run with the audit hook OFF: the OS layers must hold on their own (the hook is a second layer
that code can get around); the two attacks on the hook itself run with it on. The driver uses only the API
an older sandbox had, so the same suite, run against it, shows what it let through."""
import errno
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rl.envs.tools.seccomp import SYSCALLS, host_arch
from tests.rl.redteam_driver import SYSCALL_CLASSES, attacks

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("redteam_driver.py")
WALL_S = 4.0  # the driver's SandboxConfig.wall_time_s
NAMES = [a["name"] for a in attacks("/repo", {"run_dir": "/r", "home": "/h", "venv": "/v", "pid": 1, "port": 1,
                                              "host_tmp": "/tmp"})]


def unprivileged_user() -> tuple[int, str] | None:
    """(uid, a system Python it can run) when this host lets root drop to an ordinary user, else None."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.access(python, os.X_OK):
        return None
    for uid in (1000, 65534):
        try:
            pwd.getpwuid(uid)
            return uid, python
        except KeyError:
            continue
    return None


def run_driver(as_user: tuple[int, str] | None) -> dict:
    """Run the driver (as root, or as `as_user` = (uid, python)); its report, or a report of its death."""
    work = tempfile.mkdtemp(prefix="redteam-")
    os.chmod(work, 0o755)
    out = os.path.join(work, "report.json")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "HOME")}
    if as_user is None:
        argv = [sys.executable, "-B", str(DRIVER), str(REPO), sys.executable, out]
    else:
        uid, python = as_user
        for name in ("home", "tmp", "venv"):
            os.mkdir(os.path.join(work, name))
            os.chown(os.path.join(work, name), uid, uid)
        os.chown(work, uid, uid)
        env |= {"HOME": os.path.join(work, "home"), "TMPDIR": os.path.join(work, "tmp"),
                "REDTEAM_VENV": os.path.join(work, "venv")}
        src = os.path.join(work, "src")  # what the driver imports, readable by the user wherever the repo lives
        shutil.copytree(REPO / "rl" / "envs" / "tools", os.path.join(src, "rl", "envs", "tools"))
        for package in ("rl", "rl/envs"):
            shutil.copy(REPO / package / "__init__.py", os.path.join(src, package, "__init__.py"))
        shutil.copy(DRIVER, os.path.join(src, DRIVER.name))
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", python, "-B",
                os.path.join(src, DRIVER.name), str(REPO), python, out, src]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if not os.path.exists(out):
            return {"_died": f"the driver ended with {done.returncode} and no report: {done.stderr[-2000:]}"}
        with open(out) as f:
            return json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_REPORTS: dict[str, dict] = {}


@pytest.fixture(scope="module", params=["root", "non-root"])
def report(request):
    if request.param == "root" and os.geteuid() != 0:
        pytest.skip("this process is not root: the non-root run covers it")
    user = unprivileged_user() if request.param == "non-root" and os.geteuid() == 0 else None
    if request.param == "non-root" and os.geteuid() == 0 and user is None:
        pytest.skip("no way to drop to an unprivileged user here (setpriv, /usr/bin/python3)")
    if request.param not in _REPORTS:
        _REPORTS[request.param] = run_driver(user)
    rep = _REPORTS[request.param]
    assert "_died" not in rep, rep.get("_died")
    return rep


def refused_everything(r: dict) -> bool:
    """Every probe of the attack printed 'refused' (none printed 'got')."""
    lines = r["stdout"].splitlines()
    return not any(line.startswith("got") for line in lines) and any(line.startswith("refused") for line in lines)


CHECKS = {
    "dir_fd read and write": lambda r, tag: "got b'" not in r["stdout"],  # nothing read (a write lands in its tmpfs)
    "frames to switch the hook off": lambda r, tag: True,  # the host checks: no file of the escaped shell
    "setsid and double-fork survivors": lambda r, tag: r["ok"] and r["stdout"] == "forked\n",
    "kill a sibling worker": lambda r, tag: r["sibling"]["ok"] and f"sibling {tag} ok" in r["sibling"]["stdout"],
    "signal the caller": lambda r, tag: r["ok"],
    "fork bomb": lambda r, tag: not r["ok"] and r["seconds"] < WALL_S + 10,
    "after the fork bomb, a fork": lambda r, tag: r["ok"] and r["stdout"] == "child exit 7\n",
    "read the project tree": lambda r, tag: refused_everything(r),
    "read the caller's home": lambda r, tag: f"secret {tag}" not in r["stdout"] and ".secret" not in r["stdout"],
    "read /proc of others": lambda r, tag: (f"env-{tag}" not in r["stdout"] and "sibling" not in r["stdout"]
                                            and int(r["stdout"].split("pids")[-1]) <= 3),
    "write into the caller's venv and run_dir": lambda r, tag: refused_everything(r),
    "connect to the caller's listener": lambda r, tag: refused_everything(r),
    "/dev/shm": lambda r, tag: "hostshm" not in r["stdout"],
    "ptrace a sibling": lambda r, tag: r["stdout"] == "attached []\n" and r["sibling"]["ok"],
    "10 GB allocation": lambda r, tag: r["reason"] == "memory",
    "100 MB of output": lambda r, tag: r["reason"] == "output_limit" and r["bytes"] <= 65536,
    "an infinite loop": lambda r, tag: r["reason"] in ("timeout", "cpu_limit") and r["seconds"] < WALL_S + 6,
    "leave files for the next call": lambda r, tag: r["ok"],
    "find files left by the last call": lambda r, tag: r["stdout"].count("refused") == 2 and "got []" in r["stdout"],
}


def denied_with_eperm(r: dict, calls: list) -> bool:
    """Every call of the class that exists here printed `name -1` (EPERM), and nothing else printed."""
    expected = [name for name, _ in calls if name in SYSCALLS.get(host_arch(), {})]
    lines = [line.split() for line in r["stdout"].splitlines() if line.strip()]
    return r["ok"] and bool(expected) and lines == [[name, str(-errno.EPERM)] for name in expected]


CHECKS |= {f"system calls: {name}": lambda r, tag, calls=calls: denied_with_eperm(r, calls)
           for name, calls in SYSCALL_CLASSES.items()}


def test_every_attack_has_a_check():
    assert sorted(CHECKS) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_the_attack_has_no_effect(report, name):
    r, tag = report[name], report["_tag"]
    assert r["host"] == {"files": [], "processes": []}, (name, r)  # nothing planted, no survivor
    assert r["signals"] == 0 and not r["connected"], (name, r)  # the caller untouched
    assert CHECKS[name](r, tag), (name, r)
