"""Kernel containment parts of the sandbox: the seccomp-bpf filter and the per-run cgroups.

The filter is compiled once per host process by libseccomp (`pyseccomp`) and
handed to bubblewrap (`bwrap --seccomp FD`), which installs it before the
program starts; it denies what a graded program has no use for and what would
let it leave or inspect its box (new namespaces, mounts, bpf, keyrings,
ptrace, kernel modules, ...). Each run gets its own memory, pids and cpu
cgroup (v1 controllers under /sys/fs/cgroup) that bounds the whole process
tree, whatever it forks.
"""

from __future__ import annotations

import errno
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
_GROUP = "composer-mesh-sandbox"
_CPU_PERIOD_US = 100_000
# clone(2) flags that create namespaces: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME.
_CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
DENIED_SYSCALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsmount", "fsconfig", "fspick", "mount_setattr", "bpf", "keyctl", "add_key", "request_key", "ptrace",
    "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "perf_event_open", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "open_by_handle_at", "name_to_handle_at", "swapon", "swapoff",
    "reboot", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
    "personality", "lookup_dcookie", "vhangup", "iopl", "ioperm", "fanotify_init", "mbind",
    "set_mempolicy", "migrate_pages", "move_pages",
)


class ContainmentUnavailable(RuntimeError):
    """libseccomp or the cgroup controllers are missing; nothing may be graded without them."""


def seccomp_filter(extra: tuple[str, ...] = ()) -> bytes:
    """The compiled BPF program (made once per process; each run hands bwrap a memfd holding it).

    extra: syscalls denied besides `DENIED_SYSCALLS` (a pool worker also denies the IPC
    objects that would outlive a job inside the worker's IPC namespace).
    """
    if extra not in _FILTERS:
        try:
            # lazy: a missing pyseccomp must become ContainmentUnavailable naming it, not an import error
            import pyseccomp as seccomp
        except ImportError as exc:
            raise ContainmentUnavailable(
                "pyseccomp (libseccomp bindings) is not installed; `pip install pyseccomp` "
                "and `apt-get install libseccomp2`"
            ) from exc
        f = seccomp.SyscallFilter(seccomp.ALLOW)
        deny = seccomp.ERRNO(errno.EPERM)
        for name in DENIED_SYSCALLS + extra:
            try:
                f.add_rule(deny, name)
            except (RuntimeError, ValueError, OSError):
                continue  # a syscall this kernel/arch does not have cannot be called either
        for flag in _CLONE_NEW:
            f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        # clone3 passes flags in memory seccomp cannot read: ENOSYS makes libc fall back to clone.
        f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            _FILTERS[extra] = out.read()
    return _FILTERS[extra]


def seccomp_fd(extra: tuple[str, ...] = ()) -> int:
    """A fresh read-only-positioned memfd with the filter, for `bwrap --seccomp FD` (caller closes it)."""
    fd = os.memfd_create("composer-mesh-seccomp")
    os.write(fd, seccomp_filter(extra))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


_FILTERS: dict[tuple[str, ...], bytes] = {}


def probe_cgroups() -> str:
    """'' when the v1 memory, pids and cpu controllers can hold a sandbox here, else why not."""
    for c in CONTROLLERS:
        base = CGROUP_ROOT / c
        if not (base / "cgroup.procs").exists():
            return f"cgroup v1 controller {c!r} is not mounted at {base}"
        if not os.access(base, os.W_OK):
            return f"cannot create cgroups under {base} (needs root)"
    return ""


@dataclass
class RunCgroup:
    """One run's cgroups (memory, pids, cpu); every process the run makes stays inside them."""

    name: str

    @classmethod
    def create(cls, name: str, memory_mb: int, max_pids: int, cpu_cores: float) -> RunCgroup:
        cg = cls(name)
        for c in CONTROLLERS:
            cg.path(c).mkdir(parents=True, exist_ok=True)
        limit = str(memory_mb << 20)
        _write(cg.path("memory") / "memory.limit_in_bytes", limit)
        if (cg.path("memory") / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
            _write(cg.path("memory") / "memory.memsw.limit_in_bytes", limit)
        _write(cg.path("pids") / "pids.max", str(max_pids))
        _write(cg.path("cpu") / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
        _write(cg.path("cpu") / "cpu.cfs_quota_us", str(max(1000, int(cpu_cores * _CPU_PERIOD_US))))
        return cg

    def path(self, controller: str) -> Path:
        return CGROUP_ROOT / controller / _GROUP / self.name

    def join(self) -> None:
        """Move the calling process into the cgroups (called in the child before exec)."""
        for c in CONTROLLERS:
            with open(self.path(c) / "cgroup.procs", "w") as f:
                f.write("0")

    def rename(self, name: str) -> None:
        """Rename the cgroups (v1 allows it within the parent; their processes and limits stay)."""
        for c in CONTROLLERS:
            os.rename(self.path(c), CGROUP_ROOT / c / _GROUP / name)
        self.name = name

    def attach(self, pid: int) -> None:
        """Move process `pid` (host view) into the cgroups (a pool worker's freshly forked job)."""
        for c in CONTROLLERS:
            _write(self.path(c) / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        out: set[int] = set()
        for c in CONTROLLERS:
            try:
                out |= {int(p) for p in (self.path(c) / "cgroup.procs").read_text().split()}
            except FileNotFoundError:
                continue
        return sorted(out)

    def limits_hit(self) -> list[str]:
        """Names of the cgroup limits the run ran into ("memory_limit", "process_limit")."""
        hit = []
        oom = dict(line.split() for line in (self.path("memory") / "memory.oom_control").read_text().splitlines())
        if int(oom.get("oom_kill", 0)) > 0:
            hit.append("memory_limit")
        events = dict(line.split() for line in (self.path("pids") / "pids.events").read_text().splitlines())
        if int(events.get("max", 0)) > 0:
            hit.append("process_limit")
        return hit

    def kill(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def destroy(self, grace_s: float = 5.0) -> bool:
        """Kill what is left and remove the cgroups; True when a process outlived `grace_s` of SIGKILLs."""
        deadline = time.monotonic() + grace_s
        while self.pids():
            if time.monotonic() > deadline:
                return True
            self.kill()
            time.sleep(0.005)
        for c in CONTROLLERS:
            try:
                self.path(c).rmdir()
            except FileNotFoundError:
                pass
        return False


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)
