"""`composer-mesh config`: show a resolved recipe, list recipes, print the reference."""

from __future__ import annotations

import argparse
import sys

from composer_mesh.mesh.commands import load_job

NAME = "config"
HELP = "Show resolved configs, list shipped recipes, print the configuration reference."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="Print the resolved config (base < file < overrides) as TOML.")
    show.add_argument("config", help="Recipe file (a path, or the name of a recipe shipped in configs/).")
    show.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value ...")
    sub.add_parser("list", help="List the recipes shipped in configs/.")
    sub.add_parser("reference", help="Print the configuration reference (Markdown) generated from the schema.")


def run(args: argparse.Namespace) -> int:
    # lazy: start-up time: every command module loads to build the CLI; the schema loads only here
    from composer_mesh.configs.loader import dump_config, list_recipes
    from composer_mesh.configs.reference import render_reference

    if args.action == "list":
        print("\n".join(list_recipes()))
        return 0
    if args.action == "reference":
        sys.stdout.write(render_reference())
        return 0
    cfg = load_job(args)
    if cfg is None:
        return 2
    sys.stdout.write(dump_config(cfg))
    return 0
