"""Held-out loss: DiLoCo (2 replicas, H = 8) vs synchronous data parallel at the same tokens, per outer setting.

The tiny LM task of `tests/titan_ext/diloco_lm.py` (the convergence test's task): both
methods see the same training rows (DiLoCo replica r at inner step s trains on
rows (r, s); the DDP baseline's step s on their union), the baseline is
measured in the same run for each inner learning rate. Replicas are threads
under a real in-process torchft lighthouse, torch threads = 1.

    python benchmarks/diloco_convergence.py --quick   # 80 inner steps per replica, 5 outer settings
    python benchmarks/diloco_convergence.py           # plus the 160-step row

Prints the table of docs/diloco.md, then one JSON line
{"ratio_<inner lr>_<outer lr>_<momentum>[_<steps>]": DiLoCo loss / DDP loss, ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from composer_mesh.configs.sections.diloco import DiLoCoConfig

# The tiny LM task is a test helper shared with the DiLoCo tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "titan_ext"))
from diloco_lm import LMTaskConfig, heldout_loss, run_ddp, run_diloco_threads  # noqa: E402

H = 8
SETTINGS = [  # (inner lr, outer lr, outer momentum, inner steps per replica)
    (3e-3, 0.7, 0.9, 80),  # the paper's defaults (made for H ≈ 500)
    (3e-3, 1.0, 0.0, 80),  # plain averaging
    (1e-3, 0.7, 0.5, 80),
    (1e-3, 0.5, 0.8, 80),
    (1e-3, 0.8, 0.6, 80),  # the convergence test's setting
]
LONG = (1e-3, 0.7, 0.5, 160)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="80-step rows only (1-2 minutes on 2 quiet cores)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = SETTINGS if args.quick else [*SETTINGS, LONG]
    ddp: dict[tuple[float, int], float] = {}  # (inner lr, steps) -> DDP held-out loss
    rows, figures = [], {}
    start = time.perf_counter()
    for inner_lr, outer_lr, mu, steps in settings:
        task = LMTaskConfig(lr=inner_lr)
        if (inner_lr, steps) not in ddp:
            ddp[(inner_lr, steps)] = heldout_loss(run_ddp(task, 2, steps), task)
        cfg = DiLoCoConfig(inner_steps=H, replica_groups=2, min_replicas=2, outer_lr=outer_lr, outer_momentum=mu,
                           nesterov=True, timeout_s=60, quorum_timeout_s=120)
        models, _ = run_diloco_threads(task, cfg, 2, steps // H)
        loss, base = heldout_loss(models[0], task), ddp[(inner_lr, steps)]
        rows.append((inner_lr, outer_lr, mu, steps, loss, base))
        key = f"ratio_{inner_lr:g}_{outer_lr:g}_{mu:g}" + ("" if steps == 80 else f"_{steps}")
        figures[key] = round(loss / base, 4)
    print(f"{'inner lr':>9}{'outer lr / mu':>15}{'steps':>7}{'DiLoCo':>9}{'DDP':>9}{'ratio':>8}")
    for inner_lr, outer_lr, mu, steps, loss, base in rows:
        print(f"{inner_lr:>9g}{f'{outer_lr:g} / {mu:g}':>15}{steps:>7}{loss:>9.3f}{base:>9.3f}{loss / base:>8.3f}")
    print(f"(2 replicas, H = {H}, held-out loss of the tiny LM task; {time.perf_counter() - start:.1f} s wall)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
