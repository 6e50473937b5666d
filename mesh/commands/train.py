"""`composer-mesh train CONFIG.toml`: the main job — meshes, controller loop, metrics, checkpoints.

A thin caller of the public API (`mesh.api.Run`): it loads the recipe with
the command line's overrides, runs it and prints the summary. What a run does
and writes (resume, supervision, metrics.jsonl, TensorBoard, processes.json,
summary.json, plot.png, hf/, the shared-memory weight folder) is documented
there. Exit codes: 0 done; 2 a recipe refused before any role's actor started
(one line naming the key or file; the processes `mesh.prespawn` started are
stopped); 1 an actor failed or the run broke (one
line naming the actor; `--debug` raises with the full remote traceback); 3 the
run finished but no step trained (every group dropped: one line naming the
reasons and the key to change; summary.json has `trained_steps` and
`dropped_groups`), or a switched-on channel 2 or 3 got nothing (no hinted token,
no pair: one line per channel naming it, its key and why; summary.json has
`silent_channels`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from composer_mesh.mesh.commands import load_job

NAME = "train"
HELP = "Run RL post-training: generators, teacher replay and the trainer on Monarch meshes."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="recipe (e.g. configs/coding_cpu.toml)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value ...")
    parser.add_argument("--no-resume", action="store_true", help="start fresh even when a checkpoint exists (put it before CONFIG)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (put it before CONFIG)")
    parser.add_argument("--debug", action="store_true",
                        help="on failure, raise with the full (remote) traceback (put it before CONFIG)")


def heldout_line(heldout: dict[str, Any]) -> str:
    """The summary's one-line held-out (or validation: `[trainer] eval_split`) before/after."""
    b, a = heldout["before"], heldout["after"]
    label = "validation" if heldout.get("split") == "validation" else "held-out"
    return (f"{label} reward: greedy {b['eval/heldout_greedy']:.3f} -> {a['eval/heldout_greedy']:.3f}, "
            f"sampled {b['eval/heldout_sampled']:.3f} -> {a['eval/heldout_sampled']:.3f} "
            f"(step {b['step']} -> {a['step']})"
            + (f"; pass rate: greedy {b['eval/heldout_greedy_pass']:.3f} -> {a['eval/heldout_greedy_pass']:.3f}, "
               f"sampled {b['eval/heldout_sampled_pass']:.3f} -> {a['eval/heldout_sampled_pass']:.3f}"
               if "eval/heldout_greedy_pass" in b else ""))


def run(args: argparse.Namespace) -> int:
    job = load_job(args)
    if job is None:
        return 2
    # the role processes start (and import torch) before the controller's own heavy imports below
    # lazy: start-up time: Monarch loads only for train, not to build the CLI
    from composer_mesh.mesh.prespawn import prespawn

    early = prespawn(job)
    try:
        # lazy: start-up time: every command module loads to build the CLI; torch and the mesh stack load only here
        from composer_mesh.mesh.api import Run
        from composer_mesh.mesh.errors import describe

        try:
            with Run(job, resume=not args.no_resume, progress=not args.no_progress, early=early) as run_:
                summary = run_.run()
        # a recipe the controller refused before placing actors
        except (FileNotFoundError, ValueError) as e:
            if args.debug:
                raise
            print(f"error: {e}", file=sys.stderr)
            return 2
        # an actor failed (Monarch ActorError) or the run broke: one line, --debug for all
        except Exception as e:
            if args.debug:
                raise
            print(f"error: {describe(e)}", file=sys.stderr)
            return 1
    finally:
        # processes started early that no run took (idempotent after the run stopped them)
        if early is not None:
            early.stop()
    if "heldout" in summary:
        print(heldout_line(summary["heldout"]), file=sys.stderr)
    print(json.dumps(summary))
    if "untrained" in summary:
        print(f"error: {summary['untrained']}", file=sys.stderr)
        return 3
    for line in summary.get("silent_channels", {}).values():
        print(f"error: {line}", file=sys.stderr)
    return 3 if "silent_channels" in summary else 0
