"""Bytes on the wire: DiLoCo vs every-step all-reduce, and Streaming DiLoCo's peak per sync.

Two replica groups (threads of this process, each its own model, TCPStore and
torchft Manager under one in-process lighthouse) train the tiny LM task
(`tests/titan_ext/diloco_lm.py`) for the same inner steps under three methods:

- DDP: every step, every gradient all-reduced through the torchft Manager
  (what torchft's DDP does), optimizer step on commit;
- DiLoCo, H inner steps: one pseudo-gradient all-reduce per H steps;
- Streaming DiLoCo, same H, `--fragments` fragments (delay τ = 1): one
  fragment per H / fragments steps.

Bytes are counted at the process group: every tensor handed to
`CountingProcessGroupGloo.allreduce` (payload bytes; gloo's ring moves about
2(n−1)/n of that per rank), never computed from a formula.

    python benchmarks/diloco.py --quick      # H = 8, 2 outer rounds
    python benchmarks/diloco.py              # H = 8, 6 outer rounds

Prints a table, then one JSON line {"bytes_ratio_vs_ddp": ..., "streaming_peak_ratio": ...}:
DiLoCo bytes per inner step / DDP bytes per step (≈ 1/H), and Streaming's
largest single sync / plain DiLoCo's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from composer_mesh.configs.sections.diloco import DiLoCoConfig
from composer_mesh.titan_ext.diloco import CountingProcessGroupGloo, build_manager

# The tiny LM task is a test helper shared with the DiLoCo tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "titan_ext"))
from diloco_lm import LMTaskConfig, heldout_loss, lm_loss, run_diloco_threads, run_in_threads, train_batch  # noqa: E402


class _DDPMember:
    """One replica of the every-step all-reduce baseline: a Manager over a counting gloo group."""

    def __init__(self, cfg: DiLoCoConfig, model: torch.nn.Module, assignment: Any, port: int) -> None:
        self.pg = CountingProcessGroupGloo()
        self.model = model
        self.manager = build_manager(cfg, self.pg, assignment, model.load_state_dict, model.state_dict,
                                     store_addr="127.0.0.1", store_port=port)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def run_ddp(task: LMTaskConfig, cfg: DiLoCoConfig, steps: int) -> tuple[list[torch.nn.Module], list[dict]]:
    def body(index: int, member: _DDPMember, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        for step in range(steps):
            member.manager.start_quorum()
            optimizer.zero_grad(set_to_none=True)
            lm_loss(model, train_batch(task, index, step)).backward()
            works = [member.manager.allreduce(p.grad) for p in model.parameters()]
            for w in works:
                w.wait()
            if member.manager.should_commit():
                optimizer.step()
        return {"bytes_sent": member.pg.bytes_sent, "sync_bytes": [member.pg.bytes_sent // steps] * steps}

    return run_in_threads(task, cfg, 2, lambda m, o, a, port: _DDPMember(cfg, m, a, port), body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 outer rounds (1-2 minutes on 2 cores)")
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--fragments", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    H, rounds = args.inner_steps, (2 if args.quick else 6)
    steps = H * rounds
    task = LMTaskConfig()
    base = DiLoCoConfig(inner_steps=H, replica_groups=2, min_replicas=2, timeout_s=60, quorum_timeout_s=120)
    streaming = DiLoCoConfig(inner_steps=H, replica_groups=2, min_replicas=2, fragments=args.fragments,
                             fragment_delay=1, timeout_s=60, quorum_timeout_s=120)
    rows = []
    for name, run in (
        ("ddp (every step)", lambda: run_ddp(task, base, steps)),
        (f"diloco H={H}", lambda: run_diloco_threads(task, base, 2, rounds)),
        (f"streaming H={H} F={args.fragments} tau=1", lambda: run_diloco_threads(task, streaming, 2, rounds * args.fragments)),
    ):
        start = time.perf_counter()
        models, statuses = run()
        seconds = time.perf_counter() - start
        s = statuses[0]
        rows.append(dict(name=name, syncs=len(s["sync_bytes"]), bytes=s["bytes_sent"], per_step=s["bytes_sent"] / steps,
                         peak=max(s["sync_bytes"]), loss=heldout_loss(models[0], task), seconds=seconds))
    print(f"{'method':<28}{'syncs':>6}{'bytes sent':>14}{'bytes/inner step':>18}{'peak bytes/sync':>17}"
          f"{'held-out loss':>15}{'wall s':>8}")
    for r in rows:
        print(f"{r['name']:<28}{r['syncs']:>6}{r['bytes']:>14,}{r['per_step']:>18,.0f}{r['peak']:>17,}"
              f"{r['loss']:>15.3f}{r['seconds']:>8.1f}")
    print(f"(2 replicas, {steps} inner steps each, bytes per replica at its torchft process group)")
    ddp, diloco, stream = rows
    print(json.dumps({
        "bytes_ratio_vs_ddp": diloco["per_step"] / ddp["per_step"],
        "streaming_peak_ratio": stream["peak"] / diloco["peak"],
        "inner_steps": H,
    }))


if __name__ == "__main__":
    main()
