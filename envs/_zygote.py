"""A warm sandbox worker: started once inside a pool slot's sandbox, it forks one child per job.

Started by `envs.pool` as `python -E -s -P -B _zygote.py <control fd> <preload>`
under the same bwrap + setpriv + seccomp + rlimits as a cold run (the slot's
private uid); preload: JSON {"scripts": [paths], "modules": {name: path}}.
Stdlib + pytest only, no project imports. It imports pytest and its built-in
plugins once, compiles the grader's scripts and imports its modules (the wire
protocol) once, makes itself non-dumpable (a job of the same uid cannot read or
write its memory or fds through /proc, and ptrace is denied by seccomp), blocks
every catchable signal, then serves jobs on the control socket (SOCK_SEQPACKET):

- host -> zygote: {"argv", "env", "cwd", "limits": [[resource, soft, hard]],
  "fds": [target numbers], "in_process"} with the job's fds attached (stdin,
  stdout, stderr, then the pass-through fds);
- zygote -> host: {"pid": the child's pid in the namespace}; the host moves the
  child into the job's own cgroup and answers {"go": true}; the child starts only then;
- zygote -> host: {"exit": exit code (-N for signal N), "cpu": seconds} once the child ended.

The child drops the zygote's fds and signal mask, puts the job's fds at the
numbers the host named, applies the job's rlimits, cwd and environment, and
either execs `argv` or, for `python -E -s -P -B <script> ...` (`in_process`),
runs the script as `__main__` in this already-warm interpreter (its code
compiled here at start-up, when it is one of the preloaded scripts). Every job
is a fresh fork: nothing a job does to its modules reaches the zygote or the next job.
"""

from __future__ import annotations

import builtins
import ctypes
import fcntl
import importlib
import importlib.util
import json
import os
import resource
import runpy
import signal
import socket
import sys
import traceback
import types

import _pytest.config
import pytest  # noqa: F401  (warm: what every judge imports first)

_PR_SET_DUMPABLE = 4
_MAX_FDS = 64
# path -> code of the preloaded scripts (compiled once, run by every in-process job)
_CODE: dict[str, types.CodeType] = {}


def warm(preload: dict) -> None:
    """Import what a judge imports (pytest's built-in plugins: pytest.main loads them by name), compile the
    grader's scripts, import its modules under their names."""
    for name in _pytest.config.default_plugins:
        importlib.import_module(f"_pytest.{name}")
    for name in ("_pytest.main", "_pytest.outcomes", "_pytest.python", "_pytest.reports", "_pytest.runner"):
        importlib.import_module(name)
    for path in preload["scripts"]:
        with open(path, encoding="utf-8") as f:
            _CODE[path] = compile(f.read(), path, "exec")
    for name, path in preload["modules"].items():
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module


def run_script(path: str) -> None:
    """Run `path` as `__main__` (what `runpy.run_path` does), from its preloaded code when there is one."""
    code = _CODE.get(path)
    if code is None:
        runpy.run_path(path, run_name="__main__")
        return
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, builtins
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def main() -> None:
    ctrl = socket.socket(fileno=int(sys.argv[1]))
    warm(json.loads(sys.argv[2]))
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SystemExit("cannot make the worker non-dumpable")
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    ctrl.send(json.dumps({"ready": True}).encode())
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(ctrl, 1 << 20, _MAX_FDS)
        except OSError:
            return
        if not data:
            return
        job = json.loads(data)
        go_r, go_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(go_w)
            child(job, fds, go_r, ctrl.fileno())
        os.close(go_r)
        for fd in fds:
            os.close(fd)  # the child holds the only copies (end-of-stream reaches a peer when it exits)
        ctrl.send(json.dumps({"pid": pid}).encode())
        reply = ctrl.recv(4096)
        os.write(go_w, b"g" if reply and json.loads(reply).get("go") else b"")
        os.close(go_w)
        _, status, usage = os.wait4(pid, 0)
        ctrl.send(json.dumps({"exit": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}).encode())


def child(job: dict, fds: list[int], go_r: int, ctrl_fd: int) -> None:
    """Set the job up and run it; never returns."""
    code = 1
    try:
        os.close(ctrl_fd)
        if os.read(go_r, 1) != b"g":  # the host did not place us in the job's cgroup: run nothing
            os._exit(125)
        os.close(go_r)
        targets = job["fds"]
        low = max(targets) + 1
        # copies above every target number first, so no dup2 below overwrites a source
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, low) for fd in fds]
        for src, dst in zip(high, targets):
            os.dup2(src, dst, inheritable=True)
        os.closerange(low, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        for fd in set(range(low)) - set(targets):
            try:
                os.close(fd)
            except OSError:
                pass
        os.setsid()
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for name, soft, hard in job["limits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        argv = job["argv"]
        if not job["in_process"]:
            os.execve(argv[0], argv, job["env"])
        sys.argv = list(argv[5:])
        try:
            run_script(argv[5])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    main()
