"""Policy channel vs independent references written from the published formulas."""

from __future__ import annotations

import math

import pytest
import torch

from composer_mesh.configs.sections.loss import PolicyLossConfig
from composer_mesh.losses.policy import (
    dapo_token_loss,
    dynamic_sampling_keep,
    grpo_advantages,
    overlong_penalty,
    prime_dppo_token_loss,
)
from composer_mesh.losses.mismatch import mismatch_weights

SHAPES = [(2, 5), (3, 17), (4, 40)]


def ref_advantages(rewards, groups, *, eps, unbiased=True, scale="group", singleton="zero"):
    """Loop over groups exactly as verl's compute_grpo_outcome_advantage / TRL do."""
    out = [0.0] * len(rewards)
    all_r = list(rewards)
    n = len(all_r)
    bmean = sum(all_r) / n
    bstd = math.sqrt(sum((x - bmean) ** 2 for x in all_r) / ((n - 1) if unbiased else n)) if n > 1 else 0.0
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        rs = [rewards[i] for i in idx]
        if len(rs) == 1:
            if singleton == "verl":  # verl: mean 0, std 1
                out[idx[0]] = rs[0] if scale == "none" else rs[0] / (1.0 + eps)
            continue
        m = sum(rs) / len(rs)
        s = math.sqrt(sum((x - m) ** 2 for x in rs) / ((len(rs) - 1) if unbiased else len(rs)))
        for i in idx:
            if scale == "group":
                out[i] = (rewards[i] - m) / (s + eps)
            elif scale == "batch":
                out[i] = (rewards[i] - m) / (bstd + eps)
            else:
                out[i] = rewards[i] - m
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("singleton", ["zero", "verl"])
def test_grpo_advantages_match_reference(scale, unbiased, singleton):
    g = torch.Generator().manual_seed(1)
    groups = torch.tensor([0, 0, 0, 0, 3, 3, 7, 1, 1, 1, 9])  # groups 7 and 9 are singletons
    rewards = torch.randint(0, 2, (11,), generator=g).double() + 0.1 * torch.randn(11, generator=g, dtype=torch.float64)
    cfg = PolicyLossConfig(adv_scale=scale, adv_std="unbiased" if unbiased else "biased", adv_eps=1e-6, singleton=singleton)
    got = grpo_advantages(rewards.float(), groups, cfg)
    want = ref_advantages(rewards.float().double().tolist(), groups.tolist(), eps=1e-6, unbiased=unbiased, scale=scale, singleton=singleton)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_verl_and_trl_conventions_are_options():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # verl: unbiased std, eps 1e-6;  TRL: unbiased std, eps 1e-4 (torch .std() is unbiased)
    for eps in (1e-6, 1e-4):
        got = grpo_advantages(rewards, groups, PolicyLossConfig(adv_eps=eps))
        r = rewards.view(2, 4)
        want = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # TRL scale_rewards="batch": group mean, batch std
    got = grpo_advantages(rewards, groups, PolicyLossConfig(adv_scale="batch", adv_eps=1e-4))
    want = ((r - r.mean(1, keepdim=True)).view(-1)) / (rewards.std() + 1e-4)
    torch.testing.assert_close(got, want)
    # Dr.GRPO: mean only
    got = grpo_advantages(rewards, groups, PolicyLossConfig(adv_scale="none"))
    torch.testing.assert_close(got, (r - r.mean(1, keepdim=True)).view(-1))


def test_singleton_group_defaults_to_zero_advantage():
    adv = grpo_advantages(torch.tensor([0.7, 1.0, 0.0]), torch.tensor([5, 6, 6]), PolicyLossConfig())
    assert adv[0].item() == 0.0 and not torch.isnan(adv).any()


def test_dynamic_sampling_drops_uniform_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert dynamic_sampling_keep(rewards, groups).tolist() == [False, False, True, True, False, False, False]


def test_overlong_penalty_piecewise():
    L_max, L_buf = 100, 20
    lengths = torch.tensor([10, 80, 81, 90, 100, 101, 500])
    want = [0.0, 0.0, -1 / 20, -10 / 20, -1.0, -1.0, -1.0]
    torch.testing.assert_close(overlong_penalty(lengths, L_max, L_buf), torch.tensor(want))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, L_max, 0)


def ref_dapo(logp, old, adv, eps_low, eps_high, c=None, tis=None):
    """Per-token loop: −min(ρA, clip(ρ)A), verl dual clip, TIS multiplier."""
    out = torch.empty_like(logp, dtype=torch.float64)
    flat = out.view(-1)
    for i, (lp, lo, a) in enumerate(zip(logp.reshape(-1).tolist(), old.reshape(-1).tolist(), adv.reshape(-1).tolist())):
        rho = math.exp(lp - lo)
        v = -min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
        if c is not None and a < 0:
            v = min(v, -a * c)
        if tis is not None:
            v *= tis.reshape(-1)[i].item()
        flat[i] = v
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("with_tis", [False, True])
def test_dapo_token_loss_matches_reference(shape, dual, with_tis):
    g = torch.Generator().manual_seed(sum(shape))
    logp = -torch.rand(shape, generator=g) * 3
    old = logp + 0.5 * torch.randn(shape, generator=g)  # ratios well outside the clip range too
    gen = old + 0.3 * torch.randn(shape, generator=g)
    adv = torch.randn(shape, generator=g)
    tis = mismatch_weights(old.view(-1), gen.view(-1), None, PolicyLossConfig(tis_cap=2.0)).weight.view(shape) if with_tis else None
    if with_tis:
        torch.testing.assert_close(tis.double(), (old.double() - gen.double()).exp().clamp(max=2.0))
    terms = dapo_token_loss(logp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip_c=dual, mismatch_weight=tis)
    want = ref_dapo(logp, old, adv, 0.2, 0.28, dual, tis)
    torch.testing.assert_close(terms.loss.double(), want, atol=1e-5, rtol=1e-5)
    rho = (logp - old).exp()
    assert terms.clipped.any() and (~terms.clipped).any()
    torch.testing.assert_close(terms.ratio, rho)


def test_dapo_gradient_is_zero_on_clipped_tokens():
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    old = torch.log(torch.tensor([0.5, 0.5, 2.0, 2.0]))  # ρ = 2, 2, 0.5, 0.5
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    terms = dapo_token_loss(logp, old, adv)
    (g,) = torch.autograd.grad(terms.loss.sum(), logp)
    # ρ=2 > 1.28 with A>0: clipped (no grad); ρ=2 with A<0: unclipped, grad = −A·ρ = 2
    # ρ=0.5 < 0.8 with A>0: unclipped, grad = −A·ρ = −0.5; A<0: clipped (no grad)
    torch.testing.assert_close(g, torch.tensor([0.0, 2.0, -0.5, 0.0]))


@pytest.mark.parametrize("shape", SHAPES)
def test_prime_dppo_matches_reference(shape):
    g = torch.Generator().manual_seed(7 + sum(shape))
    logp = (-torch.rand(shape, generator=g) * 2).requires_grad_()
    inf = (logp.detach() + 0.6 * torch.randn(shape, generator=g)).clamp(max=0.0)
    adv = torch.randn(shape, generator=g)
    terms = prime_dppo_token_loss(logp, inf, adv, delta_low=0.2, delta_high=0.2, kl_tau=1e-3)
    ref = []
    for lp, li, a in zip(logp.detach().reshape(-1).tolist(), inf.reshape(-1).tolist(), adv.reshape(-1).tolist()):
        log_r = lp - li
        dp = math.exp(lp) - math.exp(li)
        keep = not ((a > 0 and dp > 0.2) or (a < 0 and dp < -0.2))
        ref.append(-(1.0 if keep else 0.0) * a * math.exp(log_r) + 1e-3 * log_r**2)
    torch.testing.assert_close(terms.loss.double().reshape(-1), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    assert terms.clipped.any() and (~terms.clipped).any()
    # gradient of the reference formula by autograd on float64 copies
    lp64 = logp.detach().double().requires_grad_()
    log_r = lp64 - inf.double()
    dp = lp64.detach().exp() - inf.double().exp()
    keep = ~(((adv > 0) & (dp > 0.2)) | ((adv < 0) & (dp < -0.2)))
    (-(keep.double()) * adv.double() * log_r.exp() + 1e-3 * log_r**2).sum().backward()
    (g_got,) = torch.autograd.grad(terms.loss.sum(), logp)
    torch.testing.assert_close(g_got.double(), lp64.grad, atol=1e-5, rtol=1e-5)
