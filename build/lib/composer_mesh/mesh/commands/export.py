"""`composer-mesh export RUN_DIR [--step N] OUT`: a run's checkpoint as a servable HF directory."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

NAME = "export"
HELP = "Export a training run's checkpoint as an HF directory that transformers loads and `vllm serve` runs."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run directory (<job.output_dir>/<job.name>)")
    parser.add_argument("out", help="output directory (must not exist, or be empty)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="cast the weights (default: the trained dtype)")


def run(args: argparse.Namespace) -> int:
    # lazy: start-up time: every command module loads to build the CLI; torch and TorchTitan load only here
    import torch
    from composer_mesh.titan_ext.hf.export import export_run

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: {out} exists and is not an empty directory; choose a new OUT", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        path, step = export_run(args.run_dir, out, args.step, getattr(torch, args.dtype) if args.dtype else None)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    files = ", ".join(sorted(p.name for p in path.iterdir()))
    print(f"exported step {step} of {args.run_dir} to {path} in {time.perf_counter() - start:.1f} s  [{files}]")
    return 0
