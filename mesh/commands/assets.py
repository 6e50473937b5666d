"""`composer-mesh assets build`: write the tiny offline tokenizer and model checkpoints.
`composer-mesh assets ship-base RECIPE`: train a recipe's warm-started base on the pinned kernels and ship it with
the package (`titan_ext/data/bases/`), so that later runs copy it, checked by digest, instead of training it."""

from __future__ import annotations

import argparse
import sys
import tempfile
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
    ship = sub.add_parser("ship-base", help="Train a recipe's warm-started base on the pinned kernels (never from a "
                          "shipped copy) and write it with its card to titan_ext/data/bases/<job name>.*.")
    ship.add_argument("recipe", help="TOML recipe whose base to ship (e.g. configs/coding_cpu.toml).")
    ship.add_argument("overrides", nargs="*", help="Overrides (--section.key=value), as `train` takes them.")


def run(args: argparse.Namespace) -> int:
    if args.action == "ship-base":
        return _ship_base(args.recipe, args.overrides)
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


def _ship_base(recipe: str, overrides: list[str]) -> int:
    # lazy: start-up time (as above)
    from composer_mesh.configs.loader import load_config
    from composer_mesh.mesh.launch import warm_start_request
    from composer_mesh.titan_ext.assets import cache_dir_for, hf_dir_for
    from composer_mesh.titan_ext.warmstart import ship_base, warm_start_dir

    job = load_config(recipe, overrides)
    request = warm_start_request(job, str(hf_dir_for(job.model)))
    if request is None:
        print(f"error: {recipe} has no warm start to ship (its task trains from model.hf_path as it is)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    print(f"training {recipe}'s base: {request.config.steps} SFT steps on the pinned kernels ...", flush=True)
    with tempfile.TemporaryDirectory(dir=cache_dir_for(job.model), prefix=".ship-base-") as root:  # never a cached copy
        built = warm_start_dir(request.model, request.conversations, request.config, root, request.tools,
                               shipped=False)
        weights = ship_base(built, job.job.name)
    print(f"shipped {weights} ({time.perf_counter() - start:.0f} s); commit it with {weights.with_suffix('.json').name}")
    return 0
