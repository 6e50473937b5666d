"""Launch wiring of a run: a recipe becomes placed actors, a metrics sink and a controller.

`Launch.start` checks the task and the model, resolves the weights both sides
start from (the demo's warm-started base when asked), starts the local teacher
server, places the actors, resumes the newest checkpoint with its controller
state and builds the controller; `stop` removes what it started. What depends
on `[diloco] enabled` — one supervised trainer mesh or R replica groups — is
decided once, by `loop_for`. `mesh.api.Run` is the user.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from transformers import AutoTokenizer

from composer_mesh.actors.episodes import ChatTokens
from composer_mesh.actors.mesh_utils import rank0
from composer_mesh.actors.teacher_replay import ReplaySpec
from composer_mesh.configs.schema import JobConfig
from composer_mesh.envs.demo import format_examples
from composer_mesh.envs.factory import check_task, env_factory
from composer_mesh.envs.tool_format import HintFormats, tool_format_examples, warm_start_env
from composer_mesh.envs.plugin import add_python_path
from composer_mesh.mesh.controller import TOOL_TASKS, Controller, ControllerConfig, StepRecord
from composer_mesh.mesh.memory import check as memory_check
from composer_mesh.mesh.metrics import MetricsSink, process_age_s, read_metrics
from composer_mesh.mesh.placement import Placement, generator_spec, place, trainer_spec_for
from composer_mesh.mesh.prespawn import Prespawned
from composer_mesh.mesh.replicas import ReplicaController, check_supported, place_replicas
from composer_mesh.mesh.responders import build_responder
from composer_mesh.mesh.supervision import ControllerState, Supervisor, install_fault_hook, load_state, state_path
from composer_mesh.replay.hints import cases_note, change_note, make_hint_generator, reference_note
from composer_mesh.replay.reference_teacher import edit_args
from composer_mesh.replay.server import TeacherServer
from composer_mesh.titan_ext.assets import cache_dir_for, hf_dir_for
from composer_mesh.titan_ext.checkpoint import Checkpointer
from composer_mesh.titan_ext.hf.config import check_supported as check_hf_config
from composer_mesh.titan_ext.hf.config import read_checkpoint_config
from composer_mesh.titan_ext.hf.export import record_run_model
from composer_mesh.titan_ext.warmstart import WarmStartConfig, WarmStartRequest, warm_start_dir


class Loop:
    """One trainer mesh driven by one supervised `Controller`; sync mode can be stepped one step at a time."""

    supervised = True

    def __init__(self, job: JobConfig) -> None:
        self.job = job

    @property
    def steppable(self) -> bool:
        """`Run.step()` and `Controller.begin()` apply (sync mode, one controller)."""
        return self.job.trainer.mode == "sync"

    def checkpoints(self, folder: Path) -> Path:
        """The checkpoint folder `composer-mesh export` rebuilds the model from."""
        return folder

    def place(self, trainer_spec: Any, gen_spec: Any, replay_spec: Any, early: Prespawned | None) -> Placement:
        return place(self.job.mesh, trainer_spec, gen_spec, replay_spec, early)

    def controller(self, cfg: ControllerConfig, placement: Placement, chat: ChatTokens, *,
                   on_step: Callable[[StepRecord], None], supervisor: Supervisor | None, state: ControllerState) -> Any:
        return Controller(cfg, placement.trainer, placement.generators, chat, hinter=make_hint_generator(self.job.loss.distill, self.job.teachers),
                          replay=placement.replay, on_step=on_step, supervisor=supervisor, state=state)

    def trainers(self, placement: Placement) -> list[Any]:
        """The trainer meshes that save a final checkpoint."""
        return [placement.trainer]

    def evals(self, controller: Any) -> list[tuple[int, dict[str, float]]]:
        """(step, held-out metrics) of the run, oldest first."""
        return controller.evals

    def summary(self, placement: Placement) -> dict[str, Any]:
        """What this loop adds to summary.json."""
        return {}


class ReplicaLoop(Loop):
    """R trainer replica groups under torchft DiLoCo (`mesh.replicas`): unsupervised, driven by `run()` only."""

    supervised = False

    @property
    def steppable(self) -> bool:
        return False

    def checkpoints(self, folder: Path) -> Path:
        # each replica group checkpoints under replica_<g>; export group 0's
        return folder / "replica_0"

    def place(self, trainer_spec: Any, gen_spec: Any, replay_spec: Any, early: Prespawned | None) -> Placement:
        # `mesh.prespawn` starts nothing for replica groups
        check_supported(self.job)
        return place_replicas(self.job.mesh, self.job.diloco, trainer_spec, gen_spec, replay_spec)

    def controller(self, cfg: ControllerConfig, placement: Placement, chat: ChatTokens, *,
                   on_step: Callable[[StepRecord], None], supervisor: Supervisor | None, state: ControllerState) -> Any:
        return ReplicaController(cfg, placement, self.job.diloco, chat, hinter=make_hint_generator(self.job.loss.distill, self.job.teachers),
                                 on_step=on_step, prompt_cursor=state.prompt_cursor)

    def trainers(self, placement: Placement) -> list[Any]:
        return placement.groups

    def evals(self, controller: Any) -> list[tuple[int, dict[str, float]]]:
        # the replica loop has no held-out evaluation
        return []

    def summary(self, placement: Placement) -> dict[str, Any]:
        return {"diloco": placement.manager.status.call_one().get()}


def loop_for(job: JobConfig) -> Loop:
    """The run's loop: the one place `diloco.enabled` is read."""
    return ReplicaLoop(job) if job.diloco.enabled else Loop(job)


class Launch:
    """What `start` brought up for one run (actors, teacher server, sink, controller); `stop` removes it."""

    def __init__(self, job: JobConfig, run_dir: Path, early: Prespawned | None = None) -> None:
        # the recipe as run: model.hf_path resolved, checkpoint.resume as asked
        self.job = job
        # processes started before the controller's imports (`mesh.prespawn`), taken by the placement
        self.early = early
        self.run_dir = run_dir
        self.loop = loop_for(job)
        # mesh.memory.MemoryEstimate of the recipe on this host
        self.memory: Any = None
        self.placement: Any = None
        self.controller: Any = None
        self.sink: MetricsSink | None = None
        self.server: TeacherServer | None = None
        self.supervisor: Supervisor | None = None
        self.weight_dir = ""
        self.start_step = 0
        # the iteration the run ends at (trainer.steps, or where a resumed run already is)
        self.end = 0
        # summary.json's `timeline_s`: this process's age (`mesh.metrics.process_age_s`) at each phase's end
        self.timeline: dict[str, float] = {}

    @classmethod
    def start(cls, job: JobConfig, run_dir: Path, *, resume: bool, progress: bool,
              on_step: Callable[[StepRecord], None], fault_events: list[str],
              early: Prespawned | None = None) -> Launch:
        """Bring the run up (on the processes of `early` when given); on failure remove what was started and
        raise."""
        launch = cls(job, run_dir, early)
        try:
            launch._start(resume, progress, on_step, fault_events)
        except BaseException:
            launch.stop()
            raise
        return launch

    def _start(self, resume: bool, progress: bool, on_step: Callable[[StepRecord], None],
               fault_events: list[str]) -> None:
        job, run_dir = self.job, self.run_dir
        # the controller's interpreter start and imports
        self.timeline["imports"] = process_age_s()
        add_python_path(job.job.python_path)
        # a plugin or dataset that cannot load, or a bad coding section, fails here, before any actor starts
        check_task(job.env)
        run_dir.mkdir(parents=True, exist_ok=True)
        weights = model_dir(job)
        # refuses a recipe the host cannot hold, before any actor
        self.memory = memory_check(job, weights)
        job = self.job = dataclasses.replace(
            job, model=dataclasses.replace(job.model, hf_path=weights),
            checkpoint=dataclasses.replace(job.checkpoint, resume=job.checkpoint.resume and resume))
        if not job.checkpoint.resume:
            shutil.rmtree(run_dir / job.checkpoint.folder, ignore_errors=True)
        record_run_model(run_dir, job.model, self.loop.checkpoints(run_dir / job.checkpoint.folder))
        gen_spec = generator_spec(job, weights)
        replay_spec = self._replay_spec(weights)
        trainer_spec = trainer_spec_for(job, preference_pairs=replay_spec is not None)
        self.weight_dir = str(weight_dir(job.job.name))
        supervised = self.loop.supervised
        state_dir = (str(run_dir / job.checkpoint.folder / "controller")
                     if job.checkpoint.enabled and supervised else "")
        # dead actors are handled where their calls fail, not by exiting
        install_fault_hook(fault_events)
        self.timeline["checks"] = process_age_s()
        placement = self.placement = self.loop.place(trainer_spec, gen_spec, replay_spec, self.early)
        # every role's processes up, set up and built
        self.timeline["placed"] = process_age_s()
        start = placement.trainer_setup[0]["step"]
        if state_dir and job.metrics.jsonl:
            start = resume_at_logged_step(placement.trainer, start, run_dir, job, state_dir)
        self.start_step = start
        placement.write_pids(run_dir / "processes.json")
        state = (load_state(state_dir, start) if state_dir else None) or ControllerState(
            # a checkpoint from before controller states
            start, start, start * job.trainer.prompts_per_step)
        self.end = max(job.trainer.steps, state.iteration)
        cfg = ControllerConfig.from_job(job, steps=self.end - state.iteration, weight_dir=self.weight_dir,
                                        state_dir=state_dir, replay=placement.replay is not None)
        if job.mesh.max_restarts > 0 and supervised:
            self.supervisor = Supervisor(job.mesh.max_restarts, placement.respawn_generator,
                                         placement.restart_trainer if state_dir else None,
                                         placement.respawn_replay if placement.replay is not None else None,
                                         placement.retire_generator)
        chat = ChatTokens(AutoTokenizer.from_pretrained(job.model.tokenizer_path or weights))
        metrics_cfg = dataclasses.replace(job.metrics, progress_bar=job.metrics.progress_bar and progress)
        self.sink = MetricsSink(metrics_cfg, run_dir, job.trainer.steps, start)
        self.controller = self.loop.controller(cfg, placement, chat, on_step=on_step, supervisor=self.supervisor,
                                               state=state)
        self.timeline["ready"] = process_age_s()

    def _replay_spec(self, weights: str) -> ReplaySpec | None:
        """The teacher-replay actor's spec (and the local teacher server started), or None without channel 3."""
        job = self.job
        if not (job.loss.beta > 0 and job.mesh.replay_procs > 0):
            return None
        teachers, ls = job.teachers, job.replay.local_server
        if not teachers.models:
            raise ValueError("loss.beta > 0 needs [[teachers.models]] (or set loss.beta = 0 / mesh.replay_procs = 0)")
        if ls.enabled:
            self.server = TeacherServer(build_responder(ls.responder, ls.model_dir, ls.noise, job.env, job.job.seed), host=ls.host,
                                        port=ls.port, request_log=ls.request_log or None).start()
            teachers = dataclasses.replace(teachers, base_url=self.server.url)
        replay = dataclasses.replace(job.replay, output_dir=str(self.run_dir / "replay"))
        return ReplaySpec(replay, teachers, tokenizer_dir=job.model.tokenizer_path or weights, env=job.env,
                          python_path=job.job.python_path)

    def stop(self) -> None:
        """Close the metrics sink, stop every actor and the local teacher server, remove the shared-memory
        weight folder."""
        try:
            if self.sink is not None:
                self.sink.close()
        finally:
            try:
                if self.placement is not None:
                    self.placement.stop()
            finally:
                # early processes no placement took (a recipe refused before placing)
                if self.early is not None:
                    self.early.stop()
                if self.server is not None:
                    self.server.stop()
                if self.weight_dir:
                    shutil.rmtree(self.weight_dir, ignore_errors=True)


# the hint channel's note formats and its teachers' edits: the warm start's notes and edits are written in them
HINT_FORMATS = HintFormats(reference=reference_note, change=change_note, cases=cases_note, edit_args=edit_args)


def model_dir(job: JobConfig) -> str:
    """HF weights both the trainer and the generators start from (a warm-started base when the task asks for one)."""
    # refuse a config.json here, before any actor
    if job.model.hf_path and job.model.registry_flavour() is None:
        check_hf_config(read_checkpoint_config(job.model.hf_path), f"{job.model.hf_path}/config.json")
    weights = hf_dir_for(job.model)
    if weights is None:
        raise ValueError(f"model.flavour = {job.model.flavour!r} needs model.hf_path (generators load HF weights)")
    request = warm_start_request(job, str(weights))
    if request is not None:
        weights = warm_start_dir(request.model, request.conversations, request.config, cache_dir_for(job.model),
                                 request.tools)
    return str(weights)


def warm_start_request(job: JobConfig, src_dir: str) -> WarmStartRequest | None:
    """What `titan_ext.warmstart.warm_start_dir` makes `job`'s base of (the weights in `src_dir`; the conversations
    its task's warm start teaches, with the tools' schemas for a tool-loop task); None when the job has none."""
    demo, tl = job.env.demo, job.env.tool_loop
    model = dataclasses.replace(job.model, hf_path=src_dir)
    if job.env.task in TOOL_TASKS and tl.warm_start_steps > 0:
        conversations, tools = tool_format_examples(
            env_factory(warm_start_env(job.env)), tl.warm_start_examples, tl.warm_start_seed, HINT_FORMATS,
            note_share=tl.warm_start_note_share, note_formats=tl.warm_start_note_formats)
        ws = WarmStartConfig(steps=tl.warm_start_steps, batch_size=tl.warm_start_batch_size, lr=tl.warm_start_lr,
                             seed=tl.warm_start_seed, decay=tl.warm_start_decay,
                             grad_clip=tl.warm_start_grad_clip)
        return WarmStartRequest(model, conversations, ws, tools)
    if job.env.task == "demo" and demo.warm_start_steps > 0:
        ws = WarmStartConfig(steps=demo.warm_start_steps, lr=demo.warm_start_lr, seed=job.job.seed)
        return WarmStartRequest(model, format_examples(demo, demo.warm_start_examples, job.job.seed), ws, None)
    return None


def weight_dir(name: str, shm: Path = Path("/dev/shm")) -> Path:
    """This process's shared-memory weight folder; removes those of controllers of job `name` that died
    (a SIGKILLed controller leaves its folder: on tmpfs, memory)."""
    prefix = f"composer-mesh-{name}-"
    for old in shm.glob(f"{glob.escape(prefix)}*"):
        pid = old.name[len(prefix):]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return shm / f"{prefix}{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def resume_at_logged_step(trainer: Any, start: int, run_dir: Path, job: JobConfig, state_dir: str) -> int:
    """The step to resume from so that the metrics log stays contiguous.

    A controller killed after the trainer checkpointed step s but before the row of step s
    reached metrics.jsonl would leave a hole in the log; load the newest checkpoint whose steps
    are all logged instead (its controller state must exist). Returns the trainer's step.
    """
    path = run_dir / "metrics.jsonl"
    logged = max((int(r["step"]) for r in read_metrics(path)), default=0) if path.exists() else 0
    every = job.metrics.log_every
    if not any(s % every == 0 for s in range(logged + 1, start + 1)):
        return start
    folder = run_dir / job.checkpoint.folder
    older = [s for s in Checkpointer(job.checkpoint, folder).complete_steps()
             if s <= logged and state_path(state_dir, s).is_file()]
    if not older:
        # nothing older kept: resume where the trainer is (the log misses those rows)
        return start
    return int(rank0(trainer.load_checkpoint.call(older[-1]).get()))
