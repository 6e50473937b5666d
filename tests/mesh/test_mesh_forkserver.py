"""`mesh.forkserver`: processes forked from a server that imported their modules once.

A real server process and real clients (subprocesses, as Monarch starts them), a probe module as the child's
program: the child gets the client's streams, environment, working directory and exit status; signals reach
it through the client; a killed client takes its child along, a closed server its children; and everything
the server cannot serve (no server, a different environment, preloads that imported Monarch) starts cold as
`python -m module` in the client's own process. Then Monarch: a proc mesh spawned through the server runs
actors in forked children that are gone after the mesh's stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from composer_mesh.mesh.forkserver import SOCKET_ENV, WAIT_ENV, ForkServer, differing_env

from test_mesh_train import REPO

PROBE = """
import atexit, json, os, sys, time
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv, "name": __name__,
                  "mark": os.environ.get("MONARCH_PROBE_MARK"), "preloaded": "probe_preload" in sys.modules}),
      flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else ""
atexit.register(print, "exit handler ran", flush=True)
if mode == "exit7":
    sys.exit(7)
if mode == "sleep":
    time.sleep(120)
if mode == "stderr":
    print("to stderr", file=sys.stderr, flush=True)
"""


@pytest.fixture
def probe_env(tmp_path, monkeypatch):
    """The environment the server starts with and the clients ask with: the probe's modules importable."""
    (tmp_path / "probe_main.py").write_text(PROBE)
    (tmp_path / "probe_preload.py").write_text("VALUE = 1\n")
    path = os.pathsep.join(x for x in (str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")) if x)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture
def server(probe_env):
    """Starts a server preloading the probe's module, in the test's body: pytest's PYTEST_CURRENT_TEST
    differs between a test's set-up and its body, and a client asking with another environment starts cold."""
    servers: list[ForkServer] = []

    def start(modules: tuple[str, ...] = ("probe_preload",)) -> ForkServer:
        servers.append(ForkServer.start(modules))
        return servers[-1]

    yield start
    for srv in servers:
        srv.close()


def _client(srv: ForkServer | None, mode: str = "", **env: str) -> subprocess.Popen:
    """A client asking for the probe (argv[1] = `mode`) with this process's environment and `env` (as Monarch's
    host agent starts it: the controller's environment, Monarch's variables and the socket's). Through `env`:
    a child's environment is the C library's, which other libraries may have set beside `os.environ`."""
    if srv is not None:
        env[SOCKET_ENV] = str(srv.path)
    cmd = ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "composer_mesh.mesh.forkserver",
           "probe_main", *([mode] if mode else [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _first_line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return json.loads(line)


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie of the server counts as gone once reaped
        time.sleep(0.05)
    return False


def test_child_is_a_fork_of_the_server_with_the_clients_streams_env_and_status(server):
    server = server()
    proc = _client(server, "exit7", MONARCH_PROBE_MARK="m1")
    seen = _first_line(proc)
    assert proc.wait(timeout=60) == 7
    out, err = proc.stdout.read(), proc.stderr.read()
    assert seen["ppid"] == server.proc.pid and seen["pid"] != proc.pid, err
    assert seen["preloaded"] and seen["name"] == "__main__"
    assert seen["argv"][0].endswith("probe_main.py") and seen["argv"][1:] == ["exit7"]
    assert seen["mark"] == "m1" and seen["cwd"] == os.getcwd()
    assert out == "exit handler ran\n", err  # the exit handlers run, the output is flushed
    stderr = _client(server, "stderr")
    assert stderr.wait(timeout=60) == 0 and stderr.stderr.read() == "to stderr\n"


def test_a_signal_to_the_client_reaches_the_child_and_is_its_status(server):
    server = server()
    proc = _client(server, "sleep")
    child = _first_line(proc)["pid"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert _gone(child)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_a_child_killed_by_a_signal_ends_its_client_with_that_signal(server, sig):
    """Monarch reads the client's end as the process's: a SIGKILLed role reads as SIGKILLed (its OOM hint)."""
    server = server()
    proc = _client(server, "sleep")
    os.kill(_first_line(proc)["pid"], sig)
    assert proc.wait(timeout=60) == -sig


def test_a_killed_client_takes_its_child_along(server):
    server = server()
    proc = _client(server, "sleep")
    child = _first_line(proc)["pid"]
    proc.kill()
    proc.wait(timeout=60)
    assert _gone(child)


def test_closing_the_server_stops_its_children_and_their_clients(probe_env):
    srv = ForkServer.start(("probe_preload",))
    proc = _client(srv, "sleep")
    child = _first_line(proc)["pid"]
    srv.close()
    assert srv.proc.returncode == 0 and not srv.path.exists()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGTERM and _gone(child)


def test_the_server_ends_with_the_process_that_started_it(probe_env):
    """The controller killed (SIGKILL, no `close`): the server sees its stdin close and stops its children."""
    starter = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom composer_mesh.mesh.forkserver import ForkServer\n"
         "s = ForkServer.start(('probe_preload',))\nprint(s.proc.pid, s.path, flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    pid, path = starter.stdout.readline().split()
    proc = _client(None, "sleep", **{SOCKET_ENV: path})
    seen = _first_line(proc)
    child = seen["pid"]
    assert seen["ppid"] == int(pid), proc.stderr.readline()
    starter.kill()
    starter.wait()
    assert _gone(int(pid)) and _gone(child)
    proc.wait(timeout=60)


def test_what_the_server_cannot_serve_starts_cold_in_the_clients_process(server, probe_env):
    server = server()
    # an environment variable the server did not start with: the preloaded modules may have read it at import
    changed = _client(server, MONARCH_PROBE_MARK="m2", SOME_SETTING="1")
    seen = _first_line(changed)
    assert changed.wait(timeout=120) == 0
    assert seen["pid"] == changed.pid and not seen["preloaded"] and seen["mark"] == "m2"
    assert "starting cold: environment differs from the fork server's in SOME_SETTING" in changed.stderr.read()
    # no server at that path
    nothing = _client(None, **{SOCKET_ENV: str(probe_env / "no-socket")})
    assert _first_line(nothing)["pid"] == nothing.pid and nothing.wait(timeout=120) == 0
    assert "starting cold: no fork server" in nothing.stderr.read()


def test_a_client_that_waits_past_its_limit_starts_cold_and_the_server_serves_the_next(server, probe_env):
    """On a loaded box the server's imports can outlast Monarch's spawn timeout: a client waits for them at most
    its limit, then starts cold; the server drops it (it gave up before asking) and forks the next one."""
    (probe_env / "probe_slow.py").write_text("import time\ntime.sleep(6)\n")
    server = server(("probe_preload", "probe_slow"))
    impatient = _client(server, **{WAIT_ENV: "1"})
    patient = _client(server)
    seen = _first_line(impatient)
    assert impatient.wait(timeout=120) == 0
    assert seen["pid"] == impatient.pid and not seen["preloaded"]
    assert "starting cold: the fork server's imports took over 1 s" in impatient.stderr.read()
    served = _first_line(patient)
    assert patient.wait(timeout=120) == 0
    assert served["ppid"] == server.proc.pid and served["preloaded"] and patient.stderr.read() == ""


def test_preloads_that_import_monarch_make_every_process_cold(server):
    """Monarch's runtime threads would not survive a fork: the server refuses to fork at all."""
    proc = _client(server(("monarch.actor",)))
    seen = _first_line(proc)
    assert proc.wait(timeout=120) == 0 and seen["pid"] == proc.pid
    assert "the preloads imported monarch" in proc.stderr.read()


def test_differing_env_ignores_monarchs_per_process_variables():
    served = {"A": "1", "B": "2"}
    asked = {"A": "1", "B": "2", "HYPERACTOR_MESH_BOOTSTRAP_MODE": "x", "MONARCH_X": "y", SOCKET_ENV: "/s"}
    assert differing_env(served, asked) == []
    assert differing_env(served, {"A": "1"}) == ["B"]
    assert differing_env(served, {**served, "B": "3", "C": ""}) == ["B", "C"]


PIDS = """
import os, sys
from monarch.actor import Actor, endpoint


class Where(Actor):
    @endpoint
    def where(self) -> dict:
        return {"pid": os.getpid(), "ppid": os.getppid(), "preloaded": "probe_preload" in sys.modules}
"""


@pytest.mark.slow
def test_a_monarch_proc_mesh_spawned_through_the_server(probe_env):
    """Monarch runs its bootstrap in the forked children: actors answer from them, and the mesh's stop ends
    them (their clients report the exit to Monarch)."""
    from monarch.actor import this_host

    (probe_env / "probe_where.py").write_text(PIDS)
    srv = ForkServer.start(("probe_preload",))
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 2}, bootstrap_command=srv.bootstrap())
        from probe_where import Where

        seen = list(procs.spawn("where", Where).where.call().get().values())
        assert len(seen) == 2 and all(s["ppid"] == srv.proc.pid and s["preloaded"] for s in seen), (seen, srv.proc.pid)
        procs.stop().get()
        assert all(_gone(s["pid"]) for s in seen)
    finally:
        srv.close()
    assert srv.proc.returncode == 0
