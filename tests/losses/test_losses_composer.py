"""Three-channel composition: weights, active channels, microbatch invariance, config twin."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from composer_mesh.configs.sections.loss import LossConfig
from composer_mesh.losses.composer import (
    DistillInputs,
    PolicyInputs,
    PreferenceInputs,
    compose_loss,
    metric_reduce_op,
    summarize_metrics,
)

V, D = 53, 12


def _batch(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mask = lambda: torch.rand(B, T, generator=g) > 0.35  # noqa: E731
    ids = lambda: torch.randint(0, V, (B, T), generator=g)  # noqa: E731
    policy = PolicyInputs(
        r(B, T, D), ids(), mask(), r(B), num_tokens=0,
        old_logprobs_BT=-torch.rand(B, T, generator=g) * 4 - 2, gen_logprobs_BT=-torch.rand(B, T, generator=g) * 4 - 2,
    )
    distill = DistillInputs(r(B, T, D), r(B, T, D), mask(), num_tokens=0)
    preference = PreferenceInputs(
        r(B, T, D), ids(), mask(), r(B, T, D), ids(), mask(), num_pairs=B,
        ref_chosen_logps_P=-torch.rand(B, generator=g) * 40, ref_rejected_logps_P=-torch.rand(B, generator=g) * 40,
    )
    policy.num_tokens = int(policy.mask_BT.sum())
    distill.num_tokens = int(distill.mask_BT.sum())
    return policy, distill, preference


def _split(inputs, sl):
    """Rows `sl` of every batch-shaped tensor; global counts stay as they are."""
    return dataclasses.replace(
        inputs,
        **{f.name: getattr(inputs, f.name)[sl] for f in dataclasses.fields(inputs)
           if torch.is_tensor(getattr(inputs, f.name)) and getattr(inputs, f.name).dim() >= 1},
    )


def _leaves(policy, distill, preference):
    for x in (policy.hidden_BTD, distill.hidden_BTD, preference.chosen_hidden_BTD, preference.rejected_hidden_BTD):
        x.requires_grad_()
    return [policy.hidden_BTD, distill.hidden_BTD, preference.chosen_hidden_BTD, preference.rejected_hidden_BTD]


@pytest.mark.parametrize("kind", ["dapo", "prime_dppo"])
@pytest.mark.parametrize("pref_kind", ["dpo", "simpo"])
def test_microbatches_give_the_same_loss_and_gradients(kind, pref_kind):
    """Split into 1, 2 or 4 microbatches (each with the global counts) and sum: same result."""
    B, T = 4, 9
    cfg = dataclasses.replace(LossConfig(alpha=0.7, beta=0.3, chunk_tokens=5), policy=dataclasses.replace(
        LossConfig().policy, kind=kind, dual_clip_c=3.0), preference=dataclasses.replace(
        LossConfig().preference, kind=pref_kind))
    w = (torch.randn(V, D, generator=torch.Generator().manual_seed(0)) / D**0.5).requires_grad_()
    policy, distill, preference = _batch(B, T, seed=1)
    leaves = _leaves(policy, distill, preference)
    results = []
    for n_micro in (1, 2, 4):
        step = B // n_micro
        total = 0.0
        for i in range(n_micro):
            sl = slice(i * step, (i + 1) * step)
            out = compose_loss(cfg, w, policy=_split(policy, sl), distill=_split(distill, sl),
                               preference=dataclasses.replace(_split(preference, sl), num_pairs=B))
            total = total + out.loss
        grads = torch.autograd.grad(total, [w, *leaves])
        results.append((total.detach(), grads))
    for total, grads in results[1:]:
        torch.testing.assert_close(total, results[0][0], atol=1e-5, rtol=1e-5)
        for a, b in zip(grads, results[0][1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(2, 6), (3, 11), (1, 23)])
@pytest.mark.parametrize("distill_kind", ["jsd", "taid", "eopd"])
def test_chunked_composer_equals_naive(shape, distill_kind):
    policy, distill, preference = _batch(*shape, seed=sum(shape))
    leaves = _leaves(policy, distill, preference)
    w = (torch.randn(V, D, generator=torch.Generator().manual_seed(2)) / D**0.5).requires_grad_()
    outs = []
    for chunked in (False, True):
        cfg = dataclasses.replace(LossConfig(chunked=chunked, chunk_tokens=4),
                                  distill=dataclasses.replace(LossConfig().distill, kind=distill_kind))
        out = compose_loss(cfg, w, policy=policy, distill=distill, preference=preference, taid_t=0.55)
        outs.append((out, torch.autograd.grad(out.loss, [w, *leaves])))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(b.loss, a.loss, atol=1e-5, rtol=1e-5)
    for x, y in zip(gb, ga):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for k in a.metrics:
        torch.testing.assert_close(b.metrics[k], a.metrics[k], atol=1e-5, rtol=1e-5)


def test_total_is_weighted_sum_and_channels_switch_off():
    policy, distill, preference = _batch(2, 7, seed=5)
    w = torch.randn(V, D) / D**0.5
    cfg = LossConfig(policy_weight=0.6, alpha=0.3, beta=2.0, chunk_tokens=3)
    full = compose_loss(cfg, w, policy=policy, distill=distill, preference=preference)
    assert full.active_channels == ("policy", "distill", "preference")
    parts = {
        name: compose_loss(cfg, w, **{name: inputs}).metrics[f"{name}/loss"]  # unweighted channel loss
        for name, inputs in (("policy", policy), ("distill", distill), ("preference", preference))
    }
    torch.testing.assert_close(full.loss, 0.6 * parts["policy"] + 0.3 * parts["distill"] + 2.0 * parts["preference"])
    no_policy = compose_loss(dataclasses.replace(cfg, policy_weight=0.0), w, policy=policy, distill=distill,
                             preference=preference)
    assert no_policy.active_channels == ("distill", "preference") and "policy/loss" not in no_policy.metrics
    torch.testing.assert_close(no_policy.loss, 0.3 * parts["distill"] + 2.0 * parts["preference"])
    for name in ("policy", "distill", "preference"):
        torch.testing.assert_close(full.metrics[f"{name}/loss"], parts[name])
        assert parts[name].abs() > 0
    off = compose_loss(dataclasses.replace(cfg, alpha=0.0), w, policy=policy, distill=distill, preference=preference)
    assert off.active_channels == ("policy", "preference") and "distill/loss" not in off.metrics
    torch.testing.assert_close(off.loss, 0.6 * parts["policy"] + 2.0 * parts["preference"])
    only = compose_loss(cfg, w, distill=distill)
    assert only.active_channels == ("distill",)
    torch.testing.assert_close(only.loss, 0.3 * parts["distill"])
    with pytest.raises(ValueError, match="no loss channel"):
        compose_loss(dataclasses.replace(cfg, alpha=0.0), w, distill=distill)


def test_empty_masks_give_zero_not_nan():
    policy, distill, _ = _batch(2, 5, seed=6)
    policy.mask_BT = torch.zeros_like(policy.mask_BT)
    policy.num_tokens = 0
    distill.mask_BT = torch.zeros_like(distill.mask_BT)
    distill.num_tokens = 0
    w = (torch.randn(V, D) / D**0.5).requires_grad_()
    out = compose_loss(LossConfig(), w, policy=policy, distill=distill)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() == 0


def test_metrics_are_reducible_tensors():
    policy, distill, preference = _batch(3, 8, seed=7)
    out = compose_loss(LossConfig(chunk_tokens=4), torch.randn(V, D) / D**0.5,
                       policy=policy, distill=distill, preference=preference)
    for k, v in out.metrics.items():
        assert torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad, k
    assert metric_reduce_op("policy/ratio_max") == "max" and metric_reduce_op("policy/ratio_sum") == "sum"
    s = summarize_metrics(out.metrics)
    n = policy.mask_BT.sum().item()
    assert s["policy/tokens"] == n and 0.0 <= s["policy/clipped_mean"] <= 1.0
    assert s["policy/ratio_mean"] <= s["policy/ratio_max"] and s["policy/entropy_mean"] > 0
    assert {"policy/kl_k3_mean", "policy/mismatch_k3_mean", "distill/divergence_mean",
            "preference/accuracy_mean", "preference/margin_mean", "loss"} <= set(s)


def test_bad_inputs_are_named():
    policy, distill, preference = _batch(2, 5, seed=8)
    w = torch.randn(V, D)
    prime = dataclasses.replace(LossConfig(), policy=dataclasses.replace(LossConfig().policy, kind="prime_dppo"))
    with pytest.raises(ValueError, match="gen_logprobs"):
        compose_loss(prime, w, policy=dataclasses.replace(policy, gen_logprobs_BT=None))
    with pytest.raises(ValueError, match="ref_chosen"):
        compose_loss(LossConfig(), w, preference=dataclasses.replace(preference, ref_chosen_logps_P=None))
    ipo = dataclasses.replace(LossConfig(), preference=dataclasses.replace(LossConfig().preference, kind="ipo"))
    with pytest.raises(ValueError, match="ipo needs ref_chosen"):
        compose_loss(ipo, w, preference=dataclasses.replace(preference, ref_rejected_logps_P=None))
    with pytest.raises(ValueError, match="aligned"):
        compose_loss(LossConfig(), w, distill=dataclasses.replace(distill, teacher_hidden_BTD=distill.teacher_hidden_BTD[:, :3]))
    with pytest.raises(ValueError, match="policy mask"):
        compose_loss(LossConfig(), w, policy=dataclasses.replace(policy, mask_BT=policy.mask_BT[:, :2]))


def test_loss_section_options_are_documented():
    for f in dataclasses.fields(LossConfig):
        assert f.metadata["doc"], f.name
    assert LossConfig(policy_weight=0.0).policy_weight == 0.0
    with pytest.raises(ValueError, match="all 0"):
        LossConfig(policy_weight=0.0, alpha=0.0, beta=0.0)
