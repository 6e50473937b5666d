"""Sharded Muon over real gloo process groups equals single-process full-matrix Muon.

Each test spawns 2 or 4 processes (torch.multiprocessing, gloo on loopback).
Parameters are real DTensors: FSDP2 `fully_shard` modules with a real
forward/backward, stacked experts `distribute_tensor(..., [Shard(0)])` on an EP
mesh, HSDP and 2-D sharded matrices. Every rank also runs the reference — the
published Muon update (`test_muon_reference.ref_muon_step`) on full fp32
matrices — on the same gradients (`grad.full_tensor()`), and compares after 3 steps at 1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torchtitan.distributed.flex_shard import Owned

from test_muon_reference import ref_muon_step  # the in-test formula, shared
from composer_mesh.configs.sections.optimizer import OptimizerConfig
from composer_mesh.titan_ext.muon import ShardedMuon
from composer_mesh.titan_ext.optimizer import _dist_muon_applicable, _dist_muon_layout, build_optimizer, split_muon_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LR, WD, MU = 0.02, 0.1, 0.95


# --- process harness ------------------------------------------------------------------------------

def _entry(rank: int, world: int, port: int, fn_name: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        globals()[fn_name](rank, world)
    finally:
        dist.destroy_process_group()


def spawn(fn_name: str, world: int, port: int) -> None:
    """Run `fn_name(rank, world)` on `world` gloo ranks meeting at loopback `port`; a child's exception fails the test.

    Children come from a forkserver that has torch and the code under test
    imported once (a plain spawn re-imports torch per child, ~10 s each on a
    busy 2-core box) and, unlike fork, holds no threads of the test process.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.fsdp", "composer_mesh.titan_ext.muon", __name__])
    mp.start_processes(_entry, args=(world, port, fn_name), nprocs=world, join=True,
                       start_method="forkserver")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class ReferenceRun:
    """Full-matrix copies of the params, stepped by the in-test formulas (Muon) and torch AdamW."""

    def __init__(self, muon_params, adamw_params, *, nesterov=True, lr_adjust="match_rms_adamw"):
        self.muon = [(p, _full(p).detach().clone()) for p in muon_params]
        self.bufs = [torch.zeros_like(w) for _, w in self.muon]
        self.adamw_pairs = [(p, _full(p).detach().clone().requires_grad_()) for p in adamw_params]
        self.adamw = torch.optim.AdamW([w for _, w in self.adamw_pairs], lr=LR, betas=(0.9, 0.95), eps=1e-8,
                                       weight_decay=WD) if adamw_params else None
        self.nesterov, self.lr_adjust = nesterov, lr_adjust

    def step(self) -> None:
        for (p, w), buf in zip(self.muon, self.bufs):
            ref_muon_step(w, _full(p.grad), buf, lr=LR, wd=WD, mu=MU, nesterov=self.nesterov, lr_adjust=self.lr_adjust)
        for p, w in self.adamw_pairs:
            w.grad = _full(p.grad).clone()
        if self.adamw:
            self.adamw.step()

    def assert_close(self, tag: str) -> None:
        for i, (p, w) in enumerate(self.muon + self.adamw_pairs):
            got = _full(p.detach())
            err = (got - w.detach()).abs().max().item()
            assert err <= 1e-5, f"{tag}: param {i} {tuple(w.shape)} max abs err {err:.2e}"


def _muon_group(params, **muon_kwargs) -> list[dict]:
    return [dict(params=list(params), lr=LR, weight_decay=WD, momentum=MU, **{"ns_dtype": "float32", **muon_kwargs})]


def _gather_stats(opt: ShardedMuon, world: int) -> list[tuple[int, int, int]]:
    mine = torch.tensor([opt.stats.orthogonalized, opt.stats.orthogonalized_numel, opt.stats.collectives])
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [tuple(int(v) for v in t) for t in out]


# --- 2 ranks: FSDP2 (real backward) + EP experts + AdamW, then a state_dict round trip ------------

class Toy(nn.Module):
    """Embedding → Linear(7) → Linear(12) → RMSNorm → lm_head; odd sizes so shards are uneven."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.l1 = nn.Linear(16, 7)
        self.l2 = nn.Linear(7, 12, bias=False)
        self.l3 = nn.Linear(12, 1, bias=False)  # one row: rank 1's shard is empty
        self.norm = nn.RMSNorm(12)
        self.lm_head = nn.Linear(12, 11, bias=False)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.l2(torch.tanh(self.l1(self.embed(tokens_BT)))))
        return self.lm_head(h).logsumexp(-1).mean() + self.l3(h).pow(2).mean()


def _fsdp_ep_case(rank: int, world: int) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = Toy()
    for sub in (model.l1, model.l2, model.l3, model.lm_head):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    experts = [  # [E, m, n]: E=3 splits 2/1 (whole matrices local); the second is sharded on dim 1 (owner path)
        nn.Parameter(distribute_tensor(torch.randn(3, 6, 4), ep_mesh, [Shard(0)])),
        nn.Parameter(distribute_tensor(torch.randn(2, 9, 5), ep_mesh, [Shard(1)])),
    ]
    model.register_parameter("expert_a", experts[0])  # so DCP can name them
    model.register_parameter("expert_b", experts[1])
    muon_params = [model.l1.weight, model.l2.weight, model.l3.weight, *experts]
    adamw_params = [model.embed.weight, model.l1.bias, model.norm.weight, model.lm_head.weight]
    for p in muon_params:
        assert isinstance(p, DTensor), type(p)
    # The layouts the CUDA path would hand TorchTitan's DistMuon (it cannot run on CPU).
    layouts = [_dist_muon_layout(p) for p in muon_params]
    assert [type(layouts[0].shardings_by_mesh_axis["fsdp"]), dict(layouts[3].shardings_by_mesh_axis)] == [
        Owned, {"ep": Shard(0)}], layouts
    assert layouts[4] is None and not _dist_muon_applicable(muon_params)  # dim-1 experts; and CPU tensors
    # The builder picks the same split on the FSDP-wrapped model and configures both groups from [optimizer].
    cfg = OptimizerConfig(lr=LR, adamw_lr=LR, weight_decay=WD, momentum=MU, ns_dtype="float32")
    muon_named, adamw_named = split_muon_params(model, cfg.adamw_patterns)
    assert {id(p) for _, p in muon_named} == {id(p) for p in muon_params}
    assert {id(p) for _, p in adamw_named} == {id(p) for p in adamw_params}
    ref = ReferenceRun(muon_params, adamw_params)
    opt = build_optimizer(model, cfg)

    def one_step(step: int) -> None:
        gen = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randint(0, 11, (4, 5), generator=gen)).backward()
        for e in experts:
            e.grad = distribute_tensor(torch.randn(e.shape, generator=torch.Generator().manual_seed(step)),
                                       e.device_mesh, e.placements)
        ref.step()
        opt.step()
        opt.zero_grad()

    for step in range(2):
        one_step(step)
    # DCP state-dict round trip into a fresh optimizer mid-run (DTensor momentum / Adam moments).
    saved = get_optimizer_state_dict(model, opt)
    assert "l1.weight" in saved["state"] and "expert_b" in saved["state"], sorted(saved["state"])
    opt = build_optimizer(model, cfg)
    set_optimizer_state_dict(model, opt, saved)
    one_step(2)
    ref.assert_close(f"rank {rank} FSDP+EP")

    # Each matrix orthogonalised exactly once across ranks; 2 collectives (one exchange) per rank.
    stats = _gather_stats(opt, world)
    n_matrices = 3 + 3 + 2  # l1, l2, l3 + 3 local experts + 2 gathered experts
    assert sum(s[0] for s in stats) == n_matrices, stats
    assert all(s[2] == 2 for s in stats), stats

    # bfloat16 AdamW moments on the FSDP shards: kept as bf16 DTensors like their params, through a DCP round trip
    cfg16 = OptimizerConfig(lr=LR, adamw_lr=LR, weight_decay=WD, momentum=MU, ns_dtype="float32",
                            moments_dtype="bfloat16")
    opt = build_optimizer(model, cfg16)
    before = [p.detach().full_tensor().clone() for p in adamw_params]
    one_step(3)
    assert all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, adamw_params))
    for p in adamw_params:
        for key in ("exp_avg", "exp_avg_sq"):
            m = opt.state[p][key]
            assert isinstance(m, DTensor) and m.dtype == torch.bfloat16 and m.placements == p.placements, key
    saved = get_optimizer_state_dict(model, opt)
    opt = build_optimizer(model, cfg16)
    set_optimizer_state_dict(model, opt, saved)
    assert all(opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16 for p in adamw_params)
    one_step(4)


def test_sharded_muon_fsdp_and_ep_match_full_matrix_reference_on_2_ranks(free_port):
    spawn("_fsdp_ep_case", 2, free_port())


# --- 4 ranks: FSDP over 4 (empty shards), HSDP 2x2, EP over 4 with an empty rank, 2-D sharding ----

def _four_rank_case(rank: int, world: int) -> None:
    torch.manual_seed(1)
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ep_fsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
    specs = [  # (full shape, mesh, placements)
        ((3, 8), flat, [Shard(0)]),  # shards 1/1/1/0
        ((10, 6), flat, [Shard(0)]),
        ((5, 13), flat, [Shard(1)]),
        ((9, 7), hsdp, [Replicate(), Shard(0)]),
        ((12, 12), hsdp, [Replicate(), Shard(0)]),
        ((3, 6, 5), flat, [Shard(0)]),  # EP: rank 3 holds no expert
        ((8, 6), hsdp, [Shard(0), Shard(1)]),  # 2-D sharded: the gather fallback
        ((3, 10, 6), ep_fsdp, [Shard(0), Shard(1)]),  # experts 2/1 over EP, rows 5/5 over efsdp
    ]
    params = [nn.Parameter(distribute_tensor(torch.randn(shape), mesh, pl)) for shape, mesh, pl in specs]
    stats = []
    # Default buckets (one exchange round per group), then 500-byte buckets (several rounds, pipelined).
    for nesterov, lr_adjust, bucket_bytes in ((True, "match_rms_adamw", 2**29), (False, "original", 500)):
        ref = ReferenceRun(params, [], nesterov=nesterov, lr_adjust=lr_adjust)
        opt = ShardedMuon(_muon_group(params, nesterov=nesterov, lr_adjust=lr_adjust), bucket_bytes=bucket_bytes)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), p.device_mesh, p.placements)
            ref.step()
            opt.step()
        ref.assert_close(f"rank {rank} nesterov={nesterov} {lr_adjust} bucket={bucket_bytes}")
        stats.append(_gather_stats(opt, world))

    # NS work per rank (numel), owners greedy by size with the load carried across rounds:
    # local experts 30 on ranks 0-2 and the 2-D fallback (48) on every rank in both runs;
    # EP×FSDP experts: each efsdp group's slab ([2, 10, 6] on EP rank 0, [1, 10, 6] on EP rank 1) → efsdp rank 0.
    # One round per group: flat (65, 60, 24) → ranks 0, 1, 2; HSDP shard group (144, 63) → shard ranks 0, 1
    # (global r % 2). Collectives: 2 all_to_all per round (flat, HSDP shard, efsdp) + 1 full_tensor.
    common = [30 + 48 + 120, 30 + 48, 30 + 48 + 60, 48]
    assert [s[1] for s in stats[0]] == [c + w for c, w in zip(common, [65 + 144, 60 + 63, 24 + 144, 63])], stats
    assert all(s[2] == 2 + 2 + 2 + 1 for s in stats[0]), stats
    # 500-byte rounds: flat [24, 60] then [65] (60 → r0, 24 → r1, then 65 → r2, the least loaded);
    # HSDP [63] then [144] (63 → shard rank 0, 144 → shard rank 1); 2 + 2 + 1 rounds.
    assert [s[1] for s in stats[1]] == [c + w for c, w in zip(common, [60 + 63, 24 + 144, 65 + 63, 144])], stats
    assert all(s[2] == 2 * 5 + 1 for s in stats[1]), stats

    # bf16 Newton–Schulz with torch's kernels: the 2-D matrices (FSDP, uneven HSDP, 2-D sharded) end bit for
    # bit where torch.optim.Muon leaves full copies of them, and the update crosses the exchange in bf16.
    matrices = [nn.Parameter(distribute_tensor(torch.randn(shape, generator=torch.Generator().manual_seed(7 + i)),
                                               mesh, pl))
                for i, (shape, mesh, pl) in enumerate(specs) if len(shape) == 2]
    full = [nn.Parameter(_full(p).detach().clone()) for p in matrices]
    theirs = torch.optim.Muon(full, lr=LR, weight_decay=WD, momentum=MU)
    ours = ShardedMuon(_muon_group(matrices, ns_dtype="bfloat16", ns_kernel="native", lr_adjust="original"))
    for step in range(2):
        gen = torch.Generator().manual_seed(50 + step)
        for p, w in zip(matrices, full):
            w.grad = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(w.grad, p.device_mesh, p.placements)
        theirs.step()
        ours.step()
    for p, w in zip(matrices, full):
        assert torch.equal(_full(p.detach()), w.detach()), (rank, tuple(w.shape), p.placements)
    assert ours.stats.comm_bytes == 2 * ours.stats.comm_numel > 0, ours.stats


def test_sharded_muon_hsdp_uneven_and_2d_sharded_match_reference_on_4_ranks(free_port):
    spawn("_four_rank_case", 4, free_port())
