"""`composer-mesh assets build`: write the tiny offline tokenizer and model checkpoints."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

NAME = "assets"
HELP = "Build the tiny offline assets (tokenizer, dense and MoE checkpoints) into a cache directory."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="Build (or reuse, when up to date) the assets for one seed.")
    build.add_argument(
        "--cache-dir",
        default=None,
        help="Cache directory (default: $COMPOSER_MESH_CACHE/assets, else ~/.cache/composer-mesh/assets).",
    )
    build.add_argument("--seed", type=int, default=0, help="Seed of the model weights (default 0).")


def run(args: argparse.Namespace) -> int:
    # lazy: start-up time: every command module loads to build the CLI; TorchTitan and transformers load only here
    from composer_mesh.titan_ext.assets import build_assets, default_cache_dir

    if args.seed < 0:
        print(f"error: --seed must be >= 0, got {args.seed}", file=sys.stderr)
        return 2
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    start = time.perf_counter()
    paths = build_assets(cache_dir, seed=args.seed)
    print(f"assets (seed {args.seed}) ready in {time.perf_counter() - start:.1f} s under {paths.root}")
    for label, path in (("tokenizer", paths.tokenizer_dir), ("dense", paths.dense_dir), ("moe", paths.moe_dir)):
        files = ", ".join(sorted(p.name for p in path.iterdir()))
        print(f"  {label:<9} {path}  [{files}]")
    return 0
