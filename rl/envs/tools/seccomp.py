"""The seccomp filter of every sandboxed call: the kernel interfaces no Python job needs fail with EPERM.

Modelled on Docker's default profile, as a deny list (everything else is allowed: the sandbox's other
layers, namespaces, uid, rlimits, bound what remains). `DENIED` names each denied system call and why,
in one place; `program()` compiles it to a classic-BPF seccomp program for this machine's architecture;
`decide()` is the same policy written plainly (the reference twin the tests run the program against).
The runner (rl/envs/tools/sandbox_worker.py) loads the program with prctl(PR_SET_SECCOMP) after its
own set-up (rlimits, the uid drop, no_new_privs, a fresh session keyring) and before the job's first
byte runs, so the job and everything it starts inherit it; nothing can remove a seccomp filter.

Beyond the list: `clone` with any namespace flag (CLONE_NEW*) fails with EPERM (plain fork and threads
pass); `clone3`, whose flags sit in a struct the filter cannot read, fails with ENOSYS so that the C
library falls back to `clone`, as Docker does; a system call of another ABI (i386 through int 0x80 or
x32 on x86_64) fails with EPERM, since its numbers are not the table's.

Stdlib only: the runner is sent as text, and the red-team driver imports this module for the numbers.
"""
from __future__ import annotations

import errno
import platform
import struct

DENIED: dict[str, str] = {
    "keyctl": "the kernel keyring is shared with the caller (its session keyring is reachable by serial)",
    "add_key": "writes into a kernel keyring",
    "request_key": "asks the kernel (and its upcalls) for keys",
    "bpf": "loads programs into the kernel; the largest recent source of kernel exploits",
    "perf_event_open": "kernel and hardware counters; side channels and a history of exploits",
    "userfaultfd": "lets a job stall the kernel mid-copy, the usual way to widen a race",
    "ptrace": "reads and writes other processes; a job debugs nothing",
    "process_vm_readv": "reads another process's memory",
    "process_vm_writev": "writes another process's memory",
    "kcmp": "compares kernel objects of other processes (an address oracle)",
    "mount": "changes the mount tree",
    "umount2": "changes the mount tree",
    "pivot_root": "changes the root",
    "move_mount": "the new mount API",
    "open_tree": "the new mount API",
    "fsopen": "the new mount API",
    "fsconfig": "the new mount API",
    "fsmount": "the new mount API",
    "fspick": "the new mount API",
    "mount_setattr": "the new mount API",
    "unshare": "new namespaces: where user-namespace exploits start",
    "setns": "joins other namespaces",
    "open_by_handle_at": "opens files by handle past the mount tree (the shocker escape)",
    "name_to_handle_at": "the handle half of open_by_handle_at",
    "kexec_load": "replaces the running kernel",
    "kexec_file_load": "replaces the running kernel",
    "init_module": "loads kernel modules",
    "finit_module": "loads kernel modules",
    "delete_module": "unloads kernel modules",
    "swapon": "host swap configuration",
    "swapoff": "host swap configuration",
    "reboot": "host power state",
    "acct": "host process accounting",
    "quotactl": "host disk quotas",
    "quotactl_fd": "host disk quotas",
    "syslog": "reads the kernel log (addresses)",
    "lookup_dcookie": "kernel profiling",
    "personality": "switches the ABI (e.g. disables address randomisation)",
    "settimeofday": "host clock",
    "clock_settime": "host clock",
    "clock_adjtime": "host clock",
    "adjtimex": "host clock",
    "nfsservctl": "kernel NFS server",
    "io_uring_setup": "a second system call interface seccomp cannot see into",
    "io_uring_enter": "a second system call interface seccomp cannot see into",
    "io_uring_register": "a second system call interface seccomp cannot see into",
    "iopl": "raw port I/O (x86)",
    "ioperm": "raw port I/O (x86)",
    "uselib": "loads a library the old way (obsolete)",
    "create_module": "obsolete module interface",
    "get_kernel_syms": "obsolete module interface",
    "query_module": "obsolete module interface",
    "sysfs": "obsolete",
    "_sysctl": "obsolete",
}
"""Every system call the filter denies with EPERM, and why a job has no use for it."""

CLONE_NAMESPACES = 0x7E020080
"""CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME: a clone with any of
them fails with EPERM."""

SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "mount": 165,
        "umount2": 166, "pivot_root": 155, "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "unshare": 272, "setns": 308,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "kexec_load": 246, "kexec_file_load": 320,
        "init_module": 175, "finit_module": 313, "delete_module": 176, "swapon": 167, "swapoff": 168,
        "reboot": 169, "acct": 163, "quotactl": 179, "quotactl_fd": 443, "syslog": 103, "lookup_dcookie": 212,
        "personality": 135, "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
        "nfsservctl": 180, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "iopl": 172, "ioperm": 173, "uselib": 134, "create_module": 174, "get_kernel_syms": 177,
        "query_module": 178, "sysfs": 139, "_sysctl": 156, "clone": 56, "clone3": 435},
    "aarch64": {  # the generic table (asm-generic/unistd.h); the x86-only and obsolete calls do not exist
        "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "mount": 40,
        "umount2": 39, "pivot_root": 41, "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "unshare": 97, "setns": 268,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "kexec_load": 104, "kexec_file_load": 294,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "swapon": 224, "swapoff": 225,
        "reboot": 142, "acct": 89, "quotactl": 60, "quotactl_fd": 443, "syslog": 116, "lookup_dcookie": 18,
        "personality": 92, "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171,
        "nfsservctl": 42, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "clone": 220, "clone3": 435},
}
"""System call numbers per architecture (the kernel's tables), for DENIED plus clone and clone3."""

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_BIT = 0x40000000  # x86_64: a system call number with this bit is the x32 ABI's

RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data (args[0]'s low word: little-endian)


def host_arch() -> str:
    """This host's architecture, named as SYSCALLS names them."""
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())


def machine() -> str:
    """This host's architecture as SYSCALLS names it; ValueError naming it when the filter has no table."""
    m = host_arch()
    if m not in SYSCALLS:
        raise ValueError(f"sandbox.seccomp: no system call table for architecture {platform.machine()!r} "
                         f"(have {', '.join(SYSCALLS)}); set sandbox.seccomp=false to run without the filter")
    return m


def denied_numbers(arch: str) -> dict[int, str]:
    """{number: name} of the calls DENIED that exist on `arch`."""
    table = SYSCALLS[arch]
    return {table[name]: name for name in DENIED if name in table}


def decide(arch: str, audit_arch: int, nr: int, arg0: int) -> int:
    """The policy, plainly: the seccomp return value for system call `nr` (ABI `audit_arch`, first
    argument `arg0`) in a process of architecture `arch`."""
    table = SYSCALLS[arch]
    if audit_arch != AUDIT_ARCH[arch] or (arch == "x86_64" and nr >= X32_BIT):
        return RET_ERRNO | errno.EPERM
    if nr in denied_numbers(arch):
        return RET_ERRNO | errno.EPERM
    if nr == table["clone"] and arg0 & CLONE_NAMESPACES:
        return RET_ERRNO | errno.EPERM
    if nr == table["clone3"]:
        return RET_ERRNO | errno.ENOSYS
    return RET_ALLOW


def program(arch: str | None = None) -> bytes:
    """The filter as struct sock_filter[] (8 bytes each: code u16, jt u8, jf u8, k u32), native-endian."""
    arch = arch or machine()
    table, denied = SYSCALLS[arch], sorted(denied_numbers(arch))
    # Layout: arch check, x32 check, one JEQ per denied number, clone, clone3, ALLOW, then the
    # clone-flags check, then the two refusals. Jumps count instructions after the jumping one.
    body: list[tuple[int, int, int, int]] = [(_LD_W_ABS, 0, 0, _ARCH), None, (_LD_W_ABS, 0, 0, _NR), None]
    body += [None] * len(denied) + [None, None, (_RET, 0, 0, RET_ALLOW),
                                    (_LD_W_ABS, 0, 0, _ARG0_LOW), None, (_RET, 0, 0, RET_ALLOW),
                                    (_RET, 0, 0, RET_ERRNO | errno.EPERM), (_RET, 0, 0, RET_ERRNO | errno.ENOSYS)]
    eperm, enosys, flags = len(body) - 2, len(body) - 1, len(body) - 5

    def jump(at: int, to: int) -> int:
        off = to - at - 1
        if not 0 <= off <= 255:
            raise AssertionError(f"seccomp program: a jump of {off} instructions does not fit BPF's 8 bits")
        return off

    body[1] = (_JEQ, 0, jump(1, eperm), AUDIT_ARCH[arch])
    body[3] = (_JGE, jump(3, eperm), 0, X32_BIT) if arch == "x86_64" else (_JGE, 0, 0, 0)  # no x32: a no-op
    for i, nr in enumerate(denied):
        at = 4 + i
        body[at] = (_JEQ, jump(at, eperm), 0, nr)
    at = 4 + len(denied)
    body[at] = (_JEQ, jump(at, flags), 0, table["clone"])
    body[at + 1] = (_JEQ, jump(at + 1, enosys), 0, table["clone3"])
    body[flags + 1] = (_JSET, jump(flags + 1, eperm), 0, CLONE_NAMESPACES)
    return b"".join(struct.pack("=HBBI", *ins) for ins in body)
