"""A warm sandbox worker: started once inside a pool slot's sandbox, it forks one child per job.

Started by `envs.pool` as `python -E -s -P -B _zygote.py <control fd> <preload>`
under the same bwrap + setpriv + seccomp + rlimits as a cold run (the slot's
private uid); preload: JSON {"scripts": [paths], "modules": {name: path}}.
Stdlib + pytest only, no project imports. It imports pytest and its built-in
plugins once, compiles the grader's scripts and imports its modules (the wire
protocol) once, makes itself non-dumpable (a job of the same uid cannot read or
write its memory or fds through /proc, and ptrace is denied by seccomp), blocks
every catchable signal, then serves jobs on the control socket (SOCK_SEQPACKET):

- host -> zygote: {"spare": true} -> {"pid": the pid in the namespace of the next
  job's process}, forked ahead (once) and waiting; the host moves it into that
  job's own cgroup while the slot is idle, so a job never waits for the move.
  Before forking it the zygote drains the signals jobs of its uid queued to it
  (blocked, they would count against the uid's RLIMIT_SIGPENDING for good);
  the host has restored the rest of what a job of the uid can change in it
  (rlimits, scheduling, affinity, I/O priority: `envs.pool`);
- host -> zygote: {"argv", "env", "cwd", "limits": [[resource, soft, hard]],
  "fds": [target numbers], "in_process"} with the job's fds attached (stdin,
  stdout, stderr, then the pass-through fds): passed on to the spare, which starts
  only then (no spare: nothing runs, exit 125);
- zygote -> host: {"exit": exit code (-N for signal N), "cpu": seconds, "started":
  the child was set up (fds, rlimits, cwd, environment) and ran the job} once the
  child ended. A child that could not be set up never ran the job's code: the
  job is lost to the worker, not the job's failure.

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
# what a child sends the zygote once its job is set up, just before the job's own code runs
_STARTED = b"started"
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
    # the next job's process, forked ahead: (pid, our end of its socket)
    spare: tuple[int, socket.socket] | None = None
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(ctrl, 1 << 20, _MAX_FDS)
        except OSError:
            return
        if not data:
            return
        if json.loads(data).get("spare"):
            for fd in fds:
                os.close(fd)
            if spare is None:
                drain_signals()
                spare = fork_spare(ctrl)
            ctrl.send(json.dumps({"pid": spare[0]}).encode())
            continue
        if spare is None:  # the host places a spare before every job: run nothing
            for fd in fds:
                os.close(fd)
            ctrl.send(json.dumps({"exit": 125, "cpu": 0.0, "started": False}).encode())
            continue
        (pid, sock), spare = spare, None
        try:
            socket.send_fds(sock, [data], fds)
        except OSError:
            pass  # the spare is gone (killed from outside): its exit status says so
        for fd in fds:
            os.close(fd)  # the child holds the only copies (end-of-stream reaches a peer when it exits)
        started = was_started(sock)
        _, status, usage = os.wait4(pid, 0)
        reply = {"exit": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime, "started": started}
        ctrl.send(json.dumps(reply).encode())


def drain_signals() -> None:
    """Take every signal pending on the zygote (all are blocked: the finished job's SIGCHLD, what jobs of its uid
    sent it), so none stays queued against the uid's RLIMIT_SIGPENDING."""
    catchable = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    while signal.sigpending():
        if signal.sigtimedwait(catchable, 0) is None:
            return


def was_started(sock: socket.socket) -> bool:
    """Whether the child reported its job set up before it ran any of the job's code (end-of-stream: it did not)."""
    try:
        return sock.recv(16) == _STARTED
    except OSError:
        return False
    finally:
        sock.close()


def fork_spare(ctrl: socket.socket) -> tuple[int, socket.socket]:
    """Fork the next job's process: it waits, signals blocked, for its job on a socket of its own."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        ours.close()
        child(theirs, ctrl.fileno())
    theirs.close()
    return pid, ours


def child(sock: socket.socket, ctrl_fd: int) -> None:
    """Wait for the job (the host moved us into its cgroup first), set it up and run it; never returns.

    Once set up, and before any of the job's code, it tells the zygote so (`_STARTED`) on its own socket.
    """
    code = 1
    try:
        os.close(ctrl_fd)
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, _MAX_FDS)
        if not data:  # the zygote went away before a job came: run nothing
            os._exit(125)
        job = json.loads(data)
        targets = job["fds"]
        # the socket to the zygote, then copies of the job's fds, above every target number, so no dup2 below
        # overwrites a source
        report = fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, max(targets) + 1)
        sock.close()
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, report + 1) for fd in fds]
        for src, dst in zip(high, targets):
            os.dup2(src, dst, inheritable=True)
        os.closerange(report + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        for fd in set(range(report)) - set(targets):
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
        os.write(report, _STARTED)
        os.close(report)
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
