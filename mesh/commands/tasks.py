"""`composer-mesh tasks REPO`: generate (and verify) feature-deletion tasks from a local repository, and list the
candidates refused with their reasons."""

from __future__ import annotations

import argparse
import sys

from composer_mesh.configs.sections.env import FeatureDeletionConfig

NAME = "tasks"
HELP = "Generate verified feature-deletion tasks from a local Python repository; --check grades oracle and no-op."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo", help="path of a local Python repository whose pytest suite passes")
    parser.add_argument("--max-tasks", type=int, default=8, help="tasks to generate (default 8)")
    parser.add_argument("--functions-per-task", type=int, default=1, help="functions deleted per task (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="order in which candidates are tried (default 0)")
    parser.add_argument("--check", action="store_true", help="grade the original code (must be 1) and the stub (0)")


def run(args: argparse.Namespace) -> int:
    # lazy: start-up time: every command module loads to build the CLI; the task generator and sandbox load only here
    from composer_mesh.envs.feature_deletion import TaskStore, generate_tasks
    from composer_mesh.envs.sandbox import Sandbox, SandboxUnavailable

    if args.max_tasks < 1 or not 1 <= args.functions_per_task <= 4:
        print("error: --max-tasks must be >= 1 and --functions-per-task in 1..4", file=sys.stderr)
        return 2
    try:
        sandbox = Sandbox()
    except SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = FeatureDeletionConfig(
        repos=(args.repo,), max_tasks=args.max_tasks, functions_per_task=args.functions_per_task, seed=args.seed
    )
    store = TaskStore(sandbox)
    try:
        try:
            refused: list[tuple[str, str]] = []
            tasks = generate_tasks(args.repo, config, sandbox, store, refused=refused)
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{len(tasks)} verified task(s) from {args.repo}; {len(refused)} refused")
        for name, reason in refused:  # the suite notices their deletion, but no grade of them could be trusted
            print(f"  refused {name}: {reason}")
        failures = 0
        for task in tasks:
            line = f"  {task.target}: {', '.join(task.symbols)}  hidden: {', '.join(task.hidden_tests)}"
            if args.check:
                rewards = [task.grade_source(sandbox, src).reward for src in (task.original_source(), task.stubbed_source)]
                failures += rewards != [1.0, 0.0]
                line += f"  oracle {rewards[0]:.0f} no-op {rewards[1]:.0f}"
            print(line)
        return 1 if failures else 0
    finally:
        store.cleanup()
