"""`mesh.prespawn`: `composer-mesh train` starts the role processes before the controller's heavy imports.

What the CLI loads before it spawns them must not pull in torch, transformers or TorchTitan (else the
controller's imports and the actors' would run one after the other again). That the roles then run on
those processes, training as a Run on fresh ones does, is checked in test_mesh_api.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_mesh_train import REPO

PROBE = """
import sys

import pytest
from composer_mesh.mesh.cli import build_parser
build_parser()
import composer_mesh.mesh.prespawn
print(sorted(m for m in ("torch", "transformers", "torchtitan") if m in sys.modules))
"""


def test_cli_and_prespawn_load_no_heavy_module():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


SETUP_PROBE = """
import importlib, sys
from composer_mesh.mesh.prespawn import ROLE_MODULES
for name in ROLE_MODULES[sys.argv[1]]:
    importlib.import_module(name)
before = set(sys.modules)
from torchtitan.trainer import Trainer  # TorchTitan's update_from_config, under prepare_model_config (both)
if sys.argv[1] == "trainer":
    from composer_mesh.titan_ext.trainer import Trainer  # TrainerActor.setup
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # GeneratorActor, HFEngine
    from composer_mesh.titan_ext.hf.adapters import iter_hf_buckets  # weight_sync.reader, first load
    from composer_mesh.titan_ext.models import resolve_model
    from composer_mesh.titan_ext.parallelize import prepare_model_config
print(sorted(set(sys.modules) - before))
"""


def test_preload_covers_what_each_role_imports_at_set_up():
    """The early processes import what the trainer's and the generator's set-up would import lazily, so the
    actors' set-up only builds (before, the trainer's TorchTitan and transformers imports ran after the
    controller's, 4.6 s on the critical path of vs_trl's short job, and the generator's first weight load
    imported TorchTitan's model code, 2 s)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x))
    for role in ("trainer", "generator"):
        out = subprocess.run([sys.executable, "-c", SETUP_PROBE, role], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "[]", (role, out.stdout[-2000:])


def test_the_fork_server_forks_with_the_roles_preloads(tmp_path, monkeypatch):
    """The fork server forks only an interpreter without Monarch's runtime (its threads would not survive the
    fork): the preloads the roles get (`FORK_SERVER_MODULES`) must not pull Monarch in, else every role
    process would start cold. A real server with them forks a probe."""
    from composer_mesh.mesh.forkserver import SOCKET_ENV, ForkServer
    from composer_mesh.mesh.prespawn import FORK_SERVER_MODULES

    (tmp_path / "parent_probe.py").write_text("import os, sys\nprint(os.getppid(), 'torch' in sys.modules)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(x for x in (str(tmp_path), str(REPO),
                                                                  os.environ.get("PYTHONPATH")) if x))
    server = ForkServer.start(FORK_SERVER_MODULES)
    try:
        out = subprocess.run(["env", f"{SOCKET_ENV}={server.path}", *server.command("parent_probe")],
                             capture_output=True, text=True, timeout=300)
    finally:
        server.close()
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    assert out.stdout.split() == [str(server.proc.pid), "True"]


SPAWN_LIMIT_PROBE = """
import os, sys
from composer_mesh.actors.monarch_compat import BootstrapCommand, reload_config_from_env
from composer_mesh.configs.sections.mesh import MeshConfig
from composer_mesh.mesh.prespawn import PROC_SPAWN_TIMEOUT_ENV, PROC_SPAWN_TIMEOUT_S, process_environment
from monarch.actor import Actor, endpoint, this_host


class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def spawn() -> str:
    # a bootstrap as slow as a client waiting for a busy fork server: 4 s, then Monarch's own
    slow = ["-c", "import os, sys, time; time.sleep(4); "
            "os.execv(sys.executable, [sys.executable, '-m', 'monarch._src.actor.bootstrap_main', *sys.argv[1:]])"]
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 1}, bootstrap_command=BootstrapCommand(
            sys.executable, None, slow, {}))
        return f"pid {procs.spawn('p', Pid).pid.call_one().get()}"
    except Exception as e:
        return str(e).splitlines()[0]


os.environ[PROC_SPAWN_TIMEOUT_ENV] = "2s"
reload_config_from_env()
print(spawn())
process_environment(MeshConfig(fork_server=True))  # a value the user set is kept
print(os.environ[PROC_SPAWN_TIMEOUT_ENV])
del os.environ[PROC_SPAWN_TIMEOUT_ENV]
process_environment(MeshConfig(fork_server=True))
print(os.environ[PROC_SPAWN_TIMEOUT_ENV] == f"{round(PROC_SPAWN_TIMEOUT_S * 1000)}ms")
print(spawn(), flush=True)
os._exit(0)
"""


def test_the_proc_spawn_limit_leaves_time_to_wait_for_the_fork_server():
    """Monarch fails a spawn whose process does not come up within `HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE` (30 s
    by default). A client waits up to `READY_WAIT_S` for the fork server's imports, which took over 30 s on a
    loaded box: `process_environment` raises the limit past that wait plus a cold start (unless the user set
    it). Checked on Monarch itself: a 4 s bootstrap fails under a 2 s limit and comes up under the job's."""
    from composer_mesh.mesh.forkserver import READY_WAIT_S
    from composer_mesh.mesh.prespawn import PROC_SPAWN_TIMEOUT_S

    assert PROC_SPAWN_TIMEOUT_S >= READY_WAIT_S + 30
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x))
    out = subprocess.run([sys.executable, "-c", SPAWN_LIMIT_PROBE], env=env, capture_output=True, text=True,
                         timeout=300)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4, (out.stdout, out.stderr[-3000:])
    assert lines[0].startswith("error spawning proc mesh") and "Timeout" in lines[0], lines[0]
    assert lines[1:3] == ["2s", "True"]
    assert lines[3].startswith("pid "), lines[3]


EXIT_PROBE = """
import atexit, sys, threading
atexit.register(print, "before: skipped")
from composer_mesh.mesh.process_exit import exit_without_teardown
exit_without_teardown()
atexit.register(print, "after: ran")
print("body", flush=False)
case = sys.argv[1]
if case == "exit3":
    sys.exit(3)
if case == "thread_exit":
    t = threading.Thread(target=sys.exit, args=(5,))
    t.start(); t.join()
if case == "message":
    sys.exit("bye")
if case == "raise":
    raise RuntimeError("boom")
if case == "interrupt":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize(("case", "code"), [("end", 0), ("exit3", 3), ("thread_exit", 0), ("message", 1),
                                            ("raise", 1), ("interrupt", 130)])
def test_exit_without_teardown_keeps_status_and_later_handlers(case, code):
    """The early processes' fast exit: the handlers registered after it run, those before it do not (the
    teardown it skips comes after them), buffered output is flushed, and the exit status is the process's:
    `sys.exit`'s on the main thread (Monarch's bootstrap passes its runtime's this way), 1 after an uncaught
    exception or an exit message, 130 after Ctrl-C (as a shell reports it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x))
    out = subprocess.run([sys.executable, "-c", EXIT_PROBE, case], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == code, (out.returncode, out.stderr[-2000:])
    assert out.stdout.splitlines() == ["body", "after: ran"], out.stdout


def test_the_cli_program_ends_with_main_status_and_all_its_output():
    """`composer-mesh` (`mesh.cli.entry`, also `python -m composer_mesh.mesh.cli`) skips the module teardown
    at exit: its exit status is still the command's and a long stdout arrives whole."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x))
    cli = [sys.executable, "-m", "composer_mesh.mesh.cli"]
    shown = subprocess.run([*cli, "config", "show", "coding_cpu.toml"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith("[job]") and "[checkpoint]" in shown.stdout and shown.stdout.endswith("\n")
    assert len(shown.stdout) > 4096  # held in the stdout buffer (8 KiB on a pipe) until the exit flushes it
    missing = subprocess.run([*cli, "train", "no_such_recipe.toml"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "no such config file" in missing.stderr, missing.stderr[-2000:]
