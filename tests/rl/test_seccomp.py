"""rl/envs/tools/seccomp.py: the compiled BPF program agrees with the plain policy (`decide`) on every
system call number, clone flag and ABI; the table is consistent; in a sandboxed call the denied calls
fail with EPERM while ordinary jobs (threads, a Python subprocess, file I/O) still run."""
import ctypes
import errno
import itertools
import os
import struct

import pytest

from rl.envs.tools import seccomp
from rl.envs.tools.sandbox import Sandbox, SandboxConfig
from rl.envs.tools.seccomp import AUDIT_ARCH, CLONE_NAMESPACES, DENIED, RET_ALLOW, RET_ERRNO, SYSCALLS

NEEDS_BWRAP = pytest.mark.skipif(seccomp.host_arch() not in SYSCALLS or not os.path.exists("/usr/bin/bwrap"),
                                 reason="bubblewrap and a known architecture are needed for sandboxed calls")


def run_bpf(program: bytes, nr: int, arch: int, arg0: int) -> int:
    """A classic-BPF interpreter for the instructions seccomp programs use (LD W ABS, JEQ, JGE, JSET, RET):
    the twin of the kernel's, over struct seccomp_data {nr, arch, ip, args[6]}."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    code = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    for _ in range(len(code) + 1):  # classic BPF only jumps forward: one pass at most
        op, jt, jf, k = code[pc]
        if op == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
        elif op == 0x06:
            return k
        elif op in (0x15, 0x35, 0x45):
            taken = acc == k if op == 0x15 else acc >= k if op == 0x35 else bool(acc & k)
            pc += jt if taken else jf
        else:
            raise AssertionError(f"unexpected BPF op {op:#x}")
        pc += 1
    raise AssertionError("the program did not return")


@pytest.mark.parametrize("arch", sorted(SYSCALLS))
def test_the_program_is_the_policy_on_every_call_number_and_abi(arch):
    program = seccomp.program(arch)
    clone = SYSCALLS[arch]["clone"]
    native = AUDIT_ARCH[arch]
    flags = [0, 0x11, 0x3D0F00, *(1 << b for b in range(32))]  # fork's, pthread's, every single bit
    cases = itertools.chain(((nr, native, 0) for nr in range(0, 600)),
                            ((clone, native, f) for f in flags),
                            ((nr, 0x40000003, 0) for nr in (0, 1, 11, 59)),  # i386 via int 0x80
                            ((0x40000000 | nr, native, 0) for nr in (0, 1, 59)))  # x32
    for nr, abi, arg0 in cases:
        assert run_bpf(program, nr, abi, arg0) == seccomp.decide(arch, abi, nr, arg0), (arch, nr, hex(abi), hex(arg0))


def test_the_policy_denies_what_it_names_and_allows_the_rest():
    table = SYSCALLS["x86_64"]
    native = AUDIT_ARCH["x86_64"]
    eperm, enosys = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
    for name in ("keyctl", "add_key", "request_key", "bpf", "ptrace", "mount", "unshare", "setns", "kexec_load"):
        assert seccomp.decide("x86_64", native, table[name], 0) == eperm, name
    for nr in (0, 1, 2, 3, 9, 57, 58, 59, 60, 231):  # read, write, open, close, mmap, fork, vfork, execve, exit*
        assert seccomp.decide("x86_64", native, nr, 0) == RET_ALLOW, nr
    assert seccomp.decide("x86_64", native, table["clone"], 0x3D0F00) == RET_ALLOW  # a thread
    assert seccomp.decide("x86_64", native, table["clone"], 0x10000000) == eperm  # CLONE_NEWUSER
    assert seccomp.decide("x86_64", native, table["clone3"], 0) == enosys
    assert seccomp.decide("x86_64", AUDIT_ARCH["aarch64"], 0, 0) == eperm  # another ABI's numbers


def test_the_tables_cover_the_denied_list():
    for arch, table in SYSCALLS.items():
        assert set(table) <= set(DENIED) | {"clone", "clone3"}, arch
        assert len(set(table.values())) == len(table), f"{arch}: two names share a number"
    assert set(SYSCALLS["x86_64"]) == set(DENIED) | {"clone", "clone3"}  # every denied call exists on x86_64
    assert all(reason.strip() for reason in DENIED.values())
    assert CLONE_NAMESPACES == 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | \
        0x40000000 | 0x80


def caller_session_keyring() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYSCALLS[seccomp.host_arch()]["keyctl"], 0, -3, 0)  # GET_KEYRING_ID, SESSION


PROBE = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    r = libc.syscall(NR[name], *args)
    print(name, r if r >= 0 else -ctypes.get_errno())
"""


def keyring_job() -> str:
    nr = SYSCALLS[seccomp.host_arch()]
    return (f"NR = {nr!r}\n" + PROBE + "call('keyctl', 0, -3, 0)\n"
            "call('add_key', b'user', b'k', b'v', 1, -3)\ncall('request_key', b'user', b'k', None, -3)\n")


def results(stdout: str) -> dict[str, int]:
    return {line.split()[0]: int(line.split()[1]) for line in stdout.splitlines() if line.strip()}


@NEEDS_BWRAP
def test_in_a_call_the_keyring_calls_fail_and_the_session_keyring_is_not_the_callers():
    config = dict(workers=1, audit_hook=False, backend="bwrap")
    with Sandbox(SandboxConfig(**config)) as box:
        r = box.run(keyring_job())
    assert r.ok, r.stderr
    assert results(r.stdout) == {"keyctl": -errno.EPERM, "add_key": -errno.EPERM, "request_key": -errno.EPERM}
    with Sandbox(SandboxConfig(seccomp=False, **config)) as box:  # the filter off: still a keyring of its own
        r = box.run(keyring_job())
    assert r.ok, r.stderr
    inside = results(r.stdout)["keyctl"]
    mine = caller_session_keyring()
    assert inside > 0 and inside != mine, (inside, mine)


@NEEDS_BWRAP
def test_ordinary_jobs_still_run_under_the_filter():
    job = f"""import os, subprocess, sys, threading, tempfile
out = []
threads = [threading.Thread(target=lambda i=i: out.append(i * i)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
done = subprocess.run([sys.executable, "-I", "-S", "-c", "print(6 * 7)"], capture_output=True, text=True)
pid = os.fork()
if pid == 0:
    os._exit(3)
with open("/tmp/x.txt", "w") as f:
    f.write("data")
with tempfile.NamedTemporaryFile("w+", dir="/tmp") as f:
    f.write("more"); f.flush(); f.seek(0); more = f.read()
print(sorted(out), done.stdout.strip(), os.waitpid(pid, 0)[1] >> 8, open("/tmp/x.txt").read(), more)
"""
    with Sandbox(SandboxConfig(workers=1, audit_hook=False, backend="bwrap", max_processes=16)) as box:
        r = box.run(job)
        assert box.isolation["seccomp"] is True and box.isolation["session_keyring"] > 0
    assert r.ok, r.stderr
    assert r.stdout.split() == ["[0,", "1,", "4,", "9]", "42", "3", "data", "more"]


def test_a_bad_seccomp_value_is_refused_by_name():
    with pytest.raises(ValueError, match="seccomp="):
        SandboxConfig(seccomp="yes")
