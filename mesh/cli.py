"""`composer-mesh` command line: one sub-command per module in `mesh/commands/`.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and
`run(args) -> int`; it imports its heavy dependencies inside `run` so that
`composer-mesh --help` stays fast. `entry` is the program (the console script
and `python -m composer_mesh.mesh.cli`); `main` runs a command inside its
caller's process (tests, notebooks, benchmarks).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn, Sequence

from composer_mesh.mesh.process_exit import exit_without_teardown

# Module names under mesh/commands, in the order `--help` lists them.
COMMANDS: tuple[str, ...] = ("config", "assets", "replay", "serve_teachers", "tasks", "swe_instances", "train", "export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="composer-mesh",
        description="Composer-style RL post-training on Monarch meshes and TorchTitan.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"composer_mesh.mesh.commands.{name}")
        cmd = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


def entry() -> NoReturn:
    """`main` as the process's program: at its exit the modules it imported (a train job's controller holds
    torch, TorchTitan and Monarch) are not torn down one by one (2.1 s of vs_trl's short job); exit
    handlers still run and the exit status is main's."""
    exit_without_teardown()
    sys.exit(main())


if __name__ == "__main__":
    entry()
