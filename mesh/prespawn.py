"""Processes started before the controller's own heavy imports (torch, transformers, TorchTitan).

`composer-mesh train` reads the recipe, then spawns the trainer's process mesh
and the disaggregated generators' one-process meshes here and has each import
its role's modules (a `Preload` actor), and only then imports the launch
stack; `mesh.placement.place` spawns the role actors on these warm processes
instead of fresh ones. The controller's imports and the actors' imports so run
side by side instead of one after the other (docs/application.md, "Placement").

With `[mesh] fork_server` (the default) these processes are forked from one
server process that imports torch, transformers and TorchTitan once
(`mesh.forkserver`), so the box imports them twice (server and controller)
instead of three times or more.

This module imports Monarch and the config schema only, nothing that pulls in
torch. Only the local backend without DiLoCo replicas is started early; the
other layouts place their processes as before.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
from dataclasses import dataclass, field
from typing import Any

from monarch.actor import Actor, endpoint, this_host
from composer_mesh.actors.elastic import setup_elastic_env

from composer_mesh.actors.monarch_compat import reload_config_from_env
from composer_mesh.actors.phase_memory import MMAP_THRESHOLD_ENV
from composer_mesh.configs.schema import JobConfig
from composer_mesh.configs.sections.mesh import MeshConfig
from composer_mesh.mesh.forkserver import READY_WAIT_S, ForkServer
from composer_mesh.mesh.process_exit import exit_without_teardown

# what each role's process imports while the controller imports its own stack: the actor's module and what it
# imports lazily at set-up and first sync (the trainer's model stack, TorchTitan and transformers; the
# generator's tokenizer and HF model classes, and the TorchTitan model and export code its first weight load
# binds the segment with), so that set-up only builds and the first sync only copies. `torchtitan.trainer`:
# TorchTitan's `update_from_config` (`titan_ext.parallelize.prepare_model_config`, both roles) imports it,
# and with it HF datasets and pandas (1.3 s)
ROLE_MODULES = {
    "trainer": ("composer_mesh.actors.trainer", "composer_mesh.titan_ext.trainer", "torchtitan.trainer"),
    "generator": ("composer_mesh.actors.generator", "transformers.models.auto.tokenization_auto",
                  "transformers.models.auto.modeling_auto", "composer_mesh.titan_ext.hf.adapters",
                  "composer_mesh.titan_ext.models", "composer_mesh.titan_ext.parallelize", "torchtitan.trainer"),
}
# what the fork server imports for every role: each role's modules but its actor's, which imports Monarch (its
# runtime's threads would not survive the fork; the server checks none came in); a role process then imports
# Monarch and its actor module (≈ 0.5 s of CPU against ≈ 10 s for the whole list, measured on the 2-core box)
FORK_SERVER_MODULES = tuple(dict.fromkeys(
    name for modules in ROLE_MODULES.values() for name in modules if not name.startswith("composer_mesh.actors.")
))
# how long a stop waits for an early process's imports in flight (a few seconds on 2 cores)
_IMPORTS_S = 120.0
# Monarch's limit on a proc's bootstrap (30 s by default), raised where a fork server starts the processes: a
# client waits up to `forkserver.READY_WAIT_S` for the server's imports (on a loaded box they took over 30 s,
# and the spawn timed out), and one that then starts cold still needs the time a fresh process needs
PROC_SPAWN_TIMEOUT_ENV = "HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE"
PROC_SPAWN_TIMEOUT_S = READY_WAIT_S + 35.0


def _duration(seconds: float) -> str:
    """A duration as Monarch's configuration variables take it (whole milliseconds)."""
    return f"{round(seconds * 1000)}ms"


def configure_supervision(poll_s: float, state_query_s: float) -> None:
    """Monarch's supervision poll period and state-query timeout for this process and the processes it spawns
    (they inherit the environment): `[mesh] supervision_poll_s` and `state_query_s`.

    A dead process is reported when a poll finds it gone, or when its process agent does not answer the poll's
    state query within `state_query_s`; how often each path is taken: docs/supervision.md."""
    os.environ["HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"] = _duration(poll_s)
    os.environ["HYPERACTOR_MESH_GET_ACTOR_STATE_MAX_IDLE"] = _duration(state_query_s)
    reload_config_from_env()


def process_environment(cfg: MeshConfig) -> None:
    """What every spawned process inherits, set before the first spawn: the supervision timings, the malloc
    threshold (`actors.phase_memory`) and, with a fork server, Monarch's proc spawn timeout (unless set)."""
    if cfg.fork_server:
        os.environ.setdefault(PROC_SPAWN_TIMEOUT_ENV, _duration(PROC_SPAWN_TIMEOUT_S))
    configure_supervision(cfg.supervision_poll_s, cfg.state_query_s)
    os.environ[MMAP_THRESHOLD_ENV] = str(int(cfg.malloc_mmap_threshold_mib * (1 << 20)))


class Preload(Actor):
    """Imports a role's modules in its process, so the role's actor spawns on a process that has them.

    Before them it calls `exit_without_teardown`: exit handlers run last-registered first, so every handler
    the role's imports register (torch's compile workers and multiprocessing children, file locks, weakref
    finalizers) still runs at stop, and then the process ends without tearing down the modules of torch,
    TorchTitan and transformers one by one: a stop of such a process took 1.78 s, 0.55 s with this
    (docs/tasks.md, "The job's timeline").
    """

    @endpoint
    def load(self, modules: tuple[str, ...]) -> int:
        """Import `modules`; returns this process's pid."""
        exit_without_teardown()
        for name in modules:
            importlib.import_module(name)
        return os.getpid()


@dataclass
class Prespawned:
    """Process meshes started early: the trainer's (torch-elastic environment set) and one per disaggregated
    generator, each with its imports in flight. `place` takes them; `stop` stops what was not taken."""

    trainer: Any = None
    generators: list[Any] = field(default_factory=list)
    # (proc mesh, its Preload.load call in flight)
    loads: list[tuple[Any, Any]] = field(default_factory=list)
    # the processes' pids, filled by `wait`
    pids: list[int] = field(default_factory=list)
    # the trainer's proc mesh until `wait` has set its torch-elastic environment (which waits for the processes)
    elastic: Any = None
    # the fork server the processes came from (`[mesh] fork_server`), closed by `stop`
    server: ForkServer | None = None

    def take(self) -> tuple[Any, list[Any]]:
        """(the trainer's proc mesh or None, the generators' proc meshes): handed over once, to be stopped by
        the taker from then on."""
        taken = (self.trainer, self.generators)
        self.trainer, self.generators = None, []
        return taken

    def wait(self) -> list[int]:
        """The early processes' pids, the trainer's first, once each has imported its modules (an import error
        is raised here) and the trainer's torch-elastic environment is set."""
        if self.elastic is not None:
            setup_elastic_env(self.elastic)
            self.elastic = None
        self.pids += [pid for _, call in self.loads for pid in call.get().values()]
        self.loads = []
        return self.pids

    def stop(self) -> None:
        """Stop the process meshes nobody took (a recipe refused after they started), each on its own thread,
        once their imports in flight have ended: a process stopped mid-import (a recipe refused in the first
        seconds, on a loaded box) missed Monarch's cleanup deadline, and the root actor's failure then
        interrupted the controller (exit 130 instead of the refusal's 2)."""
        left = [p for p in [self.trainer, *self.generators] if p is not None]
        self.trainer, self.generators, self.elastic = None, [], None
        for _, call in self.loads:
            try:
                call.get(timeout=_IMPORTS_S)
            # an import that failed or hangs: the process is stopped all the same
            except Exception:
                pass
        self.loads = []
        with concurrent.futures.ThreadPoolExecutor(max(1, len(left))) as pool:
            for stopped in [pool.submit(lambda p: p.stop().get(), procs) for procs in left]:
                stopped.result()
        if self.server is not None:
            self.server.close()
            self.server = None


def prespawn(job: JobConfig) -> Prespawned | None:
    """Start the trainer's and the disaggregated generators' processes of `job` and their imports; None for a
    layout placed otherwise (a cluster backend, DiLoCo replicas). The stop of what it returns (`stop`) is the
    caller's: after the run, since the fork server's children live as long as it does."""
    cfg = job.mesh
    if cfg.backend != "local" or job.diloco.enabled:
        return None
    process_environment(cfg)
    early = Prespawned()
    try:
        # after `process_environment`: the server's environment is the one its children ask with
        early.server = ForkServer.start(FORK_SERVER_MODULES) if cfg.fork_server else None
        command = early.server.bootstrap() if early.server is not None else None
        early.trainer = this_host().spawn_procs(per_host={"gpus": cfg.trainer_procs}, bootstrap_command=command)
        # set by `wait`: it waits for the process, which a fork server starts once its own imports are done
        early.elastic = early.trainer
        modules = ROLE_MODULES["trainer"]
        if cfg.placement == "colocated":
            modules += ROLE_MODULES["generator"]
        else:
            early.generators = [this_host().spawn_procs(per_host={"gpus": 1}, bootstrap_command=command)
                                for _ in range(cfg.generator_procs)]
        for procs, mods in [(early.trainer, modules), *((g, ROLE_MODULES["generator"]) for g in early.generators)]:
            early.loads.append((procs, procs.spawn("preload", Preload).load.call(mods)))
    except BaseException:
        early.stop()
        raise
    return early
