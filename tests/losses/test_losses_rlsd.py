"""RLSD in the policy channel (`[loss.distill] rlsd`) against the formula, written here in float64 with full logits.

Self-Distilled RLVR (arXiv:2604.03128) as docs/losses.md states it: for each sampled token of a hinted rollout,
Δ_t = stopgrad(log π_T(y_t | x, hint, y<t) − log π_S(y_t | x, y<t)), w_t = clip(exp(sign(A)·Δ_t), w_min, w_max),
and the token's advantage becomes A·w_t; tokens outside the RLSD mask keep w = 1. Checked on DAPO (with the
default TIS weight against the generator's logprobs, and with a stale π_old so the clip is active) and
PRIME-DPPO, on the full-logits and the chunked LM-head paths, values and gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from composer_mesh.configs.sections.loss import DistillLossConfig, LossConfig, PolicyLossConfig
from composer_mesh.losses.composer import PolicyInputs, compose_loss, summarize_metrics
from composer_mesh.losses.policy import rlsd_weights

V, D = 47, 10
PATHS = [dict(chunked=False), dict(chunked=True, chunk_tokens=3), dict(chunked=True, chunk_tokens=64)]


def _inputs(B, T, seed, stale: bool):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    rlsd = mask & (torch.rand(B, T, generator=g) > 0.4)
    adv = torch.randn(B, generator=g)
    adv[0] = 0.0  # sign(0) = 0: weight 1 whatever the teacher
    return PolicyInputs(
        torch.randn(B, T, D, generator=g), torch.randint(0, V, (B, T), generator=g), mask, adv,
        num_tokens=int(mask.sum()) + 3,  # a global count larger than this microbatch's
        old_logprobs_BT=(-torch.rand(B, T, generator=g) * 3 - 1) if stale else None,
        gen_logprobs_BT=-torch.rand(B, T, generator=g) * 3 - 1,
        rlsd_mask_BT=rlsd, rlsd_teacher_hidden_BTD=torch.randn(B, T, D, generator=g) * 1.5,
    )


def _reference(cfg: LossConfig, w_VD, x: PolicyInputs, rlsd_on: bool):
    """The channel's loss from the formulas (float64, full logits), and the RLSD weights / gaps it used."""
    p, d = cfg.policy, cfg.distill
    h, w = x.hidden_BTD.double(), w_VD.double()
    logp = torch.log_softmax(h @ w.T, -1).gather(-1, x.labels_BT.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        teacher = torch.log_softmax(x.rlsd_teacher_hidden_BTD.double() @ w.T, -1)
        teacher = teacher.gather(-1, x.labels_BT.unsqueeze(-1)).squeeze(-1)
    terms, weights, gaps = [], [], []
    for b in range(x.mask_BT.shape[0]):
        for t in range(x.mask_BT.shape[1]):
            if not x.mask_BT[b, t]:
                continue
            a = float(x.advantages[b])
            lp = logp[b, t]
            weight = 1.0
            if rlsd_on and x.rlsd_mask_BT[b, t]:
                gap = float(teacher[b, t] - lp.detach())
                sign = (a > 0) - (a < 0)
                weight = min(max(torch.tensor(sign * gap, dtype=torch.float64).exp().item(), d.rlsd_w_min),
                             d.rlsd_w_max)
                weights.append(weight)
                gaps.append(gap)
            a = a * weight
            gen = float(x.gen_logprobs_BT[b, t])
            if p.kind == "prime_dppo":
                log_r = lp - gen
                dp = float(lp.detach().exp()) - torch.tensor(gen).exp().item()
                masked = (a > 0 and dp > p.dppo_delta_high) or (a < 0 and dp < -p.dppo_delta_low)
                terms.append((0.0 if masked else -a * log_r.exp()) + p.kl_tau * log_r**2)
                continue
            old = lp.detach() if x.old_logprobs_BT is None else float(x.old_logprobs_BT[b, t])
            ratio = (lp - old).exp()
            loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - p.eps_low, 1 + p.eps_high))
            tis = min(torch.tensor(float(old) - gen, dtype=torch.float64).exp().item(), p.tis_cap)
            terms.append(loss * tis)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in terms]).sum() / x.num_tokens, weights, gaps


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind,stale", [("dapo", False), ("dapo", True), ("prime_dppo", False)])
@pytest.mark.parametrize("bounds", [(0.8, 1.2), (0.0, 5.0)])
def test_rlsd_matches_the_formula(path, kind, stale, bounds):
    x = _inputs(3, 11, seed=7 + int(stale) + 10 * int(bounds[1]), stale=stale)
    x.hidden_BTD.requires_grad_()
    w = (torch.randn(V, D, generator=torch.Generator().manual_seed(3)) / D**0.5).requires_grad_()
    cfg = LossConfig(**path, policy=PolicyLossConfig(kind=kind),
                     distill=DistillLossConfig(rlsd=True, rlsd_w_min=bounds[0], rlsd_w_max=bounds[1]))
    out = compose_loss(cfg, w, policy=x)
    ref, weights, gaps = _reference(cfg, w, x, rlsd_on=True)
    torch.testing.assert_close(out.loss.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out.loss, [w, x.hidden_BTD]), torch.autograd.grad(ref, [w, x.hidden_BTD])):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)
    summary = summarize_metrics(out.metrics)
    assert summary["policy/rlsd_tokens"] == len(weights) == int((x.rlsd_mask_BT & x.mask_BT).sum())
    assert summary["policy/rlsd_weight_mean"] == pytest.approx(sum(weights) / len(weights), abs=1e-5)
    assert summary["policy/rlsd_gap_mean"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)
    assert all(bounds[0] <= v <= bounds[1] for v in weights)
    # the weights matter: the plain channel (every w = 1) gives another loss
    plain, _, _ = _reference(cfg, w, x, rlsd_on=False)
    assert abs(float(plain.detach()) - float(ref.detach())) > 1e-4
    off = compose_loss(dataclasses.replace(cfg, distill=DistillLossConfig()), w, policy=x)
    torch.testing.assert_close(off.loss.double(), plain.detach(), atol=1e-5, rtol=1e-5)
    assert "policy/rlsd_tokens" not in off.metrics


def test_rlsd_weights_elementwise():
    teacher = torch.tensor([-1.0, -3.0, -1.0, -3.0, -2.0, -0.1])
    student = torch.tensor([-2.0, -2.0, -2.0, -2.0, -2.0, -9.0])
    adv = torch.tensor([1.5, 1.5, -0.5, -0.5, 0.0, 2.0])
    got = rlsd_weights(teacher, student, adv, 0.5, 2.0)
    e = torch.e
    # A > 0: the teacher's gain; A < 0: its inverse; A = 0: 1; a huge gain: clipped at w_max
    torch.testing.assert_close(got, torch.tensor([e, 1 / e, 1 / e, e, 1.0, 2.0]).clamp(0.5, 2.0))
    assert not rlsd_weights(teacher.requires_grad_(), student, adv, 0.5, 2.0).requires_grad


def test_rlsd_needs_aligned_teacher_states():
    x = _inputs(2, 5, seed=1, stale=False)
    cfg = LossConfig(distill=DistillLossConfig(rlsd=True))
    with pytest.raises(ValueError, match="rlsd_teacher_hidden_BTD"):
        compose_loss(cfg, torch.randn(V, D), policy=dataclasses.replace(x, rlsd_teacher_hidden_BTD=None))
    # no mask (a batch without hints): the plain channel
    plain = compose_loss(LossConfig(), torch.randn(V, D, generator=torch.Generator().manual_seed(0)), policy=x)
    masked_off = compose_loss(cfg, torch.randn(V, D, generator=torch.Generator().manual_seed(0)),
                              policy=dataclasses.replace(x, rlsd_mask_BT=None))
    torch.testing.assert_close(masked_off.loss, plain.loss)
