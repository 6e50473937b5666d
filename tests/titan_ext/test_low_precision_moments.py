"""bfloat16 AdamW moments (`[optimizer] moments_dtype = "bfloat16"`): stochastic rounding and the optimizer.

- The rounding is checked against its definition: every result is one of the value's two bfloat16 neighbours,
  and the share rounded up is the remainder's share of the gap (so the mean is the value).
- AdamW with bfloat16 moments is compared with AdamW written here from the published update (Loshchilov &
  Hutter, decoupled weight decay; the bias-corrected moments of Kingma & Ba) on a noisy least-squares problem
  over many steps, with round-to-nearest bfloat16 moments as the control that shows why the rounding is
  stochastic: with β2 = 0.999 their second moment stops decaying.
"""

from __future__ import annotations

import math

import pytest
import torch

from composer_mesh.configs.sections.optimizer import OptimizerConfig
from composer_mesh.titan_ext.low_precision import stochastic_round_to_bf16_
from composer_mesh.titan_ext import muon
from composer_mesh.titan_ext.muon import ShardedMuon
from composer_mesh.titan_ext.optimizer import build_optimizer


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and above |x| (same sign), from the float32 bit pattern."""
    bits = x.view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)
    up = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)
    return down, up


def test_stochastic_rounding_lands_on_a_neighbour_with_the_remainders_probability():
    gen = torch.Generator().manual_seed(0)
    values = torch.tensor([1.0 + 2**-9, -3.0 - 3 * 2**-9, 1e-20 * (1 + 2**-10), 0.7, -123.456, 1.0], dtype=torch.float32)
    draws = 40_000
    src = values.repeat(draws, 1)  # [draws, 6]
    dst = torch.empty_like(src, dtype=torch.bfloat16)
    stochastic_round_to_bf16_(dst, src, gen)
    got = dst.float()
    down, up = _neighbours(values)
    assert bool(((got == down) | (got == up)).all())
    share_up = (values.abs() - down.abs()) / (up.abs() - down.abs())  # the remainder's share of the gap
    for k in range(len(values)):
        observed = (got[:, k] == up[k]).double().mean().item()
        assert observed == pytest.approx(share_up[k].item(), abs=4 / math.sqrt(draws)), values[k]
    assert torch.allclose(got.double().mean(0), values.double(), rtol=2e-4, atol=0)  # unbiased
    assert bool((got[:, -1] == 1.0).all())  # representable values stay exact
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    out = stochastic_round_to_bf16_(torch.empty(5, dtype=torch.bfloat16), special, gen).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan() and out[3] == 0 and out[4] == 0
    with pytest.raises(ValueError, match="float32 src and bfloat16 dst"):
        stochastic_round_to_bf16_(torch.empty(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float64), gen)


def _reference_adamw(theta, grads, lr, betas, eps, wd):
    """AdamW written out: θ ← θ(1 − lr·wd) − lr · m̂ / (√v̂ + eps), m̂ = m / (1 − β1ᵗ), v̂ = v / (1 − β2ᵗ)."""
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        theta = theta * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
    return theta


def _trajectory(moments: str, steps: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Noisy least squares: the optimizer's final θ, the float64 reference on the same gradients, the state."""
    torch.manual_seed(0)
    a, target = torch.randn(64, 32), torch.randn(64)
    theta = torch.nn.Parameter(torch.zeros(32))
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.1
    opt = ShardedMuon([dict(params=[theta], use_muon=False, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                            moments_dtype=moments)])
    grads = []
    noise = torch.Generator().manual_seed(1)
    for _ in range(steps):
        rows = torch.randint(0, 64, (16,), generator=noise)
        theta.grad = (2 * a[rows].T @ (a[rows] @ theta.detach() - target[rows]) / 16).contiguous()
        grads.append(theta.grad.clone().double())
        opt.step()
    ref = _reference_adamw(torch.zeros(32, dtype=torch.float64), grads, lr, betas, eps, wd)
    return theta.detach().double(), ref, [opt.state[theta][k] for k in ("exp_avg", "exp_avg_sq")]


def test_bf16_moments_follow_the_reference_adamw():
    fp32, ref32, _ = _trajectory("float32", 300)
    assert torch.allclose(fp32, ref32, rtol=1e-4, atol=1e-5)  # the float32 path is AdamW itself
    bf16, ref16, state = _trajectory("bfloat16", 300)
    assert all(t.dtype == torch.bfloat16 and t.element_size() == 2 for t in state)
    err = ((bf16 - ref16).norm() / ref16.norm()).item()
    assert err < 0.02, err


def test_stochastic_rounding_is_what_keeps_the_second_moment_moving(monkeypatch):
    """v with β2 = 0.999 moves 0.1 % a step, under bfloat16's half-ulp: stored rounded to nearest (the control,
    patched in) it stops decaying once the gradients shrink; stored stochastically it follows v of the formula."""
    grads = [torch.full((256,), 1.0)] * 600 + [torch.full((256,), 0.05)] * 1200  # v should fall ~3x in phase 2
    v_ref = torch.zeros(256, dtype=torch.float64)
    for g in grads:
        v_ref = 0.999 * v_ref + 0.001 * g.double() ** 2

    def second_moment() -> torch.Tensor:
        theta = torch.nn.Parameter(torch.zeros(256))
        opt = ShardedMuon([dict(params=[theta], use_muon=False, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0,
                                moments_dtype="bfloat16")])
        for g in grads:
            theta.grad = g.clone()
            opt.step()
        return opt.state[theta]["exp_avg_sq"].double()

    stochastic = second_moment()
    # unbiased: the elements' mean follows the formula; each element carries ~5 % of rounding noise (the
    # steps' half-ulp draws, decayed by β2), which AdamW's square root halves
    assert abs(stochastic.mean().item() / v_ref.mean().item() - 1) < 0.01
    assert ((stochastic - v_ref).abs() / v_ref).mean().item() < 0.1
    monkeypatch.setattr(muon, "stochastic_round_to_bf16_", lambda dst, src, generator: dst.copy_(src))
    nearest = second_moment()
    assert nearest.mean().item() / v_ref.mean().item() - 1 > 0.3  # stalled high: it stopped decaying


def test_moments_dtype_is_a_config_key_and_rejects_other_dtypes():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    opt = build_optimizer(model, OptimizerConfig(name="adamw", moments_dtype="bfloat16"))
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    assert {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"} == {torch.bfloat16}
    restored = build_optimizer(model, OptimizerConfig(name="adamw", moments_dtype="bfloat16"))
    restored.load_state_dict(opt.state_dict())  # torch casts state to the params' float32; kept bfloat16 here
    for p in model.parameters():
        got, want = restored.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # the configured dtype wins over the checkpoint's: a float32 run resumed with bfloat16 moments, and back
    fp32 = build_optimizer(model, OptimizerConfig(name="adamw"))
    fp32.load_state_dict(opt.state_dict())
    assert {s["exp_avg"].dtype for s in fp32.state.values()} == {torch.float32}
    assert {g["moments_dtype"] for g in fp32.param_groups} == {"float32"}
    with pytest.raises(ValueError, match="moments_dtype must be one of"):
        ShardedMuon([dict(params=list(model.parameters()), use_muon=False, moments_dtype="float16")])
