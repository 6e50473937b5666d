"""The public Python API: build a run from a recipe, step it, sample from it, evaluate it, export it, stop it.

    from mesh.api import Run

    with Run.from_toml("configs/debug_cpu.toml", {"trainer.steps": 4}) as run:
        record = run.step()                         # one controller step (sync mode)
        run.generate(["What is 2 + 3?"])            # completions of the current policy
        run.evaluate()                              # held-out reward, greedy and sampled
        summary = run.run()                         # the steps left, final checkpoint, hf/ export
        run.export_hf("out/hf")                     # servable weights (transformers, vLLM)

A `Run` writes what `composer-mesh train` writes (that command is `Run(job).run()`
plus exit codes): `metrics.jsonl`, TensorBoard events, `processes.json`,
checkpoints with controller states (resumed unless `resume=False`),
`summary.json`, `plot.png` and `hf/` under `<job.output_dir>/<job.name>`.
Actors start on the first call that needs them (`start()`); `stop()` — or
leaving the `with` block — removes them, the local teacher server and the
shared-memory weight folder. Dead actors are replaced under
`[mesh] max_restarts` as in `train`. Refused recipes raise `ValueError` (a
`configs.loader.ConfigError` names the key) before any actor starts.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

from actors.mesh_utils import rank0
from configs.schema import JobConfig
from mesh.controller import StepRecord

__all__ = ["Run", "StepRecord"]


class Run:
    """One training run of a recipe on Monarch meshes: `start`, `step`, `run`, `generate`, `evaluate`,
    `export_hf`, `stop`; `metrics` holds every step's row as written to metrics.jsonl."""

    def __init__(self, job: JobConfig, *, resume: bool = True, progress: bool = False) -> None:
        self.job = job
        self.resume = resume
        self.progress = progress
        self.history: list[StepRecord] = []  # the steps this Run took, oldest first
        self.summary: dict[str, Any] | None = None  # set by run()
        self.fault_events: list[str] = []  # Monarch supervision events seen (dead actors are handled in place)
        self.memory: Any = None  # mesh.memory.MemoryEstimate of the recipe on this host (None: not checked)
        self._placement: Any = None
        self._controller: Any = None
        self._sink: Any = None
        self._server: Any = None
        self._supervisor: Any = None
        self._weight_dir = ""
        self._start_step = 0
        self._end = 0  # the iteration the run ends at (trainer.steps, or where a resumed run already is)
        self._stopped = False

    @classmethod
    def from_toml(cls, path: str | os.PathLike, overrides: Mapping[str, Any] | Iterable[str] = (), *,
                  resume: bool = True, progress: bool = False) -> "Run":
        """A run of the recipe at `path` (or a shipped recipe's name) with `overrides`: a mapping
        `{"trainer.steps": 4}` or CLI items `["--trainer.steps=4"]`. Raises ConfigError naming the key."""
        from configs.loader import load_config

        if isinstance(overrides, Mapping):
            overrides = [f"--{key}={_toml_literal(value)}" for key, value in overrides.items()]
        return cls(load_config(path, list(overrides)), resume=resume, progress=progress)

    # ---- state --------------------------------------------------------------------------------

    @property
    def run_dir(self) -> Path:
        return Path(self.job.job.output_dir) / self.job.job.name

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """One dict per step this Run took (the metrics.jsonl row): step, seconds, groups, staleness, the keys of
        the preference pairs trained on, and the trainer's and controller's metrics."""
        return [{"step": r.step, "seconds": r.seconds, "groups": r.groups, "staleness": r.staleness,
                 "pair_keys": r.pair_keys, **r.metrics} for r in self.history]

    @property
    def step_count(self) -> int:
        """Controller steps done so far, counting those of the checkpoint the run resumed from."""
        return self._controller.iteration if self._controller is not None else 0

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> "Run":
        """Check the recipe's task and model, place the actors, resume the newest checkpoint (unless
        `resume=False`), open the metrics sink. Later calls do nothing."""
        if self._stopped:
            raise RuntimeError("this Run was stopped; build a new one")
        if self._placement is None:
            try:
                self._start()
            except BaseException:
                self.stop()
                raise
        return self

    def _start(self) -> None:
        from transformers import AutoTokenizer

        from actors.episodes import ChatTokens
        from actors.rollout import SamplingParams
        from envs.factory import check_task
        from envs.plugin import add_python_path
        from mesh.controller import Controller, ControllerConfig
        from mesh.evaluation import EvalConfig
        from mesh.memory import check as memory_check
        from mesh.metrics import MetricsSink
        from mesh.placement import generator_spec, place, trainer_spec_for
        from mesh.supervision import ControllerState, Deadline, Supervisor, install_fault_hook, load_state
        from replay.hints import TemplateHintGenerator
        from titan_ext.hf_export import record_run_model

        job = self.job
        add_python_path(job.job.python_path)
        check_task(job.env)  # a plugin or dataset that cannot load fails here, before any actor starts
        self.run_dir.mkdir(parents=True, exist_ok=True)
        weights = _model_dir(job)
        self.memory = memory_check(job, weights)  # refuses a recipe the host cannot hold, before any actor
        job = self.job = dataclasses.replace(
            job, model=dataclasses.replace(job.model, hf_path=weights),
            checkpoint=dataclasses.replace(job.checkpoint, resume=job.checkpoint.resume and self.resume))
        if not job.checkpoint.resume:
            shutil.rmtree(self.run_dir / job.checkpoint.folder, ignore_errors=True)
        checkpoints = self.run_dir / job.checkpoint.folder
        if job.diloco.enabled:  # each replica group checkpoints under replica_<g> (mesh.replicas); export group 0's
            checkpoints = checkpoints / "replica_0"
        record_run_model(self.run_dir, job.model, checkpoints)  # what `composer-mesh export` rebuilds
        gen_spec = generator_spec(job, weights)
        replay_spec = self._replay_spec(weights)
        trainer_spec = trainer_spec_for(job, preference_pairs=replay_spec is not None)
        self._weight_dir = str(_weight_dir(job.job.name))
        supervised = not job.diloco.enabled  # DiLoCo replica groups (mesh.replicas) run without supervision
        state_dir = (str(self.run_dir / job.checkpoint.folder / "controller")
                     if job.checkpoint.enabled and supervised else "")
        install_fault_hook(self.fault_events)  # dead actors are handled where their calls fail, not by exiting
        if job.diloco.enabled:  # R trainer replica groups under torchft DiLoCo (mesh.replicas)
            from mesh.replicas import check_supported, place_replicas

            check_supported(job)
            placement = place_replicas(job.mesh, job.diloco, trainer_spec, gen_spec, replay_spec)
        else:
            placement = place(job.mesh, trainer_spec, gen_spec, replay_spec)
        self._placement = placement
        start = placement.trainer_setup[0]["step"]
        if state_dir and job.metrics.jsonl:
            start = _resume_at_logged_step(placement.trainer, start, self.run_dir, job, state_dir)
        self._start_step = start
        placement.write_pids(self.run_dir / "processes.json")
        state = (load_state(state_dir, start) if state_dir else None) or ControllerState(
            start, start, start * job.trainer.prompts_per_step)  # a checkpoint from before controller states
        self._end = max(job.trainer.steps, state.iteration)
        cfg = ControllerConfig(
            steps=self._end - state.iteration, prompts_per_step=job.trainer.prompts_per_step,
            max_seq_len=job.trainer.max_seq_len, policy=job.loss.policy, mode=job.trainer.mode,
            max_staleness=job.trainer.max_staleness, seed=job.job.seed, hints=job.loss.alpha > 0,
            policy_channel=job.loss.policy_weight > 0,
            weight_dir=self._weight_dir, serving_dtype=job.generator.dtype, anchor_every=job.mesh.weight_sync_anchor_every,
            pairs_per_step=job.trainer.prompts_per_step if placement.replay is not None else 0,
            dpo_reference=job.loss.preference.needs_reference, state_dir=state_dir,
            deadline=Deadline(job.mesh.hang_floor_s, job.mesh.hang_s_per_token),
            tokens_per_request=job.generator.group_size * job.generator.max_new_tokens * job.generator.max_turns,
            eval=EvalConfig(job.trainer.eval_every, job.trainer.eval_samples,
                            SamplingParams.from_config(job.generator, seed=job.job.seed)),
        )
        if job.mesh.max_restarts > 0 and supervised:
            self._supervisor = Supervisor(job.mesh.max_restarts, placement.respawn_generator,
                                          placement.restart_trainer if state_dir else None,
                                          placement.respawn_replay if placement.replay is not None else None,
                                          placement.retire_generator)
        chat = ChatTokens(AutoTokenizer.from_pretrained(job.model.tokenizer_path or weights))
        metrics_cfg = dataclasses.replace(job.metrics, progress_bar=job.metrics.progress_bar and self.progress)
        self._sink = MetricsSink(metrics_cfg, self.run_dir, job.trainer.steps, start)
        if job.diloco.enabled:
            from mesh.replicas import ReplicaController

            self._controller = ReplicaController(cfg, placement, job.diloco, chat, hinter=TemplateHintGenerator(),
                                                 on_step=self._on_step, prompt_cursor=state.prompt_cursor)
        else:
            self._controller = Controller(cfg, placement.trainer, placement.generators, chat,
                                          hinter=TemplateHintGenerator(), replay=placement.replay,
                                          on_step=self._on_step, supervisor=self._supervisor, state=state)

    def _replay_spec(self, weights: str) -> Any:
        """The teacher-replay actor's spec (and the local teacher server started), or None without channel 3."""
        from actors.teacher_replay import ReplaySpec
        from mesh.commands.serve_teachers import build_responder
        from replay.server import TeacherServer

        job = self.job
        if not (job.loss.beta > 0 and job.mesh.replay_procs > 0):
            return None
        teachers, ls = job.teachers, job.replay.local_server
        if not teachers.models:
            raise ValueError("loss.beta > 0 needs [[teachers.models]] (or set loss.beta = 0 / mesh.replay_procs = 0)")
        if ls.enabled:
            self._server = TeacherServer(build_responder(ls.responder, ls.model_dir, ls.noise), host=ls.host,
                                         port=ls.port, request_log=ls.request_log or None).start()
            teachers = dataclasses.replace(teachers, base_url=self._server.url)
        replay = dataclasses.replace(job.replay, output_dir=str(self.run_dir / "replay"))
        return ReplaySpec(replay, teachers, tokenizer_dir=job.model.tokenizer_path or weights)

    def _on_step(self, record: StepRecord) -> None:
        """Each step: remember it, log it; after a replacement, name the new processes in processes.json."""
        self.history.append(record)
        self._sink(record)
        if self._supervisor is not None:
            self._placement.write_pids(self.run_dir / "processes.json", len(self._supervisor.restarts))

    def stop(self) -> None:
        """Close the metrics sink, stop every actor and the local teacher server, remove the shared-memory
        weight folder. Safe to call twice; the Run cannot start again."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._sink is not None:
                self._sink.close()
        finally:
            try:
                if self._placement is not None:
                    self._placement.stop()
            finally:
                if self._server is not None:
                    self._server.stop()
                if self._weight_dir:
                    shutil.rmtree(self._weight_dir, ignore_errors=True)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- training -----------------------------------------------------------------------------

    def step(self) -> StepRecord:
        """One controller step (generate, train, sync, evaluate when due): sync mode only — async mode and
        DiLoCo interleave steps inside `run()`. Raises RuntimeError once `trainer.steps` steps are done."""
        self.start()
        if self.job.diloco.enabled or self.job.trainer.mode != "sync":
            raise RuntimeError("Run.step() needs trainer.mode = 'sync' without diloco.enabled; "
                               "run() drives async mode and DiLoCo")
        if self._controller.iteration >= self._end:
            raise RuntimeError(f"the run has done its trainer.steps = {self._end} steps; "
                               "build a Run with more (overrides={'trainer.steps': N}) to continue")
        self._controller.begin()
        while (record := self._controller.advance(self._end)) is None:
            pass  # a recovery rolled the step back (the trainer restarted from its checkpoint): run it again
        self._on_step(record)
        return record

    def run(self) -> dict[str, Any]:
        """The steps left, then the final checkpoint (unless the last step saved one) and the servable
        `hf/` export; writes summary.json and plot.png and returns the summary. The actors stay up for
        `generate`, `evaluate` and `export_hf` until `stop()`."""
        self.start()
        if self.summary is not None:
            return self.summary
        job, placement = self.job, self._placement
        if job.trainer.mode == "sync" and not job.diloco.enabled:
            while self._controller.iteration < self._end:
                self.step()
        else:
            self._controller.run()
        evals = getattr(self._controller, "evals", [])  # (step, metrics); the DiLoCo replica loop has none
        if evals:
            self._sink.scalars(*evals[0])  # the baseline (the later ones are in their steps' rows)
        self._sink.close()  # flushes metrics.jsonl and TensorBoard before the plot reads them
        last = self.history[-1].step if self.history else self._start_step
        if job.checkpoint.enabled and self.history and last % job.checkpoint.every_steps:
            for trainer in placement.groups if job.diloco.enabled else [placement.trainer]:  # DiLoCo: every group
                trainer.save_checkpoint.call().get()  # the last step, unless the trainer just saved it
        summary: dict[str, Any] = {
            "run_dir": str(self.run_dir), "start_step": self._start_step, "steps_run": len(self.history),
            "final_step": last,
            "replay": placement.replay.status.call_one().get() if placement.replay is not None else None,
            "restarts": [dataclasses.asdict(r) for r in (self._supervisor.restarts if self._supervisor else [])],
            "mesh_failures": len(self.fault_events),
            "hf": rank0(placement.trainer.save_hf.call(str(self.run_dir / "hf")).get()),  # the final weights
        }
        summary["memory"] = {  # peak bytes per phase and process (actors.phase_memory)
            "trainer": list(placement.trainer.memory_phases.call().get().values()),
            "generator": [_memory_phases(g) for g in placement.generators],
        }
        if job.diloco.enabled:
            summary["diloco"] = placement.manager.status.call_one().get()
        if evals:
            summary["heldout"] = {"before": {"step": evals[0][0], **evals[0][1]},
                                  "after": {"step": evals[-1][0], **evals[-1][1]}}
        if job.metrics.jsonl and job.metrics.plot and (self.run_dir / "metrics.jsonl").exists():
            from mesh.metrics import plot_run

            summary["plot"] = str(plot_run(self.run_dir / "metrics.jsonl", self.run_dir / "plot.png"))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.summary = summary
        return summary

    # ---- using the policy ---------------------------------------------------------------------

    def _ready(self) -> None:
        """Actors up and, in sync mode, the generators holding the trainer's weights."""
        self.start()
        if self.job.trainer.mode == "sync" and not self.job.diloco.enabled:
            self._controller.begin()

    def generate(self, prompts: list[str] | list[list[dict[str, str]]], *, max_new_tokens: int | None = None,
                 temperature: float = 0.0, seed: int = 0) -> list[str]:
        """One completion per prompt from the generators' current policy: a prompt is a user message or a
        whole conversation (`[{"role": ..., "content": ...}, ...]`), rendered with the tokenizer's chat
        template. Greedy unless `temperature` > 0 (then the recipe's top-p/top-k, seeded by `seed`)."""
        from actors.rollout import SamplingParams

        self._ready()
        conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else list(p) for p in prompts]
        gen = self.job.generator
        sampling = SamplingParams(temperature, gen.top_p, gen.top_k, max_new_tokens or gen.max_new_tokens, seed)
        return self._controller.generators[0].complete.call_one(conversations, sampling).get()

    def evaluate(self) -> dict[str, float]:
        """Held-out reward of the generators' current policy (`mesh.evaluation`: greedy and sampled on
        `trainer.eval_samples` held-out problems); does not change what training samples."""
        from mesh.evaluation import evaluate

        self._ready()
        return {"step": float(self._controller.version),
                **evaluate(self._controller.generators, self._controller.cfg.eval)}

    def export_hf(self, out_dir: str | os.PathLike) -> Path:
        """The trainer's current weights as a Hugging Face checkpoint (safetensors, config.json with
        `architectures`, generation config, tokenizer) that transformers loads and vLLM serves."""
        self.start()
        return Path(rank0(self._placement.trainer.save_hf.call(str(out_dir)).get()))


def _toml_literal(value: Any) -> str:
    """`value` as the TOML literal an override item carries."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    raise TypeError(f"override value {value!r}: expected bool, int, float, str or a list of them")


def _model_dir(job: JobConfig) -> str:
    """HF weights both the trainer and the generators start from (the demo's warm-started base when asked)."""
    from titan_ext.assets import cache_dir_for, hf_dir_for

    if job.model.hf_path and job.model.registry_flavour() is None:  # refuse a config.json here, before any actor
        from titan_ext.hf_config import check_supported, read_checkpoint_config

        check_supported(read_checkpoint_config(job.model.hf_path), f"{job.model.hf_path}/config.json")
    weights = hf_dir_for(job.model)
    if weights is None:
        raise ValueError(f"model.flavour = {job.model.flavour!r} needs model.hf_path (generators load HF weights)")
    demo = job.env.demo
    if job.env.task == "demo" and demo.warm_start_steps > 0:
        from envs.demo import format_examples
        from titan_ext.warmstart import WarmStartConfig, warm_start_dir

        ws = WarmStartConfig(steps=demo.warm_start_steps, lr=demo.warm_start_lr, seed=job.job.seed)
        weights = warm_start_dir(dataclasses.replace(job.model, hf_path=str(weights)),
                                 format_examples(demo, demo.warm_start_examples, job.job.seed), ws,
                                 cache_dir_for(job.model))
    return str(weights)


def _weight_dir(name: str, shm: Path = Path("/dev/shm")) -> Path:
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


def _resume_at_logged_step(trainer: Any, start: int, run_dir: Path, job: JobConfig, state_dir: str) -> int:
    """The step to resume from so that the metrics log stays contiguous.

    A controller killed after the trainer checkpointed step s but before the row of step s
    reached metrics.jsonl would leave a hole in the log; load the newest checkpoint whose steps
    are all logged instead (its controller state must exist). Returns the trainer's step.
    """
    from mesh.metrics import read_metrics
    from mesh.supervision import state_path
    from titan_ext.checkpoint import Checkpointer

    path = run_dir / "metrics.jsonl"
    logged = max((int(r["step"]) for r in read_metrics(path)), default=0) if path.exists() else 0
    every = job.metrics.log_every
    if not any(s % every == 0 for s in range(logged + 1, start + 1)):
        return start
    folder = run_dir / job.checkpoint.folder
    older = [s for s in Checkpointer(job.checkpoint, folder).complete_steps()
             if s <= logged and state_path(state_dir, s).is_file()]
    if not older:
        return start  # nothing older kept: resume where the trainer is (the log misses those rows)
    return int(rank0(trainer.load_checkpoint.call(older[-1]).get()))


def _memory_phases(generator: Any) -> dict[str, dict[str, int]] | None:
    """A generator's peak memory per phase, or None when it cannot answer (it died after the last step: the run's
    result does not depend on it)."""
    try:
        return generator.memory_phases.call_one().get(timeout=30)
    except Exception:  # noqa: BLE001 — any failure to reach it: the summary says None instead of failing the run
        return None
