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
  own; `colocated` — one generator actor in each trainer process. Each
  disaggregated generator is an actor mesh on a proc mesh of its own with one
  process: on a proc mesh of several processes, calls to an actor on a dead
  one fail only when Monarch stops the mesh's orphaned ranks, minutes later
  (docs/supervision.md), while on a one-process mesh they fail within the
  supervision poll; so a failure stays with the generator that died and is
  noticed at once;
- teacher replay: one actor on a process of its own on the controller's host
  (it only talks HTTP and asks the trainer for scores), so its failure is
  isolated and respawnable; `replay_procs = 0` disables it.

Replacements for dead actors (`respawn_generator`, `restart_trainer`,
`respawn_replay`) are built here too, from the same specs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import os
import signal
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from monarch.actor import this_host
from monarch.job import load_current_job
from composer_mesh.actors.elastic import setup_elastic_env

from composer_mesh.actors.generator import GeneratorActor, GeneratorSpec
from composer_mesh.actors.teacher_replay import TeacherReplayActor
from composer_mesh.actors.trainer import TrainerActor
from composer_mesh.configs.sections.mesh import MeshConfig
from composer_mesh.mesh.errors import phase
from composer_mesh.mesh.prespawn import Prespawned, process_environment
from composer_mesh.mesh.supervision import is_alive
from composer_mesh.titan_ext.spec import TrainerSpec


@dataclass
class Placement:
    """The spawned meshes; `generators` holds one single-process actor mesh per generator process.

    The respawn methods are what `mesh.supervision.Supervisor` calls to replace a dead actor.
    """

    trainer: Any
    generators: list[Any]
    replay: Any | None
    # per rank: rank, world, step, pid, params
    trainer_setup: list[dict] = field(default_factory=list)
    proc_meshes: list[Any] = field(default_factory=list)
    cfg: MeshConfig = field(default_factory=MeshConfig)
    # role → spec its actors are built from
    specs: dict[str, Any] = field(default_factory=dict)
    # per generator: its single-process proc mesh (view)
    generator_procs: list[Any] = field(default_factory=list)
    # per generator: the host mesh of its host
    generator_hosts: list[Any] = field(default_factory=list)
    trainer_procs: Any = None
    # per generator: its OS pid (a hung one cannot say)
    generator_pids: list[int] = field(default_factory=list)
    # processes killed as hung
    retired_pids: set[int] = field(default_factory=set)
    _names: Any = field(default_factory=itertools.count)
    # the restart count processes.json was last written at
    _pids_written: int | None = None

    def stop(self) -> None:
        """Stop every process mesh, each on a thread of its own (a stop waits for its processes to exit; its
        future only runs when waited on)."""
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.proc_meshes))) as pool:
            for stopped in [pool.submit(lambda p: p.stop().get(), procs) for procs in self.proc_meshes]:
                stopped.result()
        self.proc_meshes.clear()

    def pids(self) -> dict[str, list[int]]:
        """OS process ids of every live role (what a fault drill kills)."""
        out = {"trainer": [s["pid"] for s in self.trainer_setup],
               "generator": [g.info.call_one().get()["pid"] for g in self.generators]}
        if self.replay is not None:
            out["replay"] = [self.replay.info.call_one().get()["pid"]]
        return out

    def write_pids(self, path: Any, restarts: int = 0) -> None:
        """Write `{"controller": [pid], role: [pids]}` to `path` (processes.json) when `restarts` (the supervisor's
        count so far) differs from the last write's, so the file names the live processes after a replacement."""
        if self._pids_written == restarts:
            return
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps({"controller": [os.getpid()], **self.pids()}))
        os.replace(tmp, path)
        self._pids_written = restarts

    def _fresh_proc(self, hosts: Any) -> Any:
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        self.proc_meshes.append(procs)
        return procs

    def respawn_generator(self, index: int) -> Any:
        """A new generator actor for dead generator `index`: on a live generator process (`respawn = "live"`)
        or on a fresh process; its weights are loaded by the caller."""
        procs = None
        if self.cfg.respawn == "live":
            live = [j for j, g in enumerate(self.generators)
                    if j != index and self.generator_pids[j] not in self.retired_pids
                    and is_alive(g.policy_version.call_one, timeout_s=5.0)]
            procs = self.generator_procs[live[0]] if live else None
        if procs is None:
            procs = self._fresh_proc(self.generator_hosts[index])
        actor = procs.spawn(f"generator-r{next(self._names)}", GeneratorActor, self.specs["generator"])
        self.generators[index], self.generator_procs[index] = actor, procs
        self.generator_pids[index] = actor.info.call_one().get()["pid"]
        return actor

    def retire_generator(self, index: int) -> None:
        """Kill hung generator `index`'s process (SIGKILL also ends a stopped one); Monarch then reports it dead
        like any other. On a cluster backend the process is on another host: its proc mesh is stopped instead."""
        pid = self.generator_pids[index]
        self.retired_pids.add(pid)
        if self.cfg.backend == "local":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        try:
            self.generator_procs[index].stop().get(timeout=30)
        # a wedged host agent: the replacement goes ahead regardless
        except Exception:  # noqa: BLE001
            pass

    def restart_trainer(self) -> Any:
        """Stop the trainer mesh and start a new one resumed from the newest complete checkpoint."""
        spec = self.specs["trainer"]
        spec = dataclasses.replace(spec, checkpoint=dataclasses.replace(spec.checkpoint, resume=True, load_step=-1))
        old = self.trainer_procs
        if old in self.proc_meshes:
            self.proc_meshes.remove(old)
        try:
            old.stop().get(timeout=60)
        # a mesh with a dead rank may not stop cleanly; its processes are gone or going
        except Exception:
            pass
        self.trainer, self.trainer_procs, self.trainer_setup = _spawn_trainer(self.cfg, spec, self.proc_meshes)
        return self.trainer

    def respawn_replay(self) -> Any:
        """A new teacher-replay actor on a fresh process (its in-memory state is restored by the caller)."""
        procs = self._fresh_proc(this_host())
        self.replay = procs.spawn(f"teacher_replay-r{next(self._names)}", TeacherReplayActor, self.specs["replay"],
                                  self.trainer)
        return self.replay


def torch_threads(cfg: MeshConfig, role: str, cpus: int, *, turns: bool = False) -> int:
    """Torch threads per `role` ("trainer" | "generator") process: the configured count, else the host's `cpus`
    shared by the processes that run at the same time as it (docs/application.md, "Placement", says why).

    On `local` every role shares this host. `turns`: the trainer and the generators take turns (a synchronous
    loop without DiLoCo groups), so a role shares the host with its own processes only: not with the other
    role's idle ones, nor with the replay processes, which run no torch (teachers over HTTP, pair verification
    in the sandbox). Hosts are taken as alike."""
    configured = cfg.trainer_threads if role == "trainer" else cfg.generator_threads
    if configured:
        return configured
    own = cfg.trainer_procs if role == "trainer" or cfg.placement == "colocated" else cfg.generator_procs
    if cfg.backend != "local" or turns:
        share = own
    else:
        gens = cfg.generator_procs if cfg.placement == "disaggregated" else 0
        share = cfg.trainer_procs + gens + cfg.replay_procs
    return max(1, cpus // share)


def _take_turns(job: Any) -> bool:
    """Whether the recipe's trainer and generators never run at once: a synchronous loop, one trainer group."""
    return job.trainer.mode == "sync" and not job.diloco.enabled


def generator_spec(job: Any, weights: str) -> Any:
    """The generators' `GeneratorSpec`: the recipe's weights, sampling, environment and device
    (`[model] device`; "auto" resolves in each generator process)."""
    return GeneratorSpec(model_dir=weights, tokenizer_dir=job.model.tokenizer_path, generator=job.generator,
                         env=job.env, max_context_tokens=job.trainer.max_seq_len, device=job.model.device,
                         seed=job.job.seed, python_path=job.job.python_path,
                         torch_threads=torch_threads(job.mesh, "generator", os.cpu_count() or 1, turns=_take_turns(job)))


def trainer_spec_for(job: Any, *, preference_pairs: bool) -> Any:
    """The trainer's `TrainerSpec`; without a preference channel that can run (no replay actor, DiLoCo) the
    frozen DPO reference — one more parameter copy per rank — is not built (`dpo_reference = "policy"`)."""
    if not preference_pairs and job.trainer.dpo_reference == "frozen":
        job = dataclasses.replace(job, trainer=dataclasses.replace(job.trainer, dpo_reference="policy"))
    threads = torch_threads(job.mesh, "trainer", os.cpu_count() or 1, turns=_take_turns(job))
    return dataclasses.replace(TrainerSpec.from_job(job), torch_threads=threads)


def host_meshes(cfg: MeshConfig) -> tuple[Any, Any]:
    """(trainer hosts, generator hosts) for the backend."""
    if cfg.backend == "local":
        return this_host(), this_host()
    state = load_current_job().state()
    return state.trainer, state.generator


def _points(procs: Any) -> list[dict[str, int]]:
    """Every process of a proc mesh (host of a host mesh) as a slice point, e.g. [{"gpus": 0}, {"gpus": 1}];
    [{}] for a mesh with no dimensions (`this_host()`)."""
    sizes = procs.sizes
    return [dict(zip(sizes, idx)) for idx in itertools.product(*(range(n) for n in sizes.values()))]


def _host(hosts: Any, point: dict[str, int]) -> Any:
    """The one-host slice of `hosts` that a point (of it, or of a proc mesh spawned on it) lies on."""
    dims = {k: v for k, v in point.items() if k in hosts.sizes}
    return hosts.slice(**dims) if dims else hosts


def _start_trainer(cfg: MeshConfig, spec: Any, meshes: list[Any], procs: Any = None) -> tuple[Any, Any, Any]:
    """(trainer actor mesh, its proc mesh, its `setup` call in flight): the caller starts the other roles while
    the trainer processes import and build the model (resumed from a checkpoint if one exists). `procs`: a
    proc mesh started early (`mesh.prespawn`, already in `meshes`), else a fresh one (added to `meshes`)."""
    if procs is None:
        procs = host_meshes(cfg)[0].spawn_procs(per_host={"gpus": cfg.trainer_procs})
        setup_elastic_env(procs)
        meshes.append(procs)
    trainer = procs.spawn("trainer", TrainerActor, spec)
    return trainer, procs, trainer.setup.call()


def _spawn_trainer(cfg: MeshConfig, spec: Any, meshes: list[Any]) -> tuple[Any, Any, list[dict]]:
    """(trainer actor mesh, its proc mesh, per-rank setup): set up, so resumed from a checkpoint if one exists."""
    trainer, procs, setup = _start_trainer(cfg, spec, meshes)
    return trainer, procs, list(setup.get().values())


def spawn_generators(cfg: MeshConfig, trainer_procs: list[Any], spec: Any, meshes: list[Any],
                     early: list[Any] | None = None) -> tuple[list[Any], list[Any], list[Any]]:
    """(generator actors, their proc meshes, their hosts' host meshes), one of each per generator process:
    colocated — one in each process of `trainer_procs`; disaggregated — `generator_procs` one-process proc
    meshes per generator host (added to `meshes`), or those of `early` (started by `mesh.prespawn`, already
    in `meshes`)."""
    if cfg.placement == "colocated":
        hosts = host_meshes(cfg)[0]
        points = [(tp, p) for tp in trainer_procs for p in _points(tp)]
        procs = [tp.slice(**p) for tp, p in points]
        gen_hosts = [_host(hosts, p) for _, p in points]
    else:
        hosts = host_meshes(cfg)[1]
        gen_hosts = [_host(hosts, p) for p in _points(hosts) for _ in range(cfg.generator_procs)]
        if early:
            procs = early
        else:
            procs = [h.spawn_procs(per_host={"gpus": 1}) for h in gen_hosts]
            meshes += procs
    return [p.spawn("generator", GeneratorActor, spec) for p in procs], procs, gen_hosts


def spawn_replay(cfg: MeshConfig, spec: Any | None, trainer: Any, meshes: list[Any]) -> Any | None:
    """The teacher-replay actor on a process of its own (added to `meshes`), scoring with `trainer`; None when off."""
    if spec is None or cfg.replay_procs == 0:
        return None
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    meshes.append(procs)
    return procs.spawn("teacher_replay", TeacherReplayActor, spec, trainer)


def place(cfg: MeshConfig, trainer_spec: Any, generator_spec: Any, replay_spec: Any | None = None,
          early: Prespawned | None = None) -> Placement:
    """Spawn the trainer mesh (set up), the generators and the replay actor (on a process of its own), all
    starting together rather than one after the other (docs/application.md, "Placement"); on the processes of
    `early` (`mesh.prespawn`, started before the controller's imports) when given."""
    if early is None:
        # before the first process is spawned
        process_environment(cfg)
        early = Prespawned()
    meshes: list[Any] = []
    try:
        # every role's processes start (import, build, load) at once
        with phase("setup"):
            # the early processes are ours to stop from here on, whatever fails
            early_trainer, early_generators = early.take()
            meshes += [p for p in [early_trainer, *early_generators] if p is not None]
            early.wait()
            trainer, trainer_procs, setup_call = _start_trainer(cfg, trainer_spec, meshes, early_trainer)
            # colocated generators share the trainer's processes: its setup finishes first
            setup = list(setup_call.get().values()) if cfg.placement == "colocated" else None
            generators, procs, gen_hosts = spawn_generators(cfg, [trainer_procs], generator_spec, meshes,
                                                            early_generators)
            replay = spawn_replay(cfg, replay_spec, trainer, meshes)
            setup = setup or list(setup_call.get().values())
            pids = [g.info.call_one().get()["pid"] for g in generators]
    except BaseException:
        # the processes spawned before the failure; its error is the news
        with contextlib.suppress(Exception):
            Placement(None, [], None, proc_meshes=meshes).stop()
        raise
    specs = {"trainer": trainer_spec, "generator": generator_spec, "replay": replay_spec}
    return Placement(trainer, generators, replay, setup, meshes, cfg, specs, procs, gen_hosts, trainer_procs, pids)
