"""CLI sub-commands (see mesh/cli.py); shared argument handling lives here."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from composer_mesh.configs.schema import JobConfig


def load_job(args: argparse.Namespace) -> JobConfig | None:
    """`args.config` with `args.overrides` applied; prints the error and returns None if invalid."""
    # lazy: start-up time: the schema (every config section) loads when a command reads a recipe, not for --help
    from composer_mesh.configs.loader import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
