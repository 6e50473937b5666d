"""`composer-mesh train CONFIG.toml`: the main job — meshes, controller loop, metrics, checkpoints.

Builds the specs of each role from the recipe (the tiny flavours' offline
assets are built on first use), starts the local teacher server when
`[replay.local_server] enabled`, places the roles (`mesh.placement`), and
runs the controller for the steps left: a checkpoint in
`<output_dir>/<name>/<checkpoint.folder>` is resumed unless `--no-resume`,
with the controller state saved for that step (`<checkpoint.folder>/controller/`:
step, prompt cursor, pending requests, async buffer, replay queue), so a
killed controller loses no step. Dead actors are replaced under
`[mesh] max_restarts` (`mesh.supervision`). Writes `metrics.jsonl`,
TensorBoard events, `processes.json` (pid per role), `summary.json` and
`plot.png` to `<output_dir>/<name>`. Weights move through
`/dev/shm/composer-mesh-<name>-<pid>` (`mesh.weight_sync`), removed at the end;
the folders that killed controllers of the same job left are removed at the start.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
from pathlib import Path
from typing import Any

NAME = "train"
HELP = "Run RL post-training: generators, teacher replay and the trainer on Monarch meshes."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="recipe (e.g. configs/debug_cpu.toml)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value ...")
    parser.add_argument("--no-resume", action="store_true", help="start fresh even when a checkpoint exists (put it before CONFIG)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (put it before CONFIG)")
    parser.add_argument("--debug", action="store_true",
                        help="on failure, raise with the full (remote) traceback (put it before CONFIG)")


def model_dir(job: Any) -> str:
    """HF weights both the trainer and the generators start from (the demo's warm-started base when asked)."""
    import dataclasses

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


def weight_dir_for(name: str, shm: Path = Path("/dev/shm")) -> Path:
    """This controller's shared-memory weight folder; removes those of controllers of job `name` that died
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


def resume_at_logged_step(trainer: Any, start: int, run_dir: Any, job: Any, state_dir: str) -> int:
    """The step to resume from so that the metrics log stays contiguous.

    A controller killed after the trainer checkpointed step s but before the row of step s
    reached metrics.jsonl would leave a hole in the log; load the newest checkpoint whose steps
    are all logged instead (its controller state must exist). Returns the trainer's step.
    """
    from mesh.metrics import read_metrics
    from mesh.supervision import state_path
    from mesh.weight_sync_baseline import rank0
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


def generator_spec(job: Any, weights: str) -> Any:
    """The generators' `GeneratorSpec`: the recipe's weights, sampling, environment and device
    (`[model] device`; "auto" resolves in each generator process)."""
    from actors.generator import GeneratorSpec
    from mesh.placement import torch_threads

    return GeneratorSpec(model_dir=weights, tokenizer_dir=job.model.tokenizer_path, generator=job.generator,
                         env=job.env, max_context_tokens=job.trainer.max_seq_len, device=job.model.device,
                         seed=job.job.seed, torch_threads=torch_threads(job.mesh, "generator", os.cpu_count() or 1),
                         python_path=job.job.python_path)


def trainer_spec_for(job: Any, *, preference_pairs: bool) -> Any:
    """The trainer's `TrainerSpec`; without a preference channel that can run (no replay actor, DiLoCo) the
    frozen DPO reference — one more parameter copy per rank — is not built (`dpo_reference = "policy"`)."""
    import dataclasses

    from titan_ext.trainer import TrainerSpec

    from mesh.placement import torch_threads

    if not preference_pairs and job.trainer.dpo_reference == "frozen":
        job = dataclasses.replace(job, trainer=dataclasses.replace(job.trainer, dpo_reference="policy"))
    threads = torch_threads(job.mesh, "trainer", os.cpu_count() or 1)
    return dataclasses.replace(TrainerSpec.from_job(job), torch_threads=threads)


def heldout_line(heldout: dict[str, dict[str, float]]) -> str:
    """The summary's one-line held-out before/after."""
    b, a = heldout["before"], heldout["after"]
    return (f"held-out reward: greedy {b['eval/heldout_greedy']:.3f} -> {a['eval/heldout_greedy']:.3f}, "
            f"sampled {b['eval/heldout_sampled']:.3f} -> {a['eval/heldout_sampled']:.3f} "
            f"(step {b['step']} -> {a['step']})")


def run(args: argparse.Namespace) -> int:
    import sys

    from mesh.commands import load_job

    job = load_job(args)
    if job is None:
        return 2
    from mesh.errors import describe

    try:
        summary = train(job, resume=not args.no_resume, progress=not args.no_progress)
    except (FileNotFoundError, ValueError) as e:  # a recipe the controller refused before placing actors
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # an actor failed (Monarch ActorError) or the run broke: one line, --debug for all
        if args.debug:
            raise
        print(f"error: {describe(e)}", file=sys.stderr)
        return 1
    import json

    print(json.dumps(summary))
    return 0


def train(job: Any, *, resume: bool = True, progress: bool = True) -> dict[str, Any]:
    """The whole run; returns the summary written to `<run dir>/summary.json`."""
    import dataclasses
    import json
    import sys

    from transformers import AutoTokenizer

    from actors.episodes import ChatTokens
    from actors.rollout import SamplingParams
    from actors.teacher_replay import ReplaySpec
    from mesh.commands.serve_teachers import build_responder
    from mesh.controller import Controller, ControllerConfig
    from mesh.evaluation import EvalConfig
    from mesh.metrics import MetricsSink, plot_run
    from mesh.placement import place
    from mesh.supervision import ControllerState, Deadline, Supervisor, install_fault_hook, load_state
    from mesh.weight_sync_baseline import rank0
    from replay.hints import TemplateHintGenerator
    from replay.server import TeacherServer
    from titan_ext.hf_export import record_run_model

    from envs.factory import check_task
    from envs.plugin import add_python_path

    add_python_path(job.job.python_path)
    check_task(job.env)  # a plugin or dataset that cannot load fails here, before any actor starts

    ds = job.env.dataset
    if job.env.task == "dataset" and job.trainer.eval_every > 0 and not ds.heldout_file and ds.heldout_fraction == 0:
        raise ValueError("trainer.eval_every > 0 needs held-out rows: set env.dataset.heldout_file or "
                         "env.dataset.heldout_fraction (or trainer.eval_every = 0)")
    if job.diloco.enabled and job.trainer.eval_every > 0:
        raise ValueError("trainer.eval_every > 0 is not supported with diloco.enabled (the replica loop has no "
                         "held-out evaluation yet); set trainer.eval_every = 0")
    run_dir = Path(job.job.output_dir) / job.job.name
    run_dir.mkdir(parents=True, exist_ok=True)
    weights = model_dir(job)
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, hf_path=weights),
                              checkpoint=dataclasses.replace(job.checkpoint, resume=job.checkpoint.resume and resume))
    if not job.checkpoint.resume:
        shutil.rmtree(run_dir / job.checkpoint.folder, ignore_errors=True)
    checkpoints = run_dir / job.checkpoint.folder
    if job.diloco.enabled:  # each replica group checkpoints under replica_<g> (mesh.replicas); export group 0's
        checkpoints = checkpoints / "replica_0"
    record_run_model(run_dir, job.model, checkpoints)  # what `composer-mesh export` rebuilds
    gen_spec = generator_spec(job, weights)
    server = None
    replay_spec = None
    if job.loss.beta > 0 and job.mesh.replay_procs > 0:
        teachers, ls = job.teachers, job.replay.local_server
        if not teachers.models:
            raise ValueError("loss.beta > 0 needs [[teachers.models]] (or set loss.beta = 0 / mesh.replay_procs = 0)")
        if ls.enabled:
            server = TeacherServer(build_responder(ls.responder, ls.model_dir, ls.noise), host=ls.host,
                                   port=ls.port, request_log=ls.request_log or None).start()
            teachers = dataclasses.replace(teachers, base_url=server.url)
        replay = dataclasses.replace(job.replay, output_dir=str(run_dir / "replay"))
        replay_spec = ReplaySpec(replay, teachers, tokenizer_dir=job.model.tokenizer_path or weights)
    trainer_spec = trainer_spec_for(job, preference_pairs=replay_spec is not None)
    weight_dir = str(weight_dir_for(job.job.name))
    supervised = not job.diloco.enabled  # DiLoCo replica groups (mesh.replicas) run without supervision
    state_dir = str(run_dir / job.checkpoint.folder / "controller") if job.checkpoint.enabled and supervised else ""
    fault_events: list[str] = []
    install_fault_hook(fault_events)  # dead actors are handled where their calls fail, not by exiting
    if job.diloco.enabled:  # R trainer replica groups under torchft DiLoCo (mesh.replicas)
        from mesh.replicas import check_supported, place_replicas

        check_supported(job)
        placement = place_replicas(job.mesh, job.diloco, trainer_spec, gen_spec, replay_spec)
    else:
        placement = place(job.mesh, trainer_spec, gen_spec, replay_spec)
    try:
        start = placement.trainer_setup[0]["step"]
        if state_dir and job.metrics.jsonl:
            start = resume_at_logged_step(placement.trainer, start, run_dir, job, state_dir)
        placement.write_pids(run_dir / "processes.json")
        state = (load_state(state_dir, start) if state_dir else None) or ControllerState(
            start, start, start * job.trainer.prompts_per_step)  # a checkpoint from before controller states
        cfg = ControllerConfig(
            steps=max(0, job.trainer.steps - state.iteration), prompts_per_step=job.trainer.prompts_per_step,
            max_seq_len=job.trainer.max_seq_len, policy=job.loss.policy, mode=job.trainer.mode,
            max_staleness=job.trainer.max_staleness, seed=job.job.seed, hints=job.loss.alpha > 0,
            weight_dir=weight_dir,
            pairs_per_step=job.trainer.prompts_per_step if placement.replay is not None else 0,
            dpo_reference=job.loss.preference.needs_reference, state_dir=state_dir,
            deadline=Deadline(job.mesh.hang_floor_s, job.mesh.hang_s_per_token),
            tokens_per_request=job.generator.group_size * job.generator.max_new_tokens * job.generator.max_turns,
            eval=EvalConfig(job.trainer.eval_every, job.trainer.eval_samples,
                            SamplingParams.from_config(job.generator, seed=job.job.seed)),
        )
        supervisor = None
        if job.mesh.max_restarts > 0 and supervised:
            supervisor = Supervisor(job.mesh.max_restarts, placement.respawn_generator,
                                    placement.restart_trainer if state_dir else None,
                                    placement.respawn_replay if placement.replay is not None else None,
                                    placement.retire_generator)
        chat = ChatTokens(AutoTokenizer.from_pretrained(job.model.tokenizer_path or weights))
        metrics_cfg = dataclasses.replace(job.metrics, progress_bar=job.metrics.progress_bar and progress)
        with MetricsSink(metrics_cfg, run_dir, job.trainer.steps, start) as metrics_sink:
            def sink(record: Any) -> None:  # each step: log it; after a replacement, name the new processes
                metrics_sink(record)
                if supervisor is not None:
                    placement.write_pids(run_dir / "processes.json", len(supervisor.restarts))

            if job.diloco.enabled:
                from mesh.replicas import ReplicaController

                controller = ReplicaController(cfg, placement, job.diloco, chat, hinter=TemplateHintGenerator(),
                                               on_step=sink, prompt_cursor=state.prompt_cursor)
            else:
                controller = Controller(cfg, placement.trainer, placement.generators, chat,
                                        hinter=TemplateHintGenerator(), replay=placement.replay, on_step=sink,
                                        supervisor=supervisor, state=state)
            history = controller.run()
            evals = getattr(controller, "evals", [])  # (step, metrics); the DiLoCo replica loop has none
            if evals:
                metrics_sink.scalars(*evals[0])  # the baseline (the later ones are in their steps' rows)
        if job.checkpoint.enabled and history and history[-1].step % job.checkpoint.every_steps:
            for trainer in placement.groups if job.diloco.enabled else [placement.trainer]:  # DiLoCo: every group
                trainer.save_checkpoint.call().get()  # the last step, unless the trainer just saved it
        hf_dir = rank0(placement.trainer.save_hf.call(str(run_dir / "hf")).get())  # the final weights, servable
        replay_status = placement.replay.status.call_one().get() if placement.replay is not None else None
        diloco_status = placement.manager.status.call_one().get() if job.diloco.enabled else None
    finally:
        placement.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(weight_dir, ignore_errors=True)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "start_step": start, "steps_run": len(history),
                               "final_step": history[-1].step if history else start, "replay": replay_status,
                               "restarts": [dataclasses.asdict(r) for r in (supervisor.restarts if supervisor else [])],
                               "mesh_failures": len(fault_events),  # Monarch supervision events seen
                               "hf": hf_dir}
    if diloco_status is not None:
        summary["diloco"] = diloco_status
    if evals:
        summary["heldout"] = {"before": {"step": evals[0][0], **evals[0][1]},
                              "after": {"step": evals[-1][0], **evals[-1][1]}}
        print(heldout_line(summary["heldout"]), file=sys.stderr)
    if job.metrics.jsonl and (run_dir / "metrics.jsonl").exists():
        if job.metrics.plot:
            summary["plot"] = str(plot_run(run_dir / "metrics.jsonl", run_dir / "plot.png"))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
