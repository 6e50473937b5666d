"""DPO / SimPO / RPO's NLL anchor vs the published formulas; gradient signs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from composer_mesh.configs.loader import ConfigError, load_config
from composer_mesh.configs.sections.loss import LossConfig, PreferenceLossConfig
from composer_mesh.losses.composer import PreferenceInputs, compose_loss, summarize_metrics
from composer_mesh.losses.preference import (
    dpo_loss,
    ipo_loss,
    rpo_nll,
    sequence_logprobs,
    sequence_mean_logprobs,
    simpo_loss,
)

SHAPES = [(2, 5), (3, 17), (5, 40)]  # (pairs, tokens)


def _seq(shape, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=g) * 4
    mask = torch.rand(shape, generator=g) > 0.3
    mask[:, 0] = True
    return logp, mask


@pytest.mark.parametrize("shape", SHAPES)
def test_sequence_helpers(shape):
    logp, mask = _seq(shape, seed=shape[1])
    for b in range(shape[0]):
        vals = [logp[b, t].item() for t in range(shape[1]) if mask[b, t]]
        assert sequence_logprobs(logp, mask)[b].item() == pytest.approx(sum(vals), abs=1e-5)
        assert sequence_mean_logprobs(logp, mask)[b].item() == pytest.approx(sum(vals) / len(vals), abs=1e-5)
    assert sequence_mean_logprobs(logp, torch.zeros_like(mask))[0].item() == 0.0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_reference_and_gradient_signs(shape, beta):
    (lw, mw), (ll, ml) = _seq(shape, 1), _seq(shape, 2)
    lw.requires_grad_()
    ll.requires_grad_()
    pw, pl = sequence_logprobs(lw, mw), sequence_logprobs(ll, ml)
    g = torch.Generator().manual_seed(3)
    rw, rl = pw.detach() + torch.randn(shape[0], generator=g), pl.detach() + torch.randn(shape[0], generator=g)
    loss, margin = dpo_loss(pw, pl, rw, rl, beta)
    for i in range(shape[0]):
        delta = (pw[i].item() - rw[i].item()) - (pl[i].item() - rl[i].item())
        assert loss[i].item() == pytest.approx(-math.log(1 / (1 + math.exp(-beta * delta))), abs=1e-5)
        assert margin[i].item() == pytest.approx(beta * delta, abs=1e-5)
    gw, gl = torch.autograd.grad(loss.sum(), [lw, ll])
    # raising a chosen token's logprob lowers the loss; raising a rejected one raises it
    assert (gw[mw] < 0).all() and (gl[ml] > 0).all()
    assert (gw[~mw] == 0).all() and (gl[~ml] == 0).all()
    # magnitude: dL/dlogp_w = −β σ(−βΔ)
    sig = torch.sigmoid(-margin)
    torch.testing.assert_close(gw[mw], (-beta * sig).unsqueeze(-1).expand_as(mw)[mw], atol=1e-6, rtol=1e-5)


def test_dpo_reference_logprobs_get_no_gradient():
    pw, pl = torch.tensor([-3.0], requires_grad=True), torch.tensor([-4.0], requires_grad=True)
    rw, rl = torch.tensor([-3.5], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
    dpo_loss(pw, pl, rw, rl, 0.1)[0].sum().backward()
    assert rw.grad is None and rl.grad is None


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (2.5, 1.4), (1.0, 0.0)])
def test_simpo_matches_reference_and_gradient_signs(shape, beta, gamma):
    (lw, mw), (ll, ml) = _seq(shape, 4), _seq(shape, 5)
    lw.requires_grad_()
    ll.requires_grad_()
    aw, al = sequence_mean_logprobs(lw, mw), sequence_mean_logprobs(ll, ml)
    loss, _ = simpo_loss(aw, al, beta, gamma)
    for i in range(shape[0]):
        avg_w = lw[i][mw[i]].mean().item()
        avg_l = ll[i][ml[i]].mean().item()
        z = beta * (avg_w - avg_l) - gamma
        assert loss[i].item() == pytest.approx(math.log1p(math.exp(-z)), abs=1e-5)
    gw, gl = torch.autograd.grad(loss.sum(), [lw, ll])
    assert (gw[mw] < 0).all() and (gl[ml] > 0).all()
    # length-averaged: each chosen token gets −β σ(−z) / |y_w|
    z = beta * (aw - al) - gamma
    want = (-beta * torch.sigmoid(-z) / mw.sum(-1)).unsqueeze(-1).expand_as(mw)
    torch.testing.assert_close(gw[mw], want[mw], atol=1e-6, rtol=1e-5)
    # a larger margin γ makes the loss larger
    assert (simpo_loss(aw, al, beta, gamma + 1.0)[0] > loss).all()


def test_label_smoothing_and_ipo_formulas():
    """cDPO: ε = 0 is plain DPO, the loss is minimal where σ(m) = 1−ε (not at m → ∞); IPO's
    minimum is at Δ = 1/(2β); SimPO smoothing is the same mixture on SimPO's margin."""
    g = torch.Generator().manual_seed(11)
    pw, pl, rw, rl = (-torch.rand(6, generator=g, dtype=torch.float64) * 30 for _ in range(4))
    plain, m = dpo_loss(pw, pl, rw, rl, 0.2)
    assert torch.equal(dpo_loss(pw, pl, rw, rl, 0.2, 0.0)[0], plain)
    eps = 0.15
    smooth, _ = dpo_loss(pw, pl, rw, rl, 0.2, eps)
    want = -(1 - eps) * torch.log(torch.sigmoid(m)) - eps * torch.log(torch.sigmoid(-m))
    torch.testing.assert_close(smooth, want, rtol=1e-10, atol=1e-12)
    best = math.log((1 - eps) / eps) / 0.2  # σ(βΔ*) = 1−ε
    x = torch.tensor([best], dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(dpo_loss(x, torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.2, eps)[0].sum(), x)
    assert abs(gx.item()) < 1e-12
    x = torch.tensor([1 / (2 * 0.2)], dtype=torch.float64, requires_grad=True)
    loss, delta = ipo_loss(x, torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.2)
    assert loss.item() == 0.0 and delta.item() == pytest.approx(2.5)
    (s_loss, s_m) = simpo_loss(pw / 7, pl / 9, 2.0, 0.5, 0.25)
    torch.testing.assert_close(s_loss, -0.75 * torch.log(torch.sigmoid(s_m)) - 0.25 * torch.log(torch.sigmoid(-s_m)))
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pw, pl, rw, rl, 0.2, 0.5)


@pytest.mark.parametrize(("overrides", "match"), [
    (["--loss.preference.label_smoothing=0.5"], r"loss\.preference\.label_smoothing"),
    (["--loss.preference.kind=orpo"], r"loss\.preference\.kind"),
    (["--loss.preference.kind=ipo", "--loss.preference.label_smoothing=0.1"], r"\[loss\.preference\].*label_smoothing"),
])
def test_preference_keys_are_validated(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_ipo_reaches_the_reference_policy():
    job = load_config(None, ["--loss.preference.kind=ipo"])
    assert job.loss.preference.needs_reference and not load_config(
        None, ["--loss.preference.kind=simpo"]).loss.preference.needs_reference


# --- RPO's NLL anchor through the channel, against the formula written out here ---

V_RPO, D_RPO = 37, 8


def _pair_batch(P, T, seed):
    g = torch.Generator().manual_seed(seed)
    masks = [torch.rand(P, T, generator=g) > 0.3 for _ in range(2)]
    for m in masks:
        m[:, 0] = True
    return PreferenceInputs(
        torch.randn(P, T, D_RPO, generator=g), torch.randint(0, V_RPO, (P, T), generator=g), masks[0],
        torch.randn(P, T, D_RPO, generator=g), torch.randint(0, V_RPO, (P, T), generator=g), masks[1],
        num_pairs=P,
        ref_chosen_logps_P=-torch.rand(P, generator=g) * 30, ref_rejected_logps_P=-torch.rand(P, generator=g) * 30,
    )


def _rpo_reference(kind, w_VD, x, nll_weight, beta, gamma=0.0):
    """Pang et al. 2024 Eq. 3 with the pair loss of `kind`: mean over pairs of
    ℓ_pair − nll_weight · log π(y_w|x) / |y_w| (DPO: −log σ(β[(π_w − ref_w) − (π_l − ref_l)]);
    SimPO: −log σ(β(π_w/|y_w| − π_l/|y_l|) − γ)), in float64 with full logits; also the mean NLL and the
    mean over pairs of log π(y_w|x)/|y_w| and log π(y_l|x)/|y_l|."""
    total, nll_total, chosen_total, rejected_total = 0.0, 0.0, 0.0, 0.0
    for p in range(x.chosen_mask_BT.shape[0]):
        sums, lens = [], []
        for h, y, m in ((x.chosen_hidden_BTD, x.chosen_labels_BT, x.chosen_mask_BT),
                        (x.rejected_hidden_BTD, x.rejected_labels_BT, x.rejected_mask_BT)):
            logp_TV = torch.log_softmax(h[p].double() @ w_VD.double().T, dim=-1)
            tokens = [logp_TV[t, y[p, t]] for t in range(y.shape[1]) if m[p, t]]
            sums.append(sum(tokens))
            lens.append(len(tokens))
        (c, r), (n_c, n_r) = sums, lens
        if kind == "dpo":
            z = beta * ((c - x.ref_chosen_logps_P[p].double()) - (r - x.ref_rejected_logps_P[p].double()))
        else:
            z = beta * (c / n_c - r / n_r) - gamma
        nll = -c / n_c
        total = total - torch.log(torch.sigmoid(z)) + nll_weight * nll
        nll_total = nll_total + nll.detach()
        chosen_total, rejected_total = chosen_total + (c / n_c).detach(), rejected_total + (r / n_r).detach()
    P = x.chosen_mask_BT.shape[0]
    return total / P, nll_total / P, chosen_total / P, rejected_total / P


def _leaves(x):
    for h in (x.chosen_hidden_BTD, x.rejected_hidden_BTD):
        h.requires_grad_()
    return [x.chosen_hidden_BTD, x.rejected_hidden_BTD]


# chunked False: full logits; chunk_tokens=4: the fused pair pass plus the NLL pass; 0: per-token stats, recomputed
LOSS_PATHS = [dict(chunked=False), dict(chunked=True, chunk_tokens=4), dict(chunked=True, chunk_tokens=0)]


@pytest.mark.parametrize("path", LOSS_PATHS)
@pytest.mark.parametrize("kind", ["dpo", "simpo"])
@pytest.mark.parametrize("nll_weight", [0.0, 0.7])
@pytest.mark.parametrize("shape", [(1, 9), (3, 13)])
def test_rpo_nll_anchor_matches_the_formula(path, kind, nll_weight, shape):
    x = _pair_batch(*shape, seed=sum(shape) + int(10 * nll_weight))
    leaves = _leaves(x)
    w = (torch.randn(V_RPO, D_RPO, generator=torch.Generator().manual_seed(4)) / D_RPO**0.5).requires_grad_()
    pref = PreferenceLossConfig(kind=kind, dpo_beta=0.3, simpo_beta=2.0, simpo_gamma=0.5, nll_weight=nll_weight)
    cfg = LossConfig(**path, preference=pref)
    out = compose_loss(cfg, w, preference=x)
    beta = 0.3 if kind == "dpo" else 2.0
    ref, ref_nll, ref_chosen, ref_rejected = _rpo_reference(kind, w, x, nll_weight, beta,
                                                            0.5 if kind == "simpo" else 0.0)
    torch.testing.assert_close(out.loss.double(), ref, atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(out.loss, [w, *leaves])
    want = torch.autograd.grad(ref, [w, *leaves])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)
    # the likelihood curves docs/recipe.md reads the anchor's effect from, on every path
    summary = summarize_metrics(out.metrics)
    assert summary["preference/chosen_logp_mean"] == pytest.approx(float(ref_chosen), abs=1e-5)
    assert summary["preference/rejected_logp_mean"] == pytest.approx(float(ref_rejected), abs=1e-5)
    if nll_weight:
        assert summary["preference/nll_mean"] == pytest.approx(float(ref_nll), abs=1e-5)
    else:
        # off: no NLL term, no NLL metric, and the same number as a config that never names the key
        assert "preference/nll_sum" not in out.metrics
        plain = compose_loss(LossConfig(**path, preference=dataclasses.replace(pref, nll_weight=0.0)), w,
                             preference=x)
        assert torch.equal(plain.loss, out.loss)


def test_rpo_nll_is_the_chosen_per_token_mean():
    logp, mask = _seq((3, 11), seed=9)
    got = rpo_nll(sequence_logprobs(logp, mask), mask.sum(-1).float())
    for b in range(3):
        vals = [logp[b, t].item() for t in range(11) if mask[b, t]]
        assert got[b].item() == pytest.approx(-sum(vals) / len(vals), abs=1e-6)


def test_nll_weight_is_validated():
    with pytest.raises(ConfigError, match=r"loss\.preference\.nll_weight"):
        load_config(None, ["--loss.preference.nll_weight=-0.5"])
    assert load_config(None, ["--loss.preference.nll_weight=1.0"]).loss.preference.nll_weight == 1.0
    assert load_config(None, []).loss.preference.nll_weight == 0.0


# --- the DPO-weight filter (`[loss.preference] min_weight`) ---


def _weighted_reference(kind, w_VD, x, nll_weight, beta, gamma, min_weight):
    """Per pair, in float64 with full logits: the kind's loss ℓ_p (+ nll_weight·NLL), its DPO weight
    ω_p = σ(−m_p) with m_p = β·Δ_p (DPO), β·Δ_p on length averages (IPO, as TRL), β·(avg_w − avg_l) − γ (SimPO);
    the channel is Σ_p [ω_p ≥ min_weight]·(ℓ_p + nll_weight·NLL_p) / P. Returns (loss, weights)."""
    total, weights = 0.0, []
    for p in range(x.chosen_mask_BT.shape[0]):
        sums, lens = [], []
        for h, y, m in ((x.chosen_hidden_BTD, x.chosen_labels_BT, x.chosen_mask_BT),
                        (x.rejected_hidden_BTD, x.rejected_labels_BT, x.rejected_mask_BT)):
            logp_TV = torch.log_softmax(h[p].double() @ w_VD.double().T, dim=-1)
            sums.append(sum(logp_TV[t, y[p, t]] for t in range(y.shape[1]) if m[p, t]))
            lens.append(int(m[p].sum()))
        (c, r), (n_c, n_r) = sums, lens
        ref_c, ref_r = x.ref_chosen_logps_P[p].double(), x.ref_rejected_logps_P[p].double()
        if kind == "dpo":
            margin = beta * ((c - ref_c) - (r - ref_r))
            loss = -torch.log(torch.sigmoid(margin))
        elif kind == "ipo":
            delta = (c - ref_c) / n_c - (r - ref_r) / n_r
            margin = beta * delta
            loss = (delta - 1 / (2 * beta)) ** 2
        else:
            margin = beta * (c / n_c - r / n_r) - gamma
            loss = -torch.log(torch.sigmoid(margin))
        weight = float(torch.sigmoid(-margin.detach()))
        weights.append(weight)
        if weight >= min_weight:
            total = total + loss + nll_weight * (-c / n_c)
    return total / x.chosen_mask_BT.shape[0], weights


@pytest.mark.parametrize("path", LOSS_PATHS)
@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo"])
@pytest.mark.parametrize("nll_weight", [0.0, 0.7])
def test_min_weight_drops_pairs_without_dpo_gradient(path, kind, nll_weight):
    x = _pair_batch(6, 11, seed=5 + int(10 * nll_weight))
    leaves = _leaves(x)
    w = (torch.randn(V_RPO, D_RPO, generator=torch.Generator().manual_seed(8)) / D_RPO**0.5).requires_grad_()
    beta = {"dpo": 0.3, "ipo": 0.3, "simpo": 2.0}[kind]
    gamma = 0.5 if kind == "simpo" else 0.0
    _, weights = _weighted_reference(kind, w, x, nll_weight, beta, gamma, 0.0)
    ranked = sorted(weights)
    # a threshold between the 3rd and 4th weights: three pairs dropped, three kept
    assert ranked[3] - ranked[2] > 1e-4
    min_weight = (ranked[2] + ranked[3]) / 2
    pref = PreferenceLossConfig(kind=kind, dpo_beta=beta, simpo_beta=beta, simpo_gamma=gamma,
                                nll_weight=nll_weight, min_weight=min_weight)
    out = compose_loss(LossConfig(**path, preference=pref), w, preference=x)
    ref, _ = _weighted_reference(kind, w, x, nll_weight, beta, gamma, min_weight)
    torch.testing.assert_close(out.loss.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out.loss, [w, *leaves]), torch.autograd.grad(ref, [w, *leaves])):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)
    summary = summarize_metrics(out.metrics)
    assert summary["preference/dropped_low_weight"] == 3
    assert summary["preference/weight_mean"] == pytest.approx(sum(weights) / 6, abs=1e-6)
    # off (the default): every pair counts, the same loss as before the key existed
    kept_all = compose_loss(LossConfig(**path, preference=dataclasses.replace(pref, min_weight=0.0)), w, preference=x)
    all_ref, _ = _weighted_reference(kind, w, x, nll_weight, beta, gamma, 0.0)
    torch.testing.assert_close(kept_all.loss.double(), all_ref.detach(), atol=1e-5, rtol=1e-5)
    assert summarize_metrics(kept_all.metrics)["preference/dropped_low_weight"] == 0


def test_min_weight_is_validated():
    with pytest.raises(ConfigError, match=r"loss\.preference\.min_weight"):
        load_config(None, ["--loss.preference.min_weight=1.0"])
    assert load_config(None, []).loss.preference.min_weight == 0.0
