"""Peak memory and time of the chunked three-channel loss vs the full-logits version.

Each (variant, V) runs in a fresh subprocess: inputs are built, the peak-RSS
counter is reset (/proc/self/clear_refs, falling back to the post-setup peak),
then forward+backward of `compose_loss` with all three channels active is
measured; peak memory = peak RSS − RSS before the first step. Time = the best
of `--repeats` steps, over `--rounds` rounds that alternate the variants (the
box is shared: the minimum is the least-disturbed measurement); CPU time
(process_time, all threads) is reported next to wall time. Both variants see the same seeded inputs: per channel one
sequence of T tokens at hidden size D (policy; distill student + hinted teacher;
preference chosen + rejected), all tokens valid.

    python benchmarks/loss_memory.py --quick     # V=32768, T=2048
    python benchmarks/loss_memory.py             # adds V=151936 (naive needs ~16 GB at T=2048)

Prints a table, then one JSON line {"peak_mem_ratio": ..., "time_ratio": ...}
(chunked / naive at V=32768, T=2048).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(
    variant: str, vocab: int, seq: int, dim: int, repeats: int, threads: int, budget: float, channels: str
) -> dict:
    import dataclasses

    import torch

    from composer_mesh.configs.sections.loss import LossConfig
    from composer_mesh.losses.composer import DistillInputs, PolicyInputs, PreferenceInputs, compose_loss

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5).requires_grad_()
    hid = lambda: torch.randn(1, seq, dim, generator=gen).requires_grad_()  # noqa: E731
    ids = lambda: torch.randint(0, vocab, (1, seq), generator=gen)  # noqa: E731
    full = torch.ones(1, seq, dtype=torch.bool)
    policy = PolicyInputs(
        hid(), ids(), full, torch.randn(1, generator=gen), seq,
        old_logprobs_BT=-torch.rand(1, seq, generator=gen) * 5 - 8,
        gen_logprobs_BT=-torch.rand(1, seq, generator=gen) * 5 - 8,
    )
    distill = DistillInputs(hid(), torch.randn(1, seq, dim, generator=gen), full, seq)
    preference = PreferenceInputs(
        hid(), ids(), full, hid(), ids(), full, 1,
        ref_chosen_logps_P=torch.tensor([-10.0 * seq]), ref_rejected_logps_P=torch.tensor([-10.0 * seq]),
    )
    cfg = dataclasses.replace(LossConfig(), chunked=variant == "chunked", chunk_budget_mib=budget)
    leaves = [weight, policy.hidden_BTD, distill.hidden_BTD, preference.chosen_hidden_BTD, preference.rejected_hidden_BTD]
    wanted = ("policy", "distill", "preference") if channels == "all" else tuple(channels.split(","))
    inputs = {k: v for k, v in (("policy", policy), ("distill", distill), ("preference", preference)) if k in wanted}

    def step() -> float:
        for t in leaves:
            t.grad = None
        out = compose_loss(cfg, weight, **inputs)
        assert out.active_channels == wanted
        out.loss.backward()
        return float(out.loss.detach())

    # warm up kernels on a slice so the measured step pays no first-call costs
    warm = dataclasses.replace(
        policy, hidden_BTD=policy.hidden_BTD[:, :8], labels_BT=policy.labels_BT[:, :8],
        mask_BT=full[:, :8], old_logprobs_BT=None, gen_logprobs_BT=None, num_tokens=8,
    )
    compose_loss(cfg, weight, policy=warm).loss.backward()
    weight.grad = None
    reset = _reset_peak()
    before = _rss_kib("VmRSS")
    base_peak = _rss_kib("VmHWM")
    times, cpu_times = [], []
    for i in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if i == 0:
            peak = _rss_kib("VmHWM")
    return {
        "variant": variant, "V": vocab, "T": seq, "D": dim, "loss": loss,
        "peak_mib": (peak - (before if reset else base_peak)) / 1024, "time_s": min(times), "cpu_s": min(cpu_times),
        "peak_reset": reset,
    }


def run_case(
    variant: str, vocab: int, seq: int, dim: int, repeats: int, threads: int, budget: float, channels: str
) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--vocab", str(vocab), "--seq", str(seq),
           "--dim", str(dim), "--repeats", str(repeats), "--threads", str(threads), "--budget", str(budget),
           "--channels", channels]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="V=32768 only (about a minute on 2 cores)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per subprocess")
    parser.add_argument("--rounds", type=int, default=0, help="subprocesses per variant (0: 1 quick, 2 full)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--budget", type=float, default=32.0, help="chunk_budget_mib of the chunked variant")
    parser.add_argument("--channels", default="all",
                        help="comma list of policy,distill,preference to time one channel alone (default all)")
    parser.add_argument("--large-vocab-seq", type=int, default=0,
                        help="T for the V=151936 case (0: --seq; the naive variant needs ~16 GB at T=2048)")
    parser.add_argument("--worker", choices=("chunked", "naive"), help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=32768, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(
            args.worker, args.vocab, args.seq, args.dim, args.repeats, args.threads, args.budget, args.channels
        )))
        return

    vocabs = [32768] if args.quick else [32768, 151936]
    rounds = args.rounds or (1 if args.quick else 2)
    rows = []
    for vocab in vocabs:
        runs: dict[str, list[dict]] = {"naive": [], "chunked": []}
        seq = args.seq if vocab == 32768 else (args.large_vocab_seq or args.seq)
        for _ in range(rounds):  # alternate the variants so both see the same background load
            for variant in runs:
                runs[variant].append(
                    run_case(variant, vocab, seq, args.dim, args.repeats, args.threads, args.budget, args.channels)
                )
        for results in runs.values():
            best = dict(results[0])
            for key in ("peak_mib", "time_s", "cpu_s"):
                best[key] = min(r[key] for r in results)
            rows.append(best)
    print(f"{'variant':<8} {'V':>7} {'T':>5} {'D':>5} {'peak MiB':>9} {'wall s':>7} {'cpu s':>7} {'loss':>10}")
    for r in rows:
        print(f"{r['variant']:<8} {r['V']:>7} {r['T']:>5} {r['D']:>5} {r['peak_mib']:>9.1f} "
              f"{r['time_s']:>7.2f} {r['cpu_s']:>7.2f} {r['loss']:>10.5f}")
    figures = {}
    for vocab in vocabs:
        naive, chunked = (next(r for r in rows if r["V"] == vocab and r["variant"] == v) for v in ("naive", "chunked"))
        suffix = "" if vocab == 32768 else f"_v{vocab}"
        figures[f"peak_mem_ratio{suffix}"] = round(chunked["peak_mib"] / naive["peak_mib"], 4)
        figures[f"time_ratio{suffix}"] = round(chunked["time_s"] / naive["time_s"], 4)
        figures[f"cpu_time_ratio{suffix}"] = round(chunked["cpu_s"] / naive["cpu_s"], 4)
        figures[f"naive_peak_mib{suffix}"] = round(naive["peak_mib"], 1)
        figures[f"chunked_peak_mib{suffix}"] = round(chunked["peak_mib"], 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
