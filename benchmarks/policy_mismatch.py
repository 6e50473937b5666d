"""Cost of the mismatch-correction modes in the chunked policy channel.

One process, seeded inputs: one packed row of T policy tokens (8 rollouts) at
vocabulary V and hidden size D, on-policy (`old_logprobs_BT=None`, as the
trainer runs), generator logprobs 0.3 nats off. Each mode runs forward +
backward of `compose_loss(policy=...)` on the chunked LM-head path; rounds
alternate the modes and the best step is kept (the box is shared). The
baseline is the default (token TIS); sequence-level modes pay one extra no-grad
chunked pass to score π_old.

    python benchmarks/policy_mismatch.py --quick   # V=32768, D=1024, T=1024, 3 rounds

Prints a table, then one JSON line of CPU-time ratios against the baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer_mesh.configs.sections.loss import LossConfig  # noqa: E402
from composer_mesh.losses.composer import PolicyInputs, compose_loss  # noqa: E402
from composer_mesh.losses.mismatch import packed_sequence_ids  # noqa: E402

MODES = {
    "token_tis (default)": {},
    "token_mask (TRL)": dict(tis_cap=None, rs_level="token", rs_max=3.0, rs_min=0.0),
    "sequence_is": dict(is_level="sequence", tis_cap=5.0),
    "geometric_rs + token_tis": dict(rs_level="geometric", rs_max=2.0),
    "veto + token_tis": dict(rs_veto=1e-4),
}


def build(vocab: int, dim: int, seq: int) -> tuple[torch.Tensor, PolicyInputs]:
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, dim, generator=g) / dim**0.5).requires_grad_()
    positions = torch.arange(seq) % (seq // 8)  # 8 rollouts packed in one row
    inputs = PolicyInputs(
        torch.randn(1, seq, dim, generator=g).requires_grad_(), torch.randint(0, vocab, (1, seq), generator=g),
        torch.ones(1, seq, dtype=torch.bool), torch.randn(1, seq, generator=g), seq,
        gen_logprobs_BT=-torch.rand(1, seq, generator=g) * 5 - 8, seq_ids_BT=packed_sequence_ids(positions[None]),
    )
    return weight, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=1024, 3 rounds (about a minute on 2 cores)")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    if args.quick:
        args.seq, args.rounds = 1024, 3
    torch.set_num_threads(args.threads)
    weight, inputs = build(args.vocab, args.dim, args.seq)
    base = LossConfig()
    best = {name: (float("inf"), float("inf")) for name in MODES}
    for _ in range(args.rounds):
        for name, overrides in MODES.items():
            cfg = dataclasses.replace(base, policy=dataclasses.replace(base.policy, **overrides))
            weight.grad = inputs.hidden_BTD.grad = None
            t0, c0 = time.perf_counter(), time.process_time()
            compose_loss(cfg, weight, policy=inputs).loss.backward()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    base_wall, base_cpu = best["token_tis (default)"]
    print(f"V={args.vocab} D={args.dim} T={args.seq} threads={args.threads} rounds={args.rounds} "
          f"load={os.getloadavg()[0]:.1f}")
    print(f"{'mode':28s} {'wall s':>8s} {'cpu s':>8s} {'cpu ratio':>10s}")
    for name, (wall, cpu) in best.items():
        print(f"{name:28s} {wall:8.3f} {cpu:8.3f} {cpu / base_cpu:10.3f}")
    ratios = {f"cpu_ratio_{n.split(' ')[0]}": round(c / base_cpu, 4) for n, (_, c) in best.items() if n in list(MODES)[1:]}
    print(json.dumps({**ratios, "baseline_cpu_s": round(base_cpu, 4), "baseline_wall_s": round(base_wall, 4)}))


if __name__ == "__main__":
    main()
