"""Single-process Muon semantics: the published formula, torch.optim.Muon, AdamW, the builder.

`ref_muon_step` below is the reference every Muon test compares with (the
distributed tests import it): Keller Jordan's Muon with Nesterov momentum in
EMA form, quintic Newton–Schulz (3.4445, −4.7750, 2.0315) on the
Frobenius-normalised update, decoupled weight decay and the per-matrix LR
scale — √max(1, m/n) (original) or 0.2·√max(m, n) (Moonlight RMS matching).
Written plainly, one matrix at a time, with no code from `titan_ext.muon`.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from composer_mesh.configs.loader import ConfigError, load_config
from composer_mesh.configs.sections.optimizer import OptimizerConfig
from composer_mesh.titan_ext.muon import (
    ShardedMuon,
    assign_owners,
    cpu_has_bf16_matmul,
    resolve_ns_kernel,
    zeropower_via_newtonschulz,
)
from composer_mesh.titan_ext.optimizer import ChainedOptimizer, build_lr_scheduler, build_optimizer, split_muon_params

A, B, C = 3.4445, -4.7750, 2.0315


def ref_orthogonalize(u_MN: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """X ← aX + (bA + cA²)X, A = XXᵀ, on X = U/‖U‖_F in the wide orientation."""
    x = u_MN.T if u_MN.shape[0] > u_MN.shape[1] else u_MN
    x = x / max(x.norm().item(), eps)
    for _ in range(steps):
        a_mat = x @ x.T
        x = A * x + (B * a_mat + C * (a_mat @ a_mat)) @ x
    return x.T if u_MN.shape[0] > u_MN.shape[1] else x


def ref_orthogonalize_bf16(u_MN: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """`ref_orthogonalize` with bf16 operands and results: each operation exact (float64), then rounded to bf16."""
    def rnd(t):
        return t.to(torch.bfloat16).double()

    x = rnd((u_MN.T if u_MN.shape[0] > u_MN.shape[1] else u_MN).double())
    x = rnd(x / rnd(x.norm().clamp(min=eps)))
    for _ in range(steps):
        a_mat = rnd(x @ x.T)
        x = rnd(A * x + rnd(B * a_mat + C * (a_mat @ a_mat)) @ x)
    return x.T if u_MN.shape[0] > u_MN.shape[1] else x


def ref_muon_step(w, g, buf, *, lr: float, wd: float, mu: float, nesterov: bool, lr_adjust: str) -> None:
    """One Muon step in place on full tensors; w/g/buf are [m, n] or [E, m, n] (experts independent)."""
    buf.mul_(mu).add_((1 - mu) * g)
    u = (1 - mu) * g + mu * buf if nesterov else buf
    m, n = w.shape[-2:]
    scale = 0.2 * math.sqrt(max(m, n)) if lr_adjust == "match_rms_adamw" else math.sqrt(max(1.0, m / n))
    o = torch.stack([ref_orthogonalize(e) for e in u]) if u.ndim == 3 else ref_orthogonalize(u)
    w.mul_(1 - lr * wd).sub_(lr * scale * o)


SHAPES = [(12, 5), (5, 12), (9, 9), (3, 7, 4), (4, 6, 6)]  # tall, wide, square, experts [E, m, n]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("lr_adjust", ["match_rms_adamw", "original"])
def test_muon_matches_published_formula_fp32(nesterov, lr_adjust):
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    params = [nn.Parameter(t.clone()) for t in init]
    ref = [t.clone() for t in init]
    bufs = [torch.zeros_like(t) for t in init]
    opt = ShardedMuon([dict(params=params, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                            ns_dtype="float32", lr_adjust=lr_adjust)])
    for step in range(3):
        for p, w, b, g in zip(params, ref, bufs, _grads(step)):
            p.grad = g.clone()
            ref_muon_step(w, g, b, lr=0.02, wd=0.1, mu=0.9, nesterov=nesterov, lr_adjust=lr_adjust)
        opt.step()
    for p, w in zip(params, ref):
        torch.testing.assert_close(p.detach(), w, atol=1e-5, rtol=0)
    assert opt.stats.orthogonalized == 3 + 3 + 4 and opt.stats.collectives == 0


@pytest.mark.parametrize("lr_adjust", ["original", "match_rms_adamw"])
def test_bf16_muon_is_torch_optim_muon(lr_adjust):
    """Where the semantics coincide (2-D params, bf16 NS) we compute exactly what PyTorch's Muon computes."""
    torch.manual_seed(1)
    init = [torch.randn(s) for s in [(12, 5), (5, 12), (9, 9)]]
    ours = [nn.Parameter(t.clone()) for t in init]
    theirs = [nn.Parameter(t.clone()) for t in init]
    opt = ShardedMuon([dict(params=ours, lr=0.02, weight_decay=0.1, ns_dtype="bfloat16", ns_kernel="native",
                            lr_adjust=lr_adjust)])
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn=lr_adjust)
    for step in range(3):
        for a, b, g in zip(ours, theirs, _grads(step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("shape", [(64, 160), (160, 64), (3, 32, 80)])
def test_emulated_kernel_is_bf16_newton_schulz(shape):
    """The emulated kernel holds every NS result in bf16.

    Its output is bf16 values, and its error against exact NS is that of the
    published formula with each result rounded to bf16 (ratio ≈ 1.00 ± 0.05 over
    seeds), not the ≤ 0.45× smaller error of fp32 iterations with bf16 rounding
    only at the ends (fp32_accumulate) or only on X.
    """
    u = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = zeropower_via_newtonschulz(u, dtype=torch.bfloat16, kernel="emulated")
    assert out.dtype == torch.bfloat16
    matrices = list(u) if u.ndim == 3 else [u]
    exact = torch.stack([ref_orthogonalize(m.double()) for m in matrices]).reshape(shape)
    rounded = torch.stack([ref_orthogonalize_bf16(m) for m in matrices]).reshape(shape)

    def err(o):
        return ((o.double() - exact).norm() / exact.norm()).item()

    assert 0.8 < err(out) / err(rounded) < 1.25, (err(out), err(rounded))
    assert err(zeropower_via_newtonschulz(u, dtype=torch.float32)) < err(rounded) / 100


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 20)])
def test_fp32_accumulate_kernel_is_fp32_between_bf16_ends(shape):
    """fp32_accumulate: the update rounded to bf16, fp32 Newton–Schulz, the result rounded to bf16 (and
    returned in bf16); an update handed over in bf16 is the same update."""
    u = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out = zeropower_via_newtonschulz(u, dtype=torch.bfloat16, kernel="fp32_accumulate")
    expected = zeropower_via_newtonschulz(u.bfloat16().float(), dtype=torch.float32).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert torch.equal(zeropower_via_newtonschulz(u.bfloat16(), dtype=torch.bfloat16, kernel="fp32_accumulate"), out)


def test_ns_kernel_choice():
    """auto: fp32_accumulate for bf16 on a CPU without bf16 matmul units, torch's kernels otherwise."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_ns_kernel("auto", torch.bfloat16, cpu) == ("native" if cpu_has_bf16_matmul() else "fp32_accumulate")
    assert resolve_ns_kernel("auto", torch.bfloat16, cuda) == "native"
    assert resolve_ns_kernel("emulated", torch.float32, cpu) == "native"
    assert resolve_ns_kernel("native", torch.bfloat16, cpu) == "native"
    u = torch.randn(24, 40, generator=torch.Generator().manual_seed(4))
    chosen = resolve_ns_kernel("auto", torch.bfloat16, cpu)
    assert torch.equal(zeropower_via_newtonschulz(u, dtype=torch.bfloat16, kernel="auto"),
                       zeropower_via_newtonschulz(u, dtype=torch.bfloat16, kernel=chosen))


def test_newton_schulz_approximates_the_polar_factor():
    """NS(G) ≈ U·Vᵀ: singular values pushed into Keller's ~[0.7, 1.2] band, same singular vectors."""
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(3))
    o = zeropower_via_newtonschulz(g, steps=5, dtype=torch.float32)
    s = torch.linalg.svdvals(o)
    assert 0.6 < s.min() and s.max() < 1.25, s
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = (o * (u @ vh)).sum() / (o.norm() * (u @ vh).norm())
    assert cos > 0.98, cos
    batched = zeropower_via_newtonschulz(torch.stack([g, g.flip(0)]), dtype=torch.float32)
    torch.testing.assert_close(batched[0], o, atol=1e-5, rtol=0)


def test_adamw_group_is_torch_adamw():
    torch.manual_seed(2)
    init = [torch.randn(s) for s in [(7,), (5, 3)]]
    ours = [nn.Parameter(t.clone()) for t in init]
    theirs = [nn.Parameter(t.clone()) for t in init]
    opt = ShardedMuon([dict(params=ours, use_muon=False, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-8)])
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-8)
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 8)
        self.attention_norm = nn.RMSNorm(8)
        self.wq = nn.Linear(8, 8)
        self.experts = nn.Parameter(torch.randn(2, 8, 4))  # stacked experts [E, m, n]
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.output = nn.Linear(8, 10, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied

    def forward(self, tokens_BT):
        h = self.wq(self.attention_norm(self.tok_embeddings(tokens_BT)))
        return self.output(h + torch.einsum("btd,edk->btk", h, self.experts).sum(-1, keepdim=True)).logsumexp(-1).mean()


def test_split_and_build_from_config():
    model = TinyLM()
    muon, adamw = split_muon_params(model, OptimizerConfig().adamw_patterns)
    assert [n for n, _ in muon] == ["experts", "wq.weight"]
    assert [n for n, _ in adamw] == ["tok_embeddings.weight", "attention_norm.weight", "wq.bias"]

    cfg = OptimizerConfig(lr=0.01, adamw_lr=0.003, ns_steps=4)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, ShardedMuon)
    muon_group, adamw_group = opt.param_groups
    assert muon_group["use_muon"] and muon_group["lr"] == 0.01 and muon_group["ns_steps"] == 4
    assert not adamw_group["use_muon"] and adamw_group["lr"] == 0.003 and adamw_group["betas"] == (0.9, 0.95)
    model(torch.randint(0, 10, (2, 3))).backward()
    before = model.experts.detach().clone()
    opt.step()
    assert not torch.equal(before, model.experts)

    all_adamw = build_optimizer(model, OptimizerConfig(name="adamw", lr=0.05))
    assert len(all_adamw.param_groups) == 1 and not all_adamw.param_groups[0]["use_muon"]
    assert len(all_adamw.param_groups[0]["params"]) == 5  # trainable, tied counted once


def test_optimizer_section_loads_and_validates():
    cfg = load_config(None, ["optimizer.ns_steps=3", "optimizer.lr_adjust=original"]).optimizer
    assert cfg.ns_steps == 3 and cfg.lr_adjust == "original"
    with pytest.raises(ConfigError, match="ns_steps"):
        load_config(None, ["optimizer.ns_steps=0"])
    with pytest.raises(ConfigError, match="lr_adjust"):
        load_config(None, ["optimizer.lr_adjust=moonlight"])


def test_state_dict_round_trip_with_lr_schedule():
    """Save after 2 steps, load into a fresh model + optimizer + scheduler, step: equals 3 uninterrupted steps."""
    cfg = OptimizerConfig(ns_dtype="float32")

    def setup():
        torch.manual_seed(5)
        model = TinyLM()
        opt = build_optimizer(model, cfg)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)
        return model, opt, sched

    def step(model, opt, sched, i):
        opt.zero_grad()
        model(torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(i))).backward()
        opt.step()
        sched.step()

    model, opt, sched = setup()
    for i in range(3):
        step(model, opt, sched, i)
    assert opt.param_groups[0]["lr"] == pytest.approx(cfg.lr)  # warmed up to the peak after 3 steps

    model2, opt2, sched2 = setup()
    for i in range(2):
        step(model2, opt2, sched2, i)
    saved = (model2.state_dict(), opt2.state_dict(), sched2.state_dict())
    model3, opt3, sched3 = setup()
    model3.load_state_dict(saved[0])
    opt3.load_state_dict(saved[1])
    sched3.load_state_dict(saved[2])
    step(model3, opt3, sched3, 2)
    for (name, a), b in zip(model.named_parameters(), model3.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_chained_optimizer_acts_as_one():
    """The DistMuon path chains DistMuon + AdamW; the chain itself is checked with torch's Muon as the child."""
    torch.manual_seed(6)
    init = [torch.randn(6, 4), torch.randn(4)]
    a = nn.ParameterList([nn.Parameter(t.clone()) for t in init])
    b = [nn.Parameter(t.clone()) for t in init]

    def chain(ps):
        return ChainedOptimizer([torch.optim.Muon([ps[0]], lr=0.02), torch.optim.AdamW([ps[1]], lr=0.01)])

    opt = chain(a)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    separate = [torch.optim.Muon([b[0]], lr=0.02), torch.optim.AdamW([b[1]], lr=0.01)]
    for _ in range(2):
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape)
            y.grad = x.grad.clone()
        opt.step()
        for o in separate:
            o.step()
            for g in o.param_groups:
                g["lr"] *= 0.5
        sched.step()
    assert [g["lr"] for g in opt.children[0].param_groups] == [0.005]
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert set(opt.state) == set(a)

    saved = opt.state_dict()  # torch's flat format: DCP can name every entry
    assert sorted(saved["state"]) == [0, 1] and set(saved["state"][1]) == {"step", "exp_avg", "exp_avg_sq"}
    fresh = chain(a)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[1] is fresh.children[1].param_groups[0]  # re-linked after load
    assert torch.equal(fresh.children[0].state[a[0]]["momentum_buffer"], opt.state[a[0]]["momentum_buffer"])
    assert torch.equal(fresh.children[1].state[a[1]]["exp_avg_sq"], opt.state[a[1]]["exp_avg_sq"])
    assert fresh.children[0].param_groups[0]["lr"] == 0.005
    with pytest.raises(ValueError, match="param_groups"):
        fresh.load_state_dict({"child0": {}})

    # DCP names the state by FQN and loads it back through the same split.
    dcp_saved = get_optimizer_state_dict(a, opt)
    assert set(dcp_saved["state"]) == {"0", "1"}, dcp_saved["state"].keys()
    again = chain(a)
    set_optimizer_state_dict(a, again, dcp_saved)
    assert torch.equal(again.children[1].state[a[1]]["exp_avg"], opt.state[a[1]]["exp_avg"])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="2-D or stacked 3-D"):
        ShardedMuon([dict(params=[nn.Parameter(torch.zeros(4))])])
    with pytest.raises(ValueError, match="ns_dtype"):
        ShardedMuon([dict(params=[nn.Parameter(torch.zeros(4, 4))], ns_dtype="float16")])
    with pytest.raises(ValueError, match="ns_kernel"):
        ShardedMuon([dict(params=[nn.Parameter(torch.zeros(4, 4))], ns_kernel="bf16")])
    with pytest.raises(ValueError, match="ns_kernel"):
        build_optimizer(TinyLM(), OptimizerConfig(backend="dist_muon", ns_kernel="emulated"))
    with pytest.raises(ValueError, match="lr_adjust"):
        ShardedMuon([dict(params=[nn.Parameter(torch.zeros(4, 4))], lr_adjust="moonlight")])
    with pytest.raises(ValueError, match="dist_muon"):  # CPU params: TorchTitan's DistMuon cannot take them
        build_optimizer(TinyLM(), OptimizerConfig(backend="dist_muon"))


def test_owner_assignment_is_balanced_and_deterministic():
    gen = torch.Generator().manual_seed(7)
    for world in (2, 3, 4):
        numels = torch.randint(1, 5000, (17,), generator=gen).tolist()
        owners = assign_owners(numels, world)
        assert owners == assign_owners(list(numels), world)
        loads = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world)]
        assert max(loads) - min(loads) <= max(numels), loads  # greedy largest-first bound
    assert assign_owners([10, 10, 10, 10], 2) == [0, 1, 0, 1]


def test_lr_schedule_from_config_is_warmup_stable_decay():
    """2 warmup steps, stable, last 40% linear decay to 0.1: factors from the WSD formula, both groups."""
    model = TinyLM()
    cfg = OptimizerConfig(lr=0.01, adamw_lr=0.002, warmup_steps=2, decay_ratio=0.4, min_lr_factor=0.1)
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, cfg, training_steps=10)
    decay_steps, stable_end = 4, 2 + (10 + 1 - 2 - 4)  # torchtitan adds one virtual stable step
    factors = []
    for _ in range(10):
        factors.append(opt.param_groups[0]["lr"] / cfg.lr)
        assert opt.param_groups[1]["lr"] / cfg.adamw_lr == pytest.approx(factors[-1])
        opt.step()
        sched.step()
    expected = [(s + 1) / 2 if s < 2 else 1.0 if s < stable_end else
                0.1 + 0.9 * (1 - (s + 1 - stable_end) / decay_steps) for s in range(10)]
    assert factors == pytest.approx(expected)
