"""PID 1 of a sandbox: lock the filesystem view, set limits, drop to a private uid, exec.

Run by `envs.sandbox.Sandbox` as root inside fresh network, PID and mount
namespaces (`unshare --net --pid --fork --mount --mount-proc`), with `python -I
-S`, one argument (the spec, `marshal` as hex: no json/re import on this
path) and fd 3 open for the JSON report. Stdlib only, no project imports. It stays PID 1 of the namespace while the program runs as its
child; when it exits, the kernel kills every process left in the namespace
(daemons included).
"""

from __future__ import annotations

import _signal  # the builtin behind `signal`, without its enum import (start-up time counts here)
import ctypes
import marshal
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} -> {target}: {os.strerror(err)}")


def _bind(source: str, target: str, readonly: bool) -> None:
    _mount(source, target, None, MS_BIND)
    if readonly:
        _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def setup_filesystem(spec: dict) -> None:
    """World-writable dirs read-only, hidden dirs emptied (exposed paths re-bound), workdir rw."""
    workdir = spec["workdir"]
    hide = [h for h in spec["hide"] if os.path.isdir(h)]
    # Keep handles on what tmpfs mounts are about to cover.
    keep = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in spec["expose"] + [workdir] if os.path.isdir(p)}
    for d in spec["readonly"]:
        if os.path.isdir(d) and not os.path.islink(d):
            _bind(d, d, readonly=True)
    for h in hide:
        _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        for p, fd in keep.items():
            if p != workdir and _under(p, h):
                os.makedirs(p, exist_ok=True)
                _bind(f"/proc/self/fd/{fd}", p, readonly=True)
        _mount("none", h, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _bind(f"/proc/self/fd/{keep[workdir]}", workdir, readonly=False)
    for fd in keep.values():
        os.close(fd)


def set_limits(limits: dict) -> None:
    for name, value in limits.items():
        soft, hard = value
        resource.setrlimit(getattr(resource, name), (soft, hard))


def drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def run_target(spec: dict) -> None:
    """In the forked child: limits, private uid, default signal dispositions, exec."""
    set_limits(spec["limits"])
    drop_privileges(spec["uid"], spec["uid"])
    for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # Python ignores these; exec would keep that
        _signal.signal(sig, _signal.SIG_DFL)
    os.umask(0o022)
    os.chdir(spec["workdir"])
    argv = spec["argv"]
    try:
        os.execve(argv[0], argv, spec["env"])
    except OSError as exc:
        print(f"sandbox-init: cannot execute {argv[0]!r}: {exc.strerror}", file=sys.stderr)
        os._exit(127)


def main() -> None:
    """Set up, run the target as PID 2, report its wait status and CPU time on fd 3, exit.

    Exiting (as PID 1) makes the kernel kill whatever the target left behind.
    """
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    os.set_inheritable(3, False)
    try:
        setup_filesystem(spec)
        pid = os.fork()
        if pid == 0:
            run_target(spec)
    except OSError as exc:
        print(f"sandbox-init: setup failed: {exc}", file=sys.stderr)
        os._exit(125)
    _, status, usage = os.wait4(pid, 0)
    cpu_s = usage.ru_utime + usage.ru_stime
    os.write(3, f'{{"status": {status}, "cpu_s": {cpu_s!r}, "maxrss_kb": {usage.ru_maxrss}}}'.encode())
    os._exit(0)


if __name__ == "__main__":
    main()
