"""A fork server: role processes forked from one interpreter that has already imported torch and TorchTitan.

On one box the job's start was bound by three processes importing torch, TorchTitan and transformers at once
(docs/tasks.md, "The controller's exit"). `ForkServer.start` runs a server process that imports those once;
the bootstrap command Monarch runs for a prespawned process (`ForkServer.bootstrap`) is this module's client,
which hands the server its environment, working directory, command line and standard streams. The server
forks a child that runs Monarch's bootstrap in the preloaded interpreter. Towards Monarch the client stands
in for the child: it forwards signals and exits with the child's status; the server kills a child whose
client is gone, and a child dies with the server (`PR_SET_PDEATHSIG`).

Whatever the server cannot serve starts cold, as without it: no server, a server that failed to import, a
server still importing after `READY_WAIT_S` (a loaded box: Monarch times a spawn out, `process_environment`),
or an environment that differs from the server's in a variable other than Monarch's own (the preloaded modules
read theirs at import): the client then `exec`s Monarch's bootstrap itself. Standard library only, so that the
client starts in milliseconds. The server preloads no Monarch module (its runtime's threads would not survive
a fork) and checks that none came in with the preloads.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# the client finds its server here (set in the bootstrap command's environment)
SOCKET_ENV = "COMPOSER_MESH_FORKSERVER"
# how long a client waits for the server's imports before it starts cold (seconds), where not `READY_WAIT_S`
WAIT_ENV = "COMPOSER_MESH_FORKSERVER_WAIT_S"
# the default wait: the imports take 10-12 s on a quiet 2-core box; a cold start after the wait still has
# Monarch's proc spawn timeout minus this to bootstrap (`mesh.prespawn.PROC_SPAWN_TIMEOUT_S`)
READY_WAIT_S = 25.0
# Monarch's proc bootstrap, run in the forked child (or exec'd by a client that starts cold); a private module
# (actors.monarch_compat lists it)
BOOTSTRAP_MAIN = "monarch._src.actor.bootstrap_main"
# environment variables a spawned process may have that the server did not: Monarch's bootstrap sets them per
# process, and none of the preloaded modules reads them at import
PER_PROCESS_ENV = ("HYPERACTOR_", "MONARCH_", "BOOTSTRAP_LOG_CHANNEL", SOCKET_ENV)
# one request: the client's environment, working directory and command line (a datagram of AF_UNIX SEQPACKET)
_MAX_REQUEST = 1 << 20
_PR_SET_PDEATHSIG = 1
# how long the server's stop waits for its children after SIGTERM before SIGKILL
_STOP_GRACE_S = 5.0


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that forked it ends (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _kill(pid: int, sig: int) -> None:
    """Send `sig` to `pid` unless it is already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def differing_env(served: dict[str, str], asked: dict[str, str]) -> list[str]:
    """The variables (sorted) whose values differ between the server's start and a request, Monarch's
    per-process ones (`PER_PROCESS_ENV` prefixes) aside: a process asking with any of these starts cold."""
    keys = set(served) | set(asked)
    return sorted(k for k in keys if served.get(k) != asked.get(k) and not k.startswith(PER_PROCESS_ENV))


class ForkServer:
    """A running fork server (the controller's handle): `bootstrap` is the command that spawns through it."""

    def __init__(self, proc: subprocess.Popen, path: Path) -> None:
        self.proc = proc
        self.path = path

    @classmethod
    def start(cls, modules: tuple[str, ...]) -> "ForkServer":
        """Start a server that imports `modules` and then forks processes on request. It inherits this
        process's environment as it is now (the C library's, as Monarch's spawns do), and ends when this
        process ends (its stdin is our pipe) or at `close`. Returns at once: requests wait for the imports
        (each at most `READY_WAIT_S`, or `$COMPOSER_MESH_FORKSERVER_WAIT_S`, then it starts cold)."""
        path = Path(tempfile.mkdtemp(prefix="cm-forkserver-")) / "socket"
        # bound and listening before this returns: a client that connects before the server runs waits in the
        # backlog instead of starting cold
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            listener.bind(str(path))
            listener.listen(64)
            proc = subprocess.Popen([sys.executable, "-m", __spec__.name, "serve", str(listener.fileno()), *modules],
                                    stdin=subprocess.PIPE, close_fds=True, pass_fds=[listener.fileno()])
        return cls(proc, path)

    def command(self, module: str = BOOTSTRAP_MAIN, *args: str) -> list[str]:
        """The client's command line: `python -m` this module, asking for a fork that runs `module` as
        `__main__` with `args` (as `python -m module *args` would)."""
        return [sys.executable, "-m", __spec__.name, module, *args]

    def bootstrap(self) -> Any:
        """Monarch's `BootstrapCommand` for `spawn_procs(bootstrap_command=...)`: the client, for Monarch's proc
        bootstrap."""
        # lazy: this module is standard library only, so that the client starts in milliseconds
        from composer_mesh.actors.monarch_compat import BootstrapCommand

        return BootstrapCommand(sys.executable, None, self.command()[1:], {SOCKET_ENV: str(self.path)})

    def close(self) -> None:
        """Stop the server (its remaining children get SIGTERM, then SIGKILL) and remove its socket."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=_STOP_GRACE_S + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()


class _Server:
    """The server's loop (one thread: no lock of another thread is copied into a child)."""

    def __init__(self, listener_fd: int, modules: list[str]) -> None:
        self.env = dict(os.environ)
        self.listener = socket.socket(fileno=listener_fd)
        self.sel = selectors.EpollSelector()
        # every connection open in the server (a forked child closes them)
        self.conns: set[socket.socket] = set()
        # why every request starts cold, or None
        self.refusal = self._preload(modules)
        # pid -> (client connection, pidfd)
        self.children: dict[int, tuple[socket.socket, int]] = {}

    @staticmethod
    def _preload(modules: list[str]) -> str | None:
        try:
            for name in modules:
                importlib.import_module(name)
        except Exception:
            traceback.print_exc()
            return "the fork server's imports failed"
        monarch = sorted(m for m in sys.modules if m == "monarch" or m.startswith("monarch."))
        if monarch:
            print(f"fork server: the preloads imported {monarch[0]}: every process starts cold", file=sys.stderr)
            return f"the preloads imported {monarch[0]}"
        return None

    def serve(self) -> None:
        self.sel.register(self.listener, selectors.EVENT_READ, ("listener", None))
        self.sel.register(sys.stdin.fileno(), selectors.EVENT_READ, ("parent", None))
        while True:
            for key, _ in self.sel.select():
                kind, data = key.data
                if kind == "listener":
                    self._accept()
                elif kind == "request":
                    self._request(conn=data)
                elif kind == "client":
                    # the client of a running child closed: it was killed, so is its child
                    _kill(data, signal.SIGKILL)
                    self.sel.unregister(self.children[data][0])
                elif kind == "exit":
                    self._reap(data)
                elif kind == "parent":
                    self._stop()
                    return

    def _accept(self) -> None:
        """Tell a waiting client that the imports are done; it sends its request only then (a client that gave
        up waiting has closed, and is dropped here or at its empty request)."""
        conn, _ = self.listener.accept()
        self.conns.add(conn)
        try:
            conn.send(b'{"ready": true}')
        except OSError:
            self._close(conn)
            return
        self.sel.register(conn, selectors.EVENT_READ, ("request", conn))

    def _close(self, conn: socket.socket) -> None:
        self.conns.discard(conn)
        conn.close()

    def _request(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        try:
            msg, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
        except OSError:
            self._close(conn)
            return
        try:
            req = json.loads(msg)
            if len(fds) != 3 or not {"module", "env", "cwd", "argv"} <= set(req):
                raise ValueError("not a request")
        # not a client of this module's: dropped
        except ValueError:
            for fd in fds:
                os.close(fd)
            self._close(conn)
            return
        refusal = self.refusal
        if refusal is None:
            changed = differing_env(self.env, req["env"])
            if changed:
                refusal = f"environment differs from the fork server's in {', '.join(changed[:5])}"
        if refusal is not None:
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"cold": refusal}).encode())
            self._close(conn)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        own = [self.listener.fileno(), self.sel.fileno(), *(c.fileno() for c in self.conns),
               *(pidfd for _, pidfd in self.children.values())]
        pid = os.fork()
        if pid == 0:
            _child(req, fds, own)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (conn, pidfd)
        self.sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        # the client is already gone
        except OSError:
            _kill(pid, signal.SIGKILL)
            return
        self.sel.register(conn, selectors.EVENT_READ, ("client", pid))

    def _reap(self, pid: int) -> None:
        conn, pidfd = self.children.pop(pid)
        _, status = os.waitpid(pid, 0)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(KeyError):
            self.sel.unregister(conn)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            conn.send(json.dumps({"status": code}).encode())
        except OSError:
            pass
        self._close(conn)

    def _stop(self) -> None:
        """The controller is gone or closed us: no new children; SIGTERM the rest, SIGKILL what outlives the
        grace period."""
        self.sel.unregister(self.listener)
        self.listener.close()
        # only the children's exits are waited for now (a closed pipe or connection stays readable)
        self.sel.unregister(sys.stdin.fileno())
        for conn in self.conns:
            with contextlib.suppress(KeyError):
                self.sel.unregister(conn)
        for pid in list(self.children):
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        while self.children and time.monotonic() < deadline:
            for key, _ in self.sel.select(timeout=max(0.0, deadline - time.monotonic())):
                if key.data[0] == "exit":
                    self._reap(key.data[1])
        for pid in list(self.children):
            _kill(pid, signal.SIGKILL)
            self._reap(pid)


def _child(req: dict[str, Any], fds: list[int], own: list[int]) -> None:
    """The forked child: become the process the client would have exec'd (its streams, environment, working
    directory and command line) and run Monarch's bootstrap; never returns into the server's loop. `own`: the
    server's descriptors (listener, selector, connections, pidfds), closed here; the preloaded modules' own
    descriptors stay open, as they would in a fresh process."""
    code = 1
    try:
        _die_with_parent()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in [*fds, *own]:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = req["argv"]
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        # the exit status and message as the interpreter gives them (as envs/_zygote.py's in-process jobs:
        # that one runs in the sandbox without the project on its path, so it cannot share this)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        # as the interpreter's own exit does: non-daemon threads joined, then the exit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _client(module: str, args: list[str]) -> None:
    """Have the server (at `$COMPOSER_MESH_FORKSERVER`) fork a child that runs `module`, and stand in for it;
    or, where it cannot, become `python -m module` (exec)."""
    path = os.environ.get(SOCKET_ENV, "")
    wait_s = float(os.environ.get(WAIT_ENV, READY_WAIT_S))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    closed = b'{"cold": "the fork server closed"}'
    try:
        sock.connect(path)
        # the server accepts once its imports are done; past the wait this process starts cold instead
        sock.settimeout(wait_s)
        try:
            reply = json.loads(sock.recv(_MAX_REQUEST) or closed)
        except TimeoutError:
            reply = {"cold": f"the fork server's imports took over {wait_s:g} s"}
        sock.settimeout(None)
        if "ready" in reply:
            req = {"module": module, "env": dict(os.environ), "cwd": os.getcwd(), "argv": [sys.argv[0], *args]}
            socket.send_fds(sock, [json.dumps(req).encode()], [0, 1, 2])
            reply = json.loads(sock.recv(_MAX_REQUEST) or closed)
    except OSError as e:
        reply = {"cold": f"no fork server at {path!r} ({e.strerror})"}
    if "cold" in reply:
        sock.close()
        print(f"fork server: starting cold: {reply['cold']}", file=sys.stderr, flush=True)
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
    pid = reply["pid"]

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda sig, _frame: _kill(pid, sig))
    msg = sock.recv(_MAX_REQUEST)
    # the server ended without a status: its children died with it
    code = json.loads(msg)["status"] if msg else 1
    if code < 0:
        # the child's signal is the client's end too (SIGKILL and SIGSTOP keep their default action anyway)
        with contextlib.suppress(OSError):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        # Ctrl-C reaches the whole process group: the controller decides what stops, as for its other children
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _Server(int(argv[1]), argv[2:]).serve()
        # without the preloaded modules' teardown (3 s of torch, transformers and TorchTitan on 2 cores)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        _client(argv[0] if argv else BOOTSTRAP_MAIN, argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
