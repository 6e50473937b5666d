"""The shared fused LM-head gradient: label-path chunks and the pair-by-pair preference path.

References are written here from the formulas, in float64 with full logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from composer_mesh.configs.sections.loss import LossConfig
from composer_mesh.losses.composer import PolicyInputs, PreferenceInputs, compose_loss, preference_channel
from composer_mesh.losses.logprobs import FusedHead, fused_token_loss

V, D = 41, 10


def _ref_logprobs(h_TD, w_VD, labels_T):
    """log softmax by hand in float64; 0 at padding labels.  # [T]"""
    z = h_TD.double() @ w_VD.double().T
    logz = z.max(-1, keepdim=True).values
    logz = logz + (z - logz).exp().sum(-1, keepdim=True).log()
    lp = (z - logz).gather(-1, labels_T.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels_T >= 0, lp, torch.zeros_like(lp)), z - logz


def _pairs(P, Tc, Tr, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = PreferenceInputs(
        torch.randn(P, Tc, D, generator=g).requires_grad_(), torch.randint(0, V, (P, Tc), generator=g),
        torch.rand(P, Tc, generator=g) > 0.3,
        torch.randn(P, Tr, D, generator=g).requires_grad_(), torch.randint(0, V, (P, Tr), generator=g),
        torch.rand(P, Tr, generator=g) > 0.3,
        num_pairs=P + 2,  # global count: other microbatches hold more pairs
        ref_chosen_logps_P=-torch.rand(P, generator=g) * 30, ref_rejected_logps_P=-torch.rand(P, generator=g) * 30,
    )
    inputs.chosen_mask_BT[0] = False  # an empty chosen response
    return inputs


def _ref_preference(inputs, w, kind, beta, gamma, eps=0.0, ipo_average=True):
    """Mean per-pair loss from the published formulas: DPO / SimPO with label smoothing ε
    (−(1−ε)·log σ(m) − ε·log σ(−m)), IPO (Δ − 1/(2β))² on length averages (TRL) or sums."""
    sums, lens = [], []
    for h, y, m in ((inputs.chosen_hidden_BTD, inputs.chosen_labels_BT, inputs.chosen_mask_BT),
                    (inputs.rejected_hidden_BTD, inputs.rejected_labels_BT, inputs.rejected_mask_BT)):
        lp = torch.stack([_ref_logprobs(h[p], w, y[p])[0] for p in range(h.shape[0])])
        sums.append((lp * m).sum(-1))
        lens.append(m.sum(-1).clamp(min=1).double())
    (c, r), (nc, nr) = sums, lens
    ref_c, ref_r = inputs.ref_chosen_logps_P.double(), inputs.ref_rejected_logps_P.double()
    if kind == "ipo":
        delta = (c - ref_c) / nc - (r - ref_r) / nr if ipo_average else (c - ref_c) - (r - ref_r)
        return ((delta - 1 / (2 * beta)) ** 2).sum() / inputs.num_pairs
    if kind == "dpo":
        margin = beta * ((c - ref_c) - (r - ref_r))
    else:
        margin = beta * (c / nc - r / nr) - gamma
    return (-(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)).sum() / inputs.num_pairs


# (P, T_chosen, T_rejected), kind, chunk — chunk 3: fused pair by pair; 500: short pairs, recompute
PREF_CASES = [
    ((1, 9, 7), "dpo", 3), ((1, 9, 7), "simpo", 500), ((3, 6, 11), "simpo", 3),
    ((3, 6, 11), "dpo", 500), ((4, 17, 5), "dpo", 3), ((4, 17, 5), "simpo", 500),
]


@pytest.mark.parametrize(("shape", "kind", "chunk"), PREF_CASES)
def test_preference_paths_equal_reference(shape, kind, chunk):
    inputs = _pairs(*shape, seed=sum(shape))
    w = (torch.randn(V, D, generator=torch.Generator().manual_seed(3)) / D**0.5).requires_grad_()
    cfg = LossConfig(chunk_tokens=chunk, beta=0.7)
    cfg = dataclasses.replace(cfg, preference=dataclasses.replace(cfg.preference, kind=kind))
    pref = cfg.preference
    beta = pref.dpo_beta if kind == "dpo" else pref.simpo_beta
    leaves = [w, inputs.chosen_hidden_BTD, inputs.rejected_hidden_BTD]

    ref = 0.7 * _ref_preference(inputs, w, kind, beta, pref.simpo_gamma)
    out = compose_loss(cfg, w, preference=inputs)
    torch.testing.assert_close(out.loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(torch.autograd.grad(out.loss, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)

    # which path ran: the fused one leaves its gradient in the head, the recompute one in a graph
    loss, _ = preference_channel(cfg, w, inputs, head=FusedHead(w))
    assert loss.requires_grad == (chunk == 500)


# (P, T_chosen, T_rejected), kind, chunk, label smoothing, IPO on length averages
OPTION_CASES = [
    ((3, 6, 11), "dpo", 3, 0.2, True), ((4, 17, 5), "dpo", 500, 0.2, True),
    ((3, 6, 11), "simpo", 3, 0.3, True), ((4, 17, 5), "simpo", 500, 0.1, True),
    ((3, 6, 11), "ipo", 3, 0.0, True), ((4, 17, 5), "ipo", 500, 0.0, True),
    ((3, 9, 4), "ipo", 3, 0.0, False), ((1, 9, 7), "ipo", 500, 0.0, False),
]


@pytest.mark.parametrize(("shape", "kind", "chunk", "eps", "ipo_average"), OPTION_CASES)
def test_preference_options_equal_reference_on_both_paths(shape, kind, chunk, eps, ipo_average):
    inputs = _pairs(*shape, seed=3 * sum(shape))
    w = (torch.randn(V, D, generator=torch.Generator().manual_seed(4)) / D**0.5).requires_grad_()
    cfg = LossConfig(chunk_tokens=chunk)
    cfg = dataclasses.replace(cfg, preference=dataclasses.replace(
        cfg.preference, kind=kind, dpo_beta=0.3, label_smoothing=eps, ipo_average=ipo_average))
    beta = cfg.preference.simpo_beta if kind == "simpo" else 0.3
    leaves = [w, inputs.chosen_hidden_BTD, inputs.rejected_hidden_BTD]
    ref = _ref_preference(inputs, w, kind, beta, cfg.preference.simpo_gamma, eps, ipo_average)
    out = compose_loss(cfg, w, preference=inputs)
    torch.testing.assert_close(out.loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(torch.autograd.grad(out.loss, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)
    loss, _ = preference_channel(cfg, w, inputs, head=FusedHead(w))
    assert loss.requires_grad == (chunk == 500)  # both paths ran


def test_pair_gradient_sign_through_the_fused_path():
    """Descending the DPO loss raises the chosen and lowers the rejected sequence logprob."""
    inputs = _pairs(2, 8, 8, seed=4)
    w = (torch.randn(V, D, generator=torch.Generator().manual_seed(5)) / D**0.5).requires_grad_()
    cfg = LossConfig(chunk_tokens=2)
    out = compose_loss(cfg, w, preference=inputs)
    (g_w,) = torch.autograd.grad(out.loss, w)
    w2 = (w - 0.5 * g_w).detach()

    def seq(h, y, m, weight):
        return torch.stack([(_ref_logprobs(h[p], weight, y[p])[0] * m[p]).sum() for p in range(h.shape[0])])

    c = inputs.chosen_hidden_BTD.detach(), inputs.chosen_labels_BT, inputs.chosen_mask_BT
    r = inputs.rejected_hidden_BTD.detach(), inputs.rejected_labels_BT, inputs.rejected_mask_BT
    assert (seq(*c, w2) - seq(*c, w.detach()))[1] > 0  # pair 0 has no chosen tokens
    assert ((seq(*r, w2) - seq(*r, w.detach())) < 0).all()


def test_label_path_logprob_and_entropy_gradients():
    """No teacher: the hand-written d/dlogits (onehot − p, −p⊙(log p + H)) equals float64 autograd."""
    g = torch.Generator().manual_seed(6)
    h = torch.randn(23, D, generator=g).requires_grad_()
    w = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_()
    labels = torch.randint(0, V, (23,), generator=g)
    labels[::4] = -100
    c_lp, c_h = torch.randn(23, generator=g), torch.randn(23, generator=g)

    def loss_fn(stats, sl):
        return (c_lp[sl] * stats.logprobs).sum() + (c_h[sl] * stats.entropy).sum() ** 2 / 4

    lp, logp = _ref_logprobs(h, w, labels)
    ent = -(logp.exp() * logp).sum(-1)
    # the squared entropy term is not token-separable across chunks: one chunk covers all tokens
    ref = (c_lp.double() * lp).sum() + (c_h.double() * ent).sum() ** 2 / 4
    loss, stats = fused_token_loss(h, w, labels, loss_fn, want_entropy=True, chunk_tokens=64)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.entropy.double(), ent.detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(torch.autograd.grad(3.0 * loss, [h, w]), torch.autograd.grad(3.0 * ref, [h, w])):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


def test_channels_share_one_head_and_frozen_inputs_get_no_buffer():
    """Policy + preference through one head: gradients match the full-logits path, and a
    hidden input that needs no gradient gets none (and costs no buffer)."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_()
    policy = PolicyInputs(
        torch.randn(2, 9, D, generator=g), torch.randint(0, V, (2, 9), generator=g),
        torch.rand(2, 9, generator=g) > 0.2, torch.randn(2, generator=g), num_tokens=15,
    )
    inputs = _pairs(2, 7, 6, seed=8)
    outs = []
    for chunked in (False, True):
        out = compose_loss(LossConfig(chunked=chunked, chunk_tokens=4), w, policy=policy, preference=inputs)
        outs.append((out.loss, torch.autograd.grad(out.loss, [w, inputs.chosen_hidden_BTD])))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for x, y in zip(gb, ga):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    head = FusedHead(w)
    assert head.input_grad(policy.hidden_BTD) is None and head.input_grad(inputs.chosen_hidden_BTD) is not None
