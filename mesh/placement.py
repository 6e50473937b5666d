"""Placement of the actor roles on Monarch process meshes, from `[mesh]`.

Host meshes: `backend = "local"` uses this host for every role; a cluster
backend (`slurm`, `kubernetes`) takes the `trainer` and `generator` host meshes
of the Monarch job applied with `monarch apply configs.jobs.<file>.job`
(`monarch.job.load_current_job().state()`), so the code below is the same on
one machine and on a cluster.

Roles:
- trainer: `trainer_procs` processes per host (one per GPU on clusters), the
  torch-elastic environment set so they form one process group;
- generators: `disaggregated` — `generator_procs` processes per host of their
  own; `colocated` — one generator actor in each trainer process;
- teacher replay: one actor in the controller's process (it only talks HTTP
  and asks the trainer for scores); `replay_procs = 0` disables it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from configs.sections.mesh import MeshConfig


@dataclass
class Placement:
    """The spawned meshes; `generators` holds one single-process actor view per generator process."""

    trainer: Any
    generators: list[Any]
    replay: Any | None
    trainer_setup: list[dict] = field(default_factory=list)  # per rank: rank, world, step, pid, params
    proc_meshes: list[Any] = field(default_factory=list)

    def stop(self) -> None:
        for procs in self.proc_meshes:
            procs.stop().get()


def host_meshes(cfg: MeshConfig) -> tuple[Any, Any]:
    """(trainer hosts, generator hosts) for the backend."""
    if cfg.backend == "local":
        from monarch.actor import this_host

        return this_host(), this_host()
    from monarch.job import load_current_job

    state = load_current_job().state()
    return state.trainer, state.generator


def place(cfg: MeshConfig, trainer_spec: Any, generator_spec: Any, replay_spec: Any | None = None) -> Placement:
    """Spawn the trainer mesh (set up), the generators and the replay actor."""
    from monarch.actor import this_proc
    from monarch.spmd import setup_torch_elastic_env

    from actors.generator import GeneratorActor
    from actors.teacher_replay import TeacherReplayActor
    from actors.trainer import TrainerActor

    trainer_hosts, generator_hosts = host_meshes(cfg)
    trainer_procs = trainer_hosts.spawn_procs(per_host={"gpus": cfg.trainer_procs})
    setup_torch_elastic_env(trainer_procs)
    meshes = [trainer_procs]
    trainer = trainer_procs.spawn("trainer", TrainerActor, trainer_spec)
    if cfg.placement == "colocated":
        gen_procs = trainer_procs
    else:
        gen_procs = generator_hosts.spawn_procs(per_host={"gpus": cfg.generator_procs})
        meshes.append(gen_procs)
    generators = gen_procs.spawn("generator", GeneratorActor, generator_spec)
    setup = list(trainer.setup.call().get().values())
    views = [generators.slice(**point) for point, _ in generators.info.call().get().items()]
    replay = None
    if replay_spec is not None and cfg.replay_procs > 0:
        replay = this_proc().spawn("teacher_replay", TeacherReplayActor, replay_spec, trainer)
    return Placement(trainer, views, replay, setup, meshes)
