"""The public Python API: build a run from a recipe, step it, sample from it, evaluate it, export it, stop it.

    from composer_mesh.mesh.api import Run

    with Run.from_toml("configs/demo_cpu.toml", {"trainer.steps": 4}) as run:
        record = run.step()                         # one controller step (sync mode)
        run.generate(["What is 2 + 3?"])            # completions of the current policy
        run.evaluate()                              # held-out reward, greedy and sampled
        summary = run.run()                         # the steps left, final checkpoint, hf/ export
        run.export_hf("out/hf")                     # servable weights (transformers, vLLM)

A `Run` writes what `composer-mesh train` writes (that command is `Run(job).run()`
plus exit codes): `metrics.jsonl`, TensorBoard events, `processes.json`,
checkpoints with controller states (resumed unless `resume=False`),
`summary.json`, `plot.png` and `hf/` under `<job.output_dir>/<job.name>`. A switched-on channel 2 or 3 that
gets nothing warns at each step and is named in summary.json's `silent_channels` (`mesh.channels`).
Actors start on the first call that needs them (`start()`, wired by
`mesh.launch.Launch`); `stop()` — or
leaving the `with` block — removes them, the local teacher server and the
shared-memory weight folder. Dead actors are replaced under
`[mesh] max_restarts` as in `train`. Refused recipes raise `ValueError` (a
`configs.loader.ConfigError` names the key) before any actor starts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, TypeVar

from composer_mesh.actors.mesh_utils import rank0
from composer_mesh.actors.rollout import SamplingParams
from composer_mesh.configs.loader import load_config
from composer_mesh.configs.schema import JobConfig
from composer_mesh.mesh.channels import ChannelWatch
from composer_mesh.mesh.controller import StepRecord
from composer_mesh.mesh.evaluation import evaluate
from composer_mesh.mesh.metrics import plot_run, process_age_s, pyplot
from composer_mesh.mesh.packing import Drops, explain_drops
from composer_mesh.mesh.prespawn import Prespawned

if TYPE_CHECKING:
    from composer_mesh.mesh.launch import Launch

__all__ = ["Run", "StepRecord"]

_T = TypeVar("_T")


class Run:
    """One training run of a recipe on Monarch meshes: `start`, `step`, `run`, `generate`, `evaluate`,
    `export_hf`, `stop`; `metrics` holds every step's row as written to metrics.jsonl."""

    def __init__(self, job: JobConfig, *, resume: bool = True, progress: bool = False,
                 early: Prespawned | None = None) -> None:
        """`early`: the recipe's processes started before the caller's heavy imports (`mesh.prespawn.prespawn`
        of this `job`); the Run places its actors on them and stops them."""
        self.job = job
        self.early = early
        self.resume = resume
        self.progress = progress
        # the steps this Run took, oldest first
        self.history: list[StepRecord] = []
        self.summary: dict[str, Any] | None = None  # set by run()
        # Monarch supervision events seen (dead actors are handled in place)
        self.fault_events: list[str] = []
        # mesh.memory.MemoryEstimate of the recipe on this host (None: not checked)
        self.memory: Any = None
        # actors, sink and controller (mesh.launch), set by start()
        self._launch: Launch | None = None
        # what channels 2 and 3 got, step by step (set by start())
        self._channels: ChannelWatch | None = None
        self._stopped = False

    @classmethod
    def from_toml(cls, path: str | os.PathLike, overrides: Mapping[str, Any] | Iterable[str] = (), *,
                  resume: bool = True, progress: bool = False) -> "Run":
        """A run of the recipe at `path` (or a shipped recipe's name) with `overrides`: a mapping
        `{"trainer.steps": 4}` or CLI items `["--trainer.steps=4"]`. Raises ConfigError naming the key."""
        return cls(load_config(path, overrides if isinstance(overrides, Mapping) else list(overrides)),
                   resume=resume, progress=progress)

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
        return self._launch.controller.iteration if self._launch is not None else 0

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> "Run":
        """Check the recipe's task and model, place the actors, resume the newest checkpoint (unless
        `resume=False`), open the metrics sink. Later calls do nothing."""
        self._launched()
        return self

    def _launched(self) -> Launch:
        """`start()`'s work, returning what it brought up (the actors, sink and controller of `mesh.launch`)."""
        if self._stopped:
            raise RuntimeError("this Run was stopped; build a new one")
        if self._launch is None:
            # lazy: start-up time: the launch stack (transformers, TorchTitan, placement) loads when a run starts
            from composer_mesh.mesh.launch import Launch

            try:
                self._launch = Launch.start(self.job, self.run_dir, resume=self.resume, progress=self.progress,
                                            on_step=self._on_step, fault_events=self.fault_events,
                                            early=self.early)
            except BaseException:
                self.stop()
                raise
            self.job, self.memory = self._launch.job, self._launch.memory
            self._channels = ChannelWatch(self.job, replay=self._launch.placement.replay is not None)
        return self._launch

    def _on_step(self, record: StepRecord) -> None:
        """Each step: remember it, log it; after a replacement, name the new processes in processes.json."""
        launch = _set_by_start(self._launch, "the launch")
        self.history.append(record)
        _set_by_start(self._channels, "the channel watch").step(record)
        _set_by_start(launch.sink, "the metrics sink")(record)
        if launch.supervisor is not None:
            launch.placement.write_pids(self.run_dir / "processes.json", len(launch.supervisor.restarts))

    def stop(self) -> None:
        """Close the metrics sink, stop every actor and the local teacher server, remove the shared-memory
        weight folder. Safe to call twice; the Run cannot start again."""
        if self._stopped:
            return
        self._stopped = True
        if self._launch is not None:
            self._launch.stop()
        elif self.early is not None:
            self.early.stop()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- training -----------------------------------------------------------------------------

    def step(self) -> StepRecord:
        """One controller step (generate, train, sync, evaluate when due): sync mode only — async mode and
        DiLoCo interleave steps inside `run()`. Raises RuntimeError once `trainer.steps` steps are done."""
        launch = self._launched()
        if not launch.loop.steppable:
            raise RuntimeError("Run.step() needs trainer.mode = 'sync' without diloco.enabled; "
                               "run() drives async mode and DiLoCo")
        controller = launch.controller
        if controller.iteration >= launch.end:
            raise RuntimeError(f"the run has done its trainer.steps = {launch.end} steps; "
                               "build a Run with more (overrides={'trainer.steps': N}) to continue")
        controller.begin()
        while (record := controller.advance(launch.end)) is None:
            # a recovery rolled the step back (the trainer restarted from its checkpoint): run it again
            pass
        self._on_step(record)
        return record

    def run(self) -> dict[str, Any]:
        """The steps left, then the final checkpoint (unless the last step saved one) and the servable
        `hf/` export; writes summary.json and plot.png and returns the summary. The actors stay up for
        `generate`, `evaluate` and `export_hf` until `stop()`."""
        launch = self._launched()
        if self.summary is not None:
            return self.summary
        job, placement, loop = self.job, launch.placement, launch.loop
        sink = _set_by_start(launch.sink, "the metrics sink")
        channels = _set_by_start(self._channels, "the channel watch")
        plotting = job.metrics.jsonl and job.metrics.plot
        if plotting:
            # matplotlib loads while the steps run (the controller mostly waits on its actors then)
            warm = _in_thread(pyplot)
        if loop.steppable:
            while launch.controller.iteration < launch.end:
                self.step()
                if "first_step" not in launch.timeline:
                    # the first step holds the first weight sync and every warm-up
                    launch.timeline["first_step"] = process_age_s()
        else:
            launch.controller.run()
        launch.timeline["steps"] = process_age_s()
        evals = loop.evals(launch.controller)  # (step, metrics), oldest first
        if evals:
            # the baseline (the later ones are in their steps' rows)
            sink.scalars(*evals[0])
        # flushes metrics.jsonl and TensorBoard before the plot reads them
        sink.close()
        plotted = None
        if plotting and (self.run_dir / "metrics.jsonl").exists():
            warm.result()
            # drawn while the trainer saves and exports (matplotlib's Agg, no display: safe off the main thread)
            plotted = _in_thread(plot_run, self.run_dir / "metrics.jsonl", self.run_dir / "plot.png",
                                 evals[0] if evals and evals[0][0] == launch.start_step else None)
        last = self.history[-1].step if self.history else launch.start_step
        if job.checkpoint.enabled and self.history and last % job.checkpoint.every_steps:
            for trainer in loop.trainers(placement):
                # the last step, unless the trainer just saved it
                trainer.save_checkpoint.call().get()
        summary: dict[str, Any] = {
            "run_dir": str(self.run_dir), "start_step": launch.start_step, "steps_run": len(self.history),
            "final_step": last,
            "replay": placement.replay.status.call_one().get() if placement.replay is not None else None,
            "restarts": [dataclasses.asdict(r) for r in (launch.supervisor.restarts if launch.supervisor else [])],
            "mesh_failures": len(self.fault_events),
            "hf": rank0(placement.trainer.save_hf.call(str(self.run_dir / "hf")).get()),  # the final weights
        }
        # peak bytes per phase and process (actors.phase_memory)
        summary["memory"] = {
            "trainer": list(placement.trainer.memory_phases.call().get().values()),
            "generator": [_memory_phases(g) for g in placement.generators],
        }
        summary.update(loop.summary(placement))
        summary.update(trained_summary(self.history, job))
        summary.update(channels.summary(self.history, summary["replay"]))
        if evals:
            summary["heldout"] = {"split": job.trainer.eval_split,
                                  "before": {"step": evals[0][0], **evals[0][1]},
                                  "after": {"step": evals[-1][0], **evals[-1][1]}}
        if plotted is not None:
            summary["plot"] = str(plotted.result())
        # the final checkpoint, export and plot (stopping the actors comes after)
        launch.timeline["final"] = process_age_s()
        summary["timeline_s"] = dict(launch.timeline)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.summary = summary
        return summary

    # ---- using the policy ---------------------------------------------------------------------

    def _ready(self) -> Any:
        """Actors up and, in sync mode, the generators holding the trainer's weights; returns the controller."""
        launch = self._launched()
        if launch.loop.steppable:
            launch.controller.begin()
        return launch.controller

    def generate(self, prompts: list[str] | list[list[dict[str, str]]], *, max_new_tokens: int | None = None,
                 temperature: float = 0.0, seed: int = 0) -> list[str]:
        """One completion per prompt from the generators' current policy: a prompt is a user message or a
        whole conversation (`[{"role": ..., "content": ...}, ...]`), rendered with the tokenizer's chat
        template. Greedy unless `temperature` > 0 (then the recipe's top-p/top-k, seeded by `seed`)."""
        controller = self._ready()
        conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else list(p) for p in prompts]
        gen = self.job.generator
        sampling = SamplingParams(temperature, gen.top_p, gen.top_k, max_new_tokens or gen.max_new_tokens, seed)
        return controller.generators[0].complete.call_one(conversations, sampling).get()

    def evaluate(self) -> dict[str, float]:
        """Held-out reward of the generators' current policy (`mesh.evaluation`: greedy and sampled on
        `trainer.eval_samples` held-out problems); does not change what training samples."""
        controller = self._ready()
        return {"step": float(controller.version), **evaluate(controller.generators, controller.cfg.eval)}

    def export_hf(self, out_dir: str | os.PathLike) -> Path:
        """The trainer's current weights as a Hugging Face checkpoint (safetensors, config.json with
        `architectures`, generation config, tokenizer) that transformers loads and vLLM serves."""
        launch = self._launched()
        return Path(rank0(launch.placement.trainer.save_hf.call(str(out_dir)).get()))


def _set_by_start(value: _T | None, what: str) -> _T:
    """`value`, which `Run.start()` sets: a RuntimeError naming `what` while it is unset (narrows the Optional
    state for the type checker where start() has run)."""
    if value is None:
        raise RuntimeError(f"{what} is set by Run.start(), which has not completed")
    return value


def _in_thread(fn: Any, *args: Any) -> concurrent.futures.Future:
    """`fn(*args)` on a daemon thread of its own; its result (or exception) from the future."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name=f"run-{fn.__name__}", daemon=True).start()
    return future


def trained_summary(history: list[StepRecord], job: JobConfig) -> dict[str, Any]:
    """summary.json's account of training: `trained_steps` (steps whose batch reached the trainer), the
    groups dropped over the run per reason, and, when steps ran but none trained, `untrained`: why, in one line."""
    drops = Drops.total([r.metrics for r in history])
    out: dict[str, Any] = {"trained_steps": sum("skipped" not in r.metrics for r in history),
                           "dropped_groups": {k: n for k, n in drops.counts.items() if n}}
    if history and not out["trained_steps"]:
        out["untrained"] = (f"none of the {len(history)} steps trained (the trainer never stepped): "
                            + explain_drops(drops, job.trainer.max_seq_len, job.generator.max_new_tokens))
    return out


def _memory_phases(generator: Any) -> dict[str, dict[str, int]] | None:
    """A generator's peak memory per phase, or None when it cannot answer (it died after the last step: the run's
    result does not depend on it)."""
    try:
        return generator.memory_phases.call_one().get(timeout=30)
    except Exception:  # noqa: BLE001 — any failure to reach it: the summary says None instead of failing the run
        return None
