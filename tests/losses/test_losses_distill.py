"""Distillation divergences vs references written in the test from the published formulas."""

from __future__ import annotations

import math
import random

import pytest
import torch

from composer_mesh.losses.distill import DistillSpec, TAIDSchedule, token_divergence

SHAPES = [(3, 11), (17, 64), (40, 257)]  # (tokens, vocab)


def kl_ref(p_logits, q_logits):
    """KL(p ‖ q) = Σ p (log p − log q) in float64, from logits."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def jsd_ref(s, t, beta, T=1.0, k=0):
    """OPSD/TRL generalized JSD written out on probabilities (float64)."""
    s, t = s.double() / T, t.double() / T
    if k:
        idx = t.topk(k, -1).indices
        s, t = s.gather(-1, idx), t.gather(-1, idx)
    ps, pt = s.softmax(-1), t.softmax(-1)
    if beta == 0:
        return (pt * (pt.log() - ps.log())).sum(-1)
    if beta == 1:
        return (ps * (ps.log() - pt.log())).sum(-1)
    m = beta * pt + (1 - beta) * ps
    return beta * (pt * (pt.log() - m.log())).sum(-1) + (1 - beta) * (ps * (ps.log() - m.log())).sum(-1)


def _logits(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(shape, generator=g), 2 * torch.randn(shape, generator=g)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("T,k", [(1.0, 0), (2.0, 0), (0.7, 5)])
def test_generalized_jsd_matches_reference(shape, beta, T, k):
    s, t = _logits(shape, seed=shape[0])
    s.requires_grad_()
    got = token_divergence(s, t, DistillSpec("jsd", beta=beta, temperature=T, top_k=k))
    torch.testing.assert_close(got.double(), jsd_ref(s.detach(), t, beta, T, k), atol=1e-5, rtol=1e-5)
    # gradient vs autograd through the float64 reference
    s64 = s.detach().double().requires_grad_()
    w = torch.randn(shape[0], dtype=torch.float64)
    (jsd_ref(s64, t, beta, T, k) * w).sum().backward()
    (g,) = torch.autograd.grad((got * w.float()).sum(), s)
    torch.testing.assert_close(g.double(), s64.grad, atol=1e-5, rtol=1e-5)


def test_jsd_endpoints_are_the_two_kl_directions():
    s, t = _logits((9, 30), seed=3)
    fwd = token_divergence(s, t, DistillSpec("jsd", beta=0.0))
    rev = token_divergence(s, t, DistillSpec("jsd", beta=1.0))
    torch.testing.assert_close(fwd.double(), kl_ref(t, s), atol=1e-5, rtol=1e-5)  # KL(teacher ‖ student)
    torch.testing.assert_close(rev.double(), kl_ref(s, t), atol=1e-5, rtol=1e-5)  # KL(student ‖ teacher)
    assert not torch.allclose(fwd, rev)


@pytest.mark.parametrize("kind", ["jsd", "taid", "eopd"])
def test_teacher_never_receives_gradient(kind):
    s, t = _logits((6, 20), seed=4)
    s.requires_grad_()
    t.requires_grad_()
    out = token_divergence(s, t, DistillSpec(kind, taid_t=0.7))
    out.sum().backward()
    assert t.grad is None and s.grad is not None and s.grad.abs().sum() > 0


def taid_ref(s, t, tt):
    """TAID: target softmax((1−t)·sg(z_s) + t·z_t), loss −Σ target·log softmax(z_s)."""
    target = ((1 - tt) * s.detach() + tt * t).softmax(-1)
    return -(target * s.log_softmax(-1)).sum(-1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tt", [0.0, 0.4, 0.83, 1.0])
def test_taid_matches_reference(shape, tt):
    s, t = _logits(shape, seed=10 + shape[0])
    s.requires_grad_()
    got = token_divergence(s, t, DistillSpec("taid", taid_t=tt))
    s64 = s.detach().double().requires_grad_()
    want = taid_ref(s64, t.double(), tt)
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)
    want.sum().backward()
    (g,) = torch.autograd.grad(got.sum(), s)
    torch.testing.assert_close(g.double(), s64.grad, atol=1e-5, rtol=1e-5)


def test_taid_t0_passes_no_teacher_signal_and_t1_is_forward_kl():
    s, t = _logits((12, 40), seed=5)
    s.requires_grad_()
    # t = 0: the target is the student's own (detached) distribution: zero gradient, value = H(p_s),
    # whatever the teacher says.
    out0 = token_divergence(s, t, DistillSpec("taid", taid_t=0.0))
    (g0,) = torch.autograd.grad(out0.sum(), s)
    assert g0.abs().max() < 1e-6
    ps = s.detach().double().softmax(-1)
    torch.testing.assert_close(out0.double(), -(ps * ps.log()).sum(-1), atol=1e-5, rtol=1e-5)
    other = token_divergence(s, 5 * torch.randn(12, 40), DistillSpec("taid", taid_t=0.0))
    torch.testing.assert_close(out0, other)
    # t = 1: the official loss is the cross-entropy to the teacher = KL(p_t ‖ p_s) + H(p_t):
    # same gradient as forward KL, value shifted by the (constant) teacher entropy.
    out1 = token_divergence(s, t, DistillSpec("taid", taid_t=1.0))
    fkl = token_divergence(s, t, DistillSpec("jsd", beta=0.0))
    pt = t.double().softmax(-1)
    torch.testing.assert_close(out1.double(), fkl.double() - (pt * pt.log()).sum(-1), atol=1e-5, rtol=1e-5)
    (g1,) = torch.autograd.grad(out1.sum(), s)
    (gk,) = torch.autograd.grad(fkl.sum(), s)
    torch.testing.assert_close(g1, gk, atol=1e-6, rtol=1e-5)


def test_taid_schedule_monotone_capped_and_matches_reference():
    rng = random.Random(0)
    sched = TAIDSchedule(t_start=0.4, t_end=0.9, alpha=0.05, beta=0.99)
    # independent re-statement of SakanaAI/TAID update_t
    t, m, prev = 0.4, 0.0, None
    ts = []
    total = 200
    for step in range(total):
        loss = 2.0 + rng.uniform(-1.0, 1.0)  # noisy: the loss goes up as often as down
        got = sched.update(loss, step, total)
        if prev is not None:
            m = 0.99 * m + 0.01 * (prev - loss) / (prev + 1e-15)
            target = 0.4 + 0.5 * step / total
            t = min(0.9, max(target, t + 0.05 * (1 / (1 + math.exp(-m))) * (1 - t)))
        prev = loss
        assert got == pytest.approx(t, abs=1e-12)
        ts.append(got)
    assert all(b >= a for a, b in zip(ts, ts[1:])), "t must never decrease"
    assert max(ts) <= 0.9 and ts[-1] == pytest.approx(0.9)
    state = sched.state_dict()
    clone = TAIDSchedule(0.4, 0.9, 0.05, 0.99)
    clone.load_state_dict(state)
    assert clone.update(1.0, 10, total) == sched.update(1.0, 10, total)


def test_taid_linear_schedule_ignores_the_loss():
    """adaptive off (TAID's disable_adaptive): t = t_start + (t_end − t_start)·step/total from the
    first update on, whatever the loss does; capped at t_end past the last step."""
    rng = random.Random(1)
    sched = TAIDSchedule(t_start=0.2, t_end=0.8, alpha=0.5, beta=0.5, adaptive=False)
    total = 40
    for step in range(1, total + 6):
        got = sched.update(rng.uniform(0.0, 5.0), step, total)
        assert got == pytest.approx(min(0.8, 0.2 + 0.6 * step / total), abs=1e-12)
    assert sched.t == 0.8
    adaptive = TAIDSchedule(t_start=0.2, t_end=0.8, alpha=0.5, beta=0.5)
    for step, loss in enumerate([3.0, 1.0, 0.5], start=1):
        adaptive.update(loss, step, total)
    assert adaptive.t > 0.2 + 0.6 * 3 / total  # the falling loss pushed t past the line


def test_jsd_batchmean_is_the_channel_divided_by_sequences():
    """TRL/OPSD `generalized_jsd_loss` without labels returns Σ_{b,t} jsd / B ("batchmean");
    this channel divides by the count passed in (valid tokens): passing B as that count
    reproduces TRL's unmasked value."""
    from composer_mesh.configs.sections.loss import LossConfig
    from composer_mesh.losses.composer import DistillInputs, compose_loss

    g = torch.Generator().manual_seed(12)
    B, T, Dm, Vm = 3, 7, 6, 19
    h_s, h_t = torch.randn(B, T, Dm, generator=g), torch.randn(B, T, Dm, generator=g)
    w = torch.randn(Vm, Dm, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    trl_batchmean = jsd_ref(h_s @ w.T, h_t @ w.T, 0.5).sum() / B
    for chunked in (False, True):
        cfg = LossConfig(chunked=chunked, chunk_tokens=4)
        per_token = compose_loss(cfg, w, distill=DistillInputs(h_s, h_t, mask, num_tokens=B * T)).loss
        per_seq = compose_loss(cfg, w, distill=DistillInputs(h_s, h_t, mask, num_tokens=B)).loss
        torch.testing.assert_close(per_seq.double(), trl_batchmean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(per_seq, per_token * T, atol=1e-5, rtol=1e-5)


def eopd_ref(s, t):
    ps, pt = s.double().softmax(-1), t.double().softmax(-1)
    h = -(pt * pt.log()).sum(-1)
    w = (h / math.log(s.shape[-1])).clamp(0, 1)
    return w * (pt * (pt.log() - ps.log())).sum(-1) + (1 - w) * (ps * (ps.log() - pt.log())).sum(-1)


@pytest.mark.parametrize("shape", SHAPES)
def test_entropy_aware_opd_matches_reference(shape):
    s, t = _logits(shape, seed=20 + shape[0])
    t[0] *= 20  # one confident teacher token (w near 0) next to flat ones
    s.requires_grad_()
    got = token_divergence(s, t, DistillSpec("eopd"))
    s64 = s.detach().double().requires_grad_()
    want = eopd_ref(s64, t)
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)
    want.sum().backward()
    (g,) = torch.autograd.grad(got.sum(), s)
    torch.testing.assert_close(g.double(), s64.grad, atol=1e-5, rtol=1e-5)


def test_bad_specs_are_rejected():
    with pytest.raises(ValueError, match="kind"):
        DistillSpec("kl")
    with pytest.raises(ValueError, match="beta"):
        DistillSpec(beta=1.5)
    with pytest.raises(ValueError, match="same shape"):
        token_divergence(torch.zeros(2, 3), torch.zeros(2, 4), DistillSpec())
    with pytest.raises(ValueError, match="t_start"):
        TAIDSchedule(t_start=1.0)


@pytest.mark.parametrize("path", [dict(chunked=False), dict(chunked=True, chunk_tokens=4),
                                  dict(chunked=True, chunk_tokens=64)])
@pytest.mark.parametrize("beta,guard", [(0.5, 0.3), (0.0, 2.0), (0.5, 0.0)])
def test_kl_guard_matches_the_formula(path, beta, guard):
    """`[loss.distill] kl_guard = c`: the channel is Σ_distilled [JSD_β(p_s, p_t) + c·k3] / N with
    k3 = exp(lp_gen − lp) − (lp_gen − lp) − 1 on the sampled token (lp the policy's, lp_gen the generator's);
    `distill/kl_guard_mean` is the token mean of k3."""
    from composer_mesh.configs.sections.loss import DistillLossConfig, LossConfig
    from composer_mesh.losses.composer import DistillInputs, compose_loss, summarize_metrics

    g = torch.Generator().manual_seed(31 + int(10 * guard))
    B, T, Dm, Vm = 3, 9, 6, 23
    h_s = torch.randn(B, T, Dm, generator=g).requires_grad_()
    h_t = torch.randn(B, T, Dm, generator=g)
    w = (torch.randn(Vm, Dm, generator=g) / Dm**0.5).requires_grad_()
    mask = torch.rand(B, T, generator=g) > 0.3
    labels = torch.randint(0, Vm, (B, T), generator=g)
    gen = -torch.rand(B, T, generator=g) * 4 - 1
    n = int(mask.sum()) + 2  # the global count of distilled tokens
    cfg = LossConfig(**path, distill=DistillLossConfig(beta=beta, kl_guard=guard))
    out = compose_loss(cfg, w, distill=DistillInputs(h_s, h_t, mask, n, labels_BT=labels, gen_logprobs_BT=gen))

    # the teacher is a constant (no gradient reaches the head through it)
    s_logits, t_logits = (h_s.double() @ w.double().T)[mask], (h_t.double() @ w.detach().double().T)[mask]
    lp = torch.log_softmax(s_logits, -1).gather(-1, labels[mask].unsqueeze(-1)).squeeze(-1)
    x = gen[mask].double() - lp
    k3 = x.exp() - x - 1
    ref = (jsd_ref(s_logits, t_logits, beta) + guard * k3).sum() / n
    torch.testing.assert_close(out.loss.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out.loss, [w, h_s]), torch.autograd.grad(ref, [w, h_s])):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)
    summary = summarize_metrics(out.metrics)
    if guard:
        assert summary["distill/kl_guard_mean"] == pytest.approx(float(k3.detach().mean()), abs=1e-5)
        assert float(k3.detach().mean()) > 1e-3  # the guard adds something here
    else:
        assert "distill/kl_guard_sum" not in out.metrics
        bare = compose_loss(cfg, w, distill=DistillInputs(h_s, h_t, mask, n))  # no labels needed when off
        assert torch.equal(bare.loss, out.loss)
    if guard:
        with pytest.raises(ValueError, match="kl_guard"):
            compose_loss(cfg, w, distill=DistillInputs(h_s, h_t, mask, n))
