"""Step time of sharded Muon vs `torch.optim.Muon` on the same FSDP2-style DTensor params, and NS time per dtype.

Two gloo ranks on this host; every matrix of a small transformer stack is a
DTensor sharded on dim 0 (what `fully_shard` produces). `torch.optim.Muon`
accepts such params but runs each Newton–Schulz matmul as a DTensor op
(collectives every iteration); `ShardedMuon` moves each matrix to one owner
rank, orthogonalises it there and sends the slices back (two all_to_all per
step). Both run NS in bfloat16 with torch's kernels for the headline ratio
(torch's Muon always does); ours with the default `ns_kernel = "auto"`
(fp32 iterations between bf16 ends on a CPU without bf16 units), in float32, and
AdamW are shown for scale. First, one process times Newton–Schulz alone on the
stack's matrix shapes: float32, bfloat16 with the auto kernel, bfloat16 with
the emulated kernel (every result rounded to bf16), bfloat16 with torch's
kernels. The last line is JSON.

    python benchmarks/muon.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from composer_mesh.titan_ext.muon import ShardedMuon, resolve_ns_kernel, zeropower_via_newtonschulz

LR, WD = 0.02, 0.1


def _shapes(dim: int, ffn: int, layers: int) -> list[tuple[int, int]]:
    per_layer = [(dim, dim)] * 4 + [(ffn, dim), (dim, ffn), (ffn, dim)]  # q k v o, w1 w2 w3
    return per_layer * layers


def _params(shapes, mesh) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen) / s[1] ** 0.5, mesh, [Shard(0)]))
            for s in shapes]


def _time_interleaved(makers: dict, shapes, mesh, steps: int, warmup: int) -> tuple[dict, dict]:
    """Median step seconds per optimizer (max over ranks), stepping them in turn so load noise hits all alike.

    Each optimizer has its own copy of the params and sees the same gradients.
    """
    params = {name: _params(shapes, mesh) for name in makers}
    opts = {name: make(params[name]) for name, make in makers.items()}
    times: dict[str, list[float]] = {name: [] for name in makers}
    for step in range(warmup + steps):
        gen = torch.Generator().manual_seed(1000 + step)
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for name, opt in opts.items():
            for p, g in zip(params[name], grads):
                p.grad = distribute_tensor(g, mesh, [Shard(0)])
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            elapsed = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= warmup:
                times[name].append(elapsed.item())
    return {name: statistics.median(t) for name, t in times.items()}, params


def _time_ns(shapes: list[tuple[int, int]], reps: int) -> tuple[dict, dict, dict]:
    """Newton–Schulz alone on one thread, over every matrix of the stack, variant after variant per round.

    Each variant gets the update as `ShardedMuon` hands it over: in its NS dtype (the momentum pass
    writes a bf16 update directly), and returns its result in that dtype.

    Returns the median seconds per (variant, distinct shape), the median seconds
    of the whole stack per variant, and per variant the median over rounds of
    its stack time / fp32's in the same round (paired, so load drift cancels;
    the order of variants alternates between rounds).
    """
    torch.set_num_threads(1)
    variants = {"fp32": dict(dtype=torch.float32), "bf16 auto": dict(dtype=torch.bfloat16, kernel="auto"),
                "bf16 emulated": dict(dtype=torch.bfloat16, kernel="emulated"),
                "bf16 native": dict(dtype=torch.bfloat16, kernel="native")}
    gen = torch.Generator().manual_seed(0)
    updates = [torch.randn(s, generator=gen) for s in shapes]
    handed = {v: [u.to(kw["dtype"]) for u in updates] for v, kw in variants.items()}
    per_shape: dict[str, dict[tuple[int, int], list[float]]] = {v: {s: [] for s in shapes} for v in variants}
    stack: dict[str, list[float]] = {v: [] for v in variants}
    # round 0 warms kernels and the allocator up and is not counted
    for rnd in range(reps + 1):
        for v in (list(variants) if rnd % 2 else list(variants)[::-1]):
            total = 0.0
            for u in handed[v]:
                t0 = time.perf_counter()
                zeropower_via_newtonschulz(u, **variants[v])
                elapsed = time.perf_counter() - t0
                total += elapsed
                if rnd:
                    per_shape[v][tuple(u.shape)].append(elapsed)
            if rnd:
                stack[v].append(total)
    ratio = {v: statistics.median(t / f for t, f in zip(stack[v], stack["fp32"])) for v in variants}
    return ({v: {s: statistics.median(t) for s, t in per.items()} for v, per in per_shape.items()},
            {v: statistics.median(t) for v, t in stack.items()}, ratio)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    shapes = _shapes(args.dim, args.ffn, args.layers)
    muon_kw = dict(lr=LR, weight_decay=WD, momentum=0.95, nesterov=True, lr_adjust="original")
    runs = {
        "torch.optim.Muon (bf16 NS)": lambda ps: torch.optim.Muon(ps, lr=LR, weight_decay=WD, momentum=0.95),
        "ShardedMuon (bf16 NS, native)": lambda ps: ShardedMuon([dict(params=ps, ns_dtype="bfloat16",
                                                                      ns_kernel="native", **muon_kw)]),
        "ShardedMuon (bf16 NS, auto)": lambda ps: ShardedMuon([dict(params=ps, ns_dtype="bfloat16", **muon_kw)]),
        "ShardedMuon (fp32 NS)": lambda ps: ShardedMuon([dict(params=ps, ns_dtype="float32", **muon_kw)]),
        "torch.optim.AdamW": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD),
    }
    results, finals = _time_interleaved(runs, shapes, mesh, args.steps, args.warmup)
    # Same semantics and kernels: the bf16 runs should agree up to bf16 rounding of the orthogonalised update.
    diff = max((a.detach().full_tensor() - b.detach().full_tensor()).abs().max().item()
               for a, b in zip(finals["torch.optim.Muon (bf16 NS)"], finals["ShardedMuon (bf16 NS, native)"]))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"times": results, "max_abs_diff": diff}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small stack, few steps (about a minute on 2 cores)")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    args.dim, args.ffn, args.layers, args.steps, args.warmup = (
        (256, 704, 2, 7, 1) if args.quick else (512, 1408, 4, 10, 2)
    )
    shapes = _shapes(args.dim, args.ffn, args.layers)
    kernel = resolve_ns_kernel("auto", torch.bfloat16, torch.device("cpu"))
    reps = 15 if args.quick else 21
    ns, ns_step, ns_ratio = _time_ns(shapes, reps)
    print(f"Newton–Schulz alone, 1 thread, median of {reps} rounds; bf16 auto kernel here: {kernel}")
    print(f"{'shape':<14}{'count':>6}" + "".join(f"{v + ' ms':>18}" for v in ns) + f"{'auto / fp32':>13}")
    for s in dict.fromkeys(shapes):
        print(f"{str(s):<14}{shapes.count(s):>6}" + "".join(f"{per[s] * 1e3:>18.1f}" for per in ns.values())
              + f"{ns['bf16 auto'][s] / ns['fp32'][s]:>13.3f}")
    print(f"{'all (a step)':<14}{len(shapes):>6}" + "".join(f"{t * 1e3:>18.1f}" for t in ns_step.values())
          + f"{ns_ratio['bf16 auto']:>13.3f}   (ratio: median of per-round ratios)\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = f"/tmp/muon_bench_{os.getpid()}.json"
    mp.spawn(_worker, args=(args.ranks, port, args, out_path), nprocs=args.ranks, join=True)
    with open(out_path) as f:
        res = json.load(f)
    os.remove(out_path)
    times = res["times"]
    base = times["torch.optim.Muon (bf16 NS)"]
    n_mat = 7 * args.layers
    print(f"{args.ranks} gloo ranks, {n_mat} matrices (dim {args.dim}, ffn {args.ffn}), "
          f"median of {args.steps} steps")
    print(f"{'optimizer':<34}{'step ms':>10}{'vs torch Muon':>15}")
    for name, t in times.items():
        print(f"{name:<34}{t * 1e3:>10.1f}{t / base:>15.3f}")
    print(f"max |θ_torch − θ_ours| after {args.steps + args.warmup} steps (bf16 NS, torch's kernels both): "
          f"{res['max_abs_diff']:.2e}")
    print(json.dumps({
        "ns_fp32_ms": round(ns_step["fp32"] * 1e3, 2),
        "ns_bf16_ms": round(ns_step["bf16 auto"] * 1e3, 2),
        "ns_bf16_vs_fp32_ratio": round(ns_ratio["bf16 auto"], 4),
        "ns_bf16_emulated_vs_fp32_ratio": round(ns_ratio["bf16 emulated"], 4),
        "ns_bf16_native_ms": round(ns_step["bf16 native"] * 1e3, 2),
        "ns_bf16_native_vs_fp32_ratio": round(ns_ratio["bf16 native"], 4),
        "ns_bf16_kernel": kernel,
        "muon_time_ratio": round(times["ShardedMuon (bf16 NS, native)"] / base, 4),
        "muon_auto_time_ratio": round(times["ShardedMuon (bf16 NS, auto)"] / base, 4),
        "muon_fp32_time_ratio": round(times["ShardedMuon (fp32 NS)"] / base, 4),
        "muon_vs_adamw_ratio": round(times["ShardedMuon (bf16 NS, auto)"] / times["torch.optim.AdamW"], 4),
        "max_abs_diff_vs_torch": res["max_abs_diff"],
        "ranks": args.ranks,
    }))


if __name__ == "__main__":
    main()
