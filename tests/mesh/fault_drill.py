"""One supervised controller run for the fault drills (tests/mesh/test_mesh_faults.py), in a process of its own.

    python tests/mesh/fault_drill.py RESULT.json --assets DIR --run DIR --steps N \
        [--kill-generator-at STEP] [--stop-generator-at STEP] [--kill-trainer-at STEP] [--respawn fresh|live]
        [--mode sync|async --max-staleness K]

Places a one-process trainer (checkpoints every 2 steps) and two generator
processes, runs the sync controller with a `Supervisor`, and — when asked —
SIGKILLs the OS process of generator 1 (pid from its `info` endpoint, 0.3 s
after its step is recorded, so the kill lands in the next step's work), SIGSTOPs
it as its step is recorded (a hung generator: the controller's per-call
deadline, floor `--hang-floor` seconds, must notice it) and SIGKILLs the OS process of
the trainer (pid from `setup`, as its step is recorded). Writes
per-step records (step, iteration, seeds, metrics), restarts, pids and final
weight digests as JSON. Its own process, like a run: `place` applies the
[mesh] supervision settings (poll 1 s, state query 5 s) before the first mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--assets", required=True, help="the tiny dense HF model directory")
    ap.add_argument("--run", required=True, help="run directory (checkpoints, weights)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--kill-generator-at", type=int, default=0, help="kill generator 1 after this step (0: never)")
    ap.add_argument("--kill-trainer-at", type=int, default=0, help="kill the trainer after this step (0: never)")
    ap.add_argument("--stop-generator-at", type=int, default=0, help="SIGSTOP generator 1 after this step (0: never)")
    ap.add_argument("--hang-floor", type=float, default=120.0, help="deadline floor of a generate call (seconds)")
    ap.add_argument("--trainer-procs", type=int, default=1, help="trainer ranks (FSDP over gloo)")
    ap.add_argument("--kill-trainer-rank", type=int, default=0, help="which trainer rank --kill-trainer-at kills")
    ap.add_argument("--respawn", choices=("fresh", "live"), default="fresh")
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--max-staleness", type=int, default=0, help="async: oldest policy a trained group may come from")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from composer_mesh.actors.episodes import ChatTokens
    from composer_mesh.actors.generator import GeneratorSpec
    from composer_mesh.actors.rollout import SamplingParams
    from composer_mesh.configs.sections.checkpoint import CheckpointConfig
    from composer_mesh.configs.sections.generator import GeneratorConfig
    from composer_mesh.configs.sections.loss import LossConfig, PolicyLossConfig
    from composer_mesh.configs.sections.mesh import MeshConfig
    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.configs.sections.optimizer import OptimizerConfig
    from composer_mesh.configs.sections.trainer import TrainerConfig
    from composer_mesh.mesh.controller import Controller, ControllerConfig
    from composer_mesh.mesh.placement import place
    from composer_mesh.mesh.supervision import Deadline, Supervisor, install_fault_hook
    from composer_mesh.actors.mesh_utils import rank0
    from composer_mesh.replay.hints import TemplateHintGenerator
    from composer_mesh.titan_ext.spec import TrainerSpec

    run = Path(args.run)
    events: list[str] = []
    install_fault_hook(events)
    policy = PolicyLossConfig(dynamic_sampling=False)
    spec = TrainerSpec(
        model=ModelConfig(flavour="tiny", device="cpu", hf_path=args.assets),
        trainer=TrainerConfig(steps=50, microbatches=1, max_seq_len=160),
        optimizer=OptimizerConfig(name="adamw", lr=3e-3, weight_decay=0.0),
        loss=LossConfig(alpha=1.0, beta=0.0, policy=policy),
        checkpoint=CheckpointConfig(every_steps=2, keep_last=2), checkpoint_dir=str(run / "checkpoints"),
        torch_threads=1,
    )
    gen_spec = GeneratorSpec(model_dir=args.assets, max_context_tokens=160, torch_threads=1,
                             generator=GeneratorConfig(engine="hf", group_size=3, max_new_tokens=8, max_turns=2))
    mesh = MeshConfig(trainer_procs=args.trainer_procs, generator_procs=2, replay_procs=0, respawn=args.respawn)
    placement = place(mesh, spec, gen_spec)
    try:
        supervisor = Supervisor(2, placement.respawn_generator, placement.restart_trainer,
                                retire_generator=placement.retire_generator)
        cfg = ControllerConfig(steps=args.steps, prompts_per_step=4, max_seq_len=160, policy=policy,
                               mode=args.mode, max_staleness=args.max_staleness,
                               weight_dir=str(run / "weights"), sampling=SamplingParams(1.0, max_new_tokens=8, seed=0),
                               state_dir=str(run / "checkpoints" / "controller"),
                               deadline=Deadline(args.hang_floor, mesh.hang_s_per_token), tokens_per_request=3 * 8 * 2)
        pids = placement.pids()
        killed: dict[str, int] = {}

        run.mkdir(parents=True, exist_ok=True)
        placement.write_pids(run / "processes.json")

        def on_step(record) -> None:
            placement.write_pids(run / "processes.json", len(supervisor.restarts))  # as `train` does
            if record.step == args.kill_trainer_at and "trainer" not in killed:
                killed["trainer"] = placement.trainer_setup[args.kill_trainer_rank]["pid"]
                killed["trainer_at"] = time.monotonic()
                os.kill(killed["trainer"], signal.SIGKILL)
            if record.step == args.kill_generator_at and "generator" not in killed:
                killed["generator"] = placement.generators[1].info.call_one().get()["pid"]
                threading.Timer(0.3, os.kill, (killed["generator"], signal.SIGKILL)).start()
            if record.step == args.stop_generator_at and "stopped" not in killed:
                # at once, before the next step's calls are issued: a step can take < 0.3 s on a quiet box, and a
                # delayed SIGSTOP then lands after the run's last call (nothing hangs, nothing to detect)
                killed["stopped"] = placement.generators[1].info.call_one().get()["pid"]
                killed["stopped_at"] = time.monotonic()
                os.kill(killed["stopped"], signal.SIGSTOP)

        chat = ChatTokens(AutoTokenizer.from_pretrained(args.assets))
        ctl = Controller(cfg, placement.trainer, placement.generators, chat, hinter=TemplateHintGenerator(),
                         on_step=on_step, supervisor=supervisor)
        history = ctl.run()
        result = {
            "records": [{"step": h.step, "iteration": h.iteration, "seeds": h.seeds, "seconds": h.seconds,
                         "staleness": h.staleness, "dropped_stale": h.dropped_stale,
                         "metrics": {k: v for k, v in h.metrics.items() if not k.startswith("time/")}}
                        for h in history],
            "restarts": [r.role for r in supervisor.restarts], "restart_errors": [r.error for r in supervisor.restarts],
            "kill_to_trainer_restart_s": [r.started - killed["trainer_at"] for r in supervisor.restarts
                                          if r.role == "trainer"],
            "trainer_restart_build_s": [r.seconds for r in supervisor.restarts if r.role == "trainer"],
            "stop_to_restart_s": [r.started - killed["stopped_at"] for r in supervisor.restarts
                                  if "stopped_at" in killed and r.started > killed["stopped_at"]],
            "pids_before": pids, "killed": killed,
            "pids_after": placement.pids(), "processes_json": json.loads((run / "processes.json").read_text()),
            # async: groups generated or requested but not trained when the run ended (the workers have stopped)
            "unused_at_end": sorted([g.seed for g in ctl.buffer] + [r.seed for r in ctl.prompts.position()[1]]),
            "trainer_digest": rank0(ctl.trainer.weights_digest.call().get()),
            "generator_digests": [g.weights_digest.call_one().get() for g in ctl.generators],
            "fault_events": len(events),
            "threads": [placement.trainer_setup[0]["threads"]] + [g.info.call_one().get()["threads"]
                                                                  for g in ctl.generators],
        }
    finally:
        placement.stop()
    Path(args.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
