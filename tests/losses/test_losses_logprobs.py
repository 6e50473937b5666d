"""Chunked LM-head paths (recompute and fused) equal the full-logits path in value and gradient."""

from __future__ import annotations

import pytest
import torch

from composer_mesh.losses.distill import DistillSpec
from composer_mesh.losses.logprobs import (
    Teacher,
    chunk_tokens_for,
    chunked_token_stats,
    fused_token_loss,
    token_stats_naive,
)

# (tokens, hidden, vocab, chunk): chunk boundaries that divide and do not divide N, chunk > N
CASES = [(13, 8, 31, 4), (64, 16, 97, 16), (101, 32, 509, 37), (7, 8, 31, 64)]
SPECS = [
    DistillSpec("jsd", beta=0.5),
    DistillSpec("jsd", beta=0.0, temperature=1.5, top_k=7),
    DistillSpec("taid", taid_t=0.6),
    DistillSpec("eopd"),
]


def _inputs(n, d, v, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100  # padding / prompt positions
    th = torch.randn(n, d, generator=g).to(dtype)
    return h, w, labels, th


def ref_stats(h, w, labels, th, spec):
    """Independent: full logits in float64, log-softmax by hand."""
    z = h.double() @ w.double().T
    logz = torch.log(torch.exp(z - z.max(-1, keepdim=True).values).sum(-1)) + z.max(-1).values
    lp = z.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) - logz
    lp = torch.where(labels >= 0, lp, torch.zeros_like(lp))
    p = torch.exp(z - logz.unsqueeze(-1))
    ent = -(p * (z - logz.unsqueeze(-1))).sum(-1)
    return lp, ent


def _weighted(stats, g):
    return sum((getattr(stats, k) * g[k]).sum() for k in g if getattr(stats, k) is not None)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-b{s.beta}-k{s.top_k}")
def test_chunked_equals_naive_value_and_gradient(case, spec):
    n, d, v, chunk = case
    h, w, labels, th = _inputs(n, d, v, seed=n + v)
    teacher = Teacher(th, w.detach(), spec)
    gen = torch.Generator().manual_seed(1)
    g = {k: torch.randn(n, generator=gen) for k in ("logprobs", "entropy", "divergence")}

    naive = token_stats_naive(h, w, labels, teacher=teacher)
    chunked = chunked_token_stats(h, w, labels, teacher=teacher, chunk_tokens=chunk)
    for k in g:
        torch.testing.assert_close(getattr(chunked, k), getattr(naive, k), atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad(_weighted(naive, g), [h, w])
    got = torch.autograd.grad(_weighted(chunked, g), [h, w])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    fused, stats = fused_token_loss(
        h, w, labels, lambda s, sl: _weighted(s, {k: x[sl] for k, x in g.items()}),
        teacher=teacher, want_entropy=True, chunk_tokens=chunk,
    )
    torch.testing.assert_close(fused, _weighted(naive, g).detach(), atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(2.5 * fused, [h, w])  # upstream scale flows through
    for a, b in zip(got, want):
        torch.testing.assert_close(a, 2.5 * b, atol=1e-5, rtol=1e-5)
    assert not stats.logprobs.requires_grad
    torch.testing.assert_close(stats.divergence, naive.divergence.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES[:3])
def test_stats_match_independent_reference(case):
    n, d, v, chunk = case
    h, w, labels, th = _inputs(n, d, v, seed=3 * n)
    stats = chunked_token_stats(h, w, labels, chunk_tokens=chunk)
    lp, ent = ref_stats(h.detach(), w.detach(), labels, th, None)
    torch.testing.assert_close(stats.logprobs.double(), lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.entropy.double(), ent, atol=1e-5, rtol=1e-5)
    assert (stats.logprobs[labels < 0] == 0).all()
    assert stats.divergence is None


def test_partial_upstream_and_frozen_head():
    """Only some outputs used, or a head without grad: gradients still exact."""
    h, w, labels, th = _inputs(20, 8, 40, seed=9)
    w_frozen = w.detach()
    naive = token_stats_naive(h, w_frozen, labels)
    chunked = chunked_token_stats(h, w_frozen, labels, chunk_tokens=6)
    (a,) = torch.autograd.grad(naive.entropy.sum(), h)
    (b,) = torch.autograd.grad(chunked.entropy.sum(), h)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        loss, _ = fused_token_loss(h, w, labels, lambda s, sl: s.logprobs.sum(), chunk_tokens=6)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, naive.logprobs.sum().detach(), atol=1e-5, rtol=1e-5)


def test_bf16_against_fp32_reference():
    """bf16 hidden/head (fp32 softmax math): documented tolerances in docs/losses.md."""
    n, d, v = 96, 64, 1000
    h32, w32, labels, th32 = _inputs(n, d, v, seed=11)
    spec = DistillSpec("jsd", beta=0.5)
    ref = token_stats_naive(h32, w32, labels, teacher=Teacher(th32, w32.detach(), spec))
    h16 = h32.detach().bfloat16().requires_grad_()
    w16 = w32.detach().bfloat16().requires_grad_()
    got = chunked_token_stats(h16, w16, labels, teacher=Teacher(th32.bfloat16(), w16.detach(), spec), chunk_tokens=32)
    assert got.logprobs.dtype == torch.float32
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got.entropy, ref.entropy, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got.divergence, ref.divergence, atol=2e-2, rtol=5e-2)
    g_ref = torch.autograd.grad(ref.logprobs.sum() + ref.divergence.sum(), [h32, w32])
    g_got = torch.autograd.grad(got.logprobs.sum() + got.divergence.sum(), [h16, w16])
    for a, b in zip(g_got, g_ref):
        assert a.dtype == torch.bfloat16
        rel = (a.float() - b).norm() / b.norm()
        assert rel < 2e-2, rel


def test_chunk_size_from_budget_and_shape_errors():
    assert chunk_tokens_for(151936, 64.0) == 110
    assert chunk_tokens_for(10**9, 1.0) == 1
    h, w, labels, th = _inputs(5, 8, 11, seed=0)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        chunked_token_stats(h, w[:, :4], labels)
    with pytest.raises(ValueError, match="labels"):
        chunked_token_stats(h, w, labels[:3])
    with pytest.raises(ValueError, match="aligned"):
        chunked_token_stats(h, w, labels, teacher=Teacher(th[:2], w.detach(), DistillSpec()))
