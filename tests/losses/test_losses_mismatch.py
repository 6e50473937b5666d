"""Mismatch correction (IS / rejection / veto), the log-ratio clamp and PRIME-RL's adv_tau,
against references written here from TRL's and verl's published code paths (float64 loops),
per token and through both LM-head paths of the composer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from composer_mesh.configs.loader import ConfigError, load_config
from composer_mesh.configs.sections.loss import LossConfig, PolicyLossConfig
from composer_mesh.losses.composer import PolicyInputs, compose_loss
from composer_mesh.losses.mismatch import mismatch_weights, packed_sequence_ids
from composer_mesh.losses.policy import dapo_token_loss, prime_dppo_token_loss

V, D = 37, 8


def _tokens(n: int, n_seq: int, seed: int, scale: float = 0.6):
    """float64 logprob pairs and a shuffled, gappy sequence index (ids 3·s + 1, not sorted)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    gen = old - scale * torch.randn(n, generator=g, dtype=torch.float64)
    seq = torch.randint(0, n_seq, (n,), generator=g)
    seq[:n_seq] = torch.arange(n_seq)  # every sequence has a token
    return old, gen, seq[torch.randperm(n, generator=g)]


def _groups(seq):
    out: dict[int, list[int]] = {}
    for i, s in enumerate(seq.tolist()):
        out.setdefault(s, []).append(i)
    return out


def trl_ref(old, gen, seq, mode, c_min, c_max):
    """TRL GRPOTrainer `vllm_importance_sampling_mode` (grpo_trainer.py, 2026): ratio exp(d) per
    token or exp(Σ d) per sequence; *_truncate clamps to [C_min, C_max], *_mask zeroes outside."""
    d = (old - gen).tolist()
    ratio = [0.0] * len(d)
    for idx in _groups(seq).values():
        for i in idx:
            ratio[i] = math.exp(sum(d[j] for j in idx)) if mode.startswith("sequence") else math.exp(d[i])
    out = []
    for r in ratio:
        if mode.endswith("truncate"):
            out.append(min(max(r, c_min if c_min is not None else -math.inf), c_max))
        else:
            bad = r < (c_min if c_min is not None else -math.inf) or r > c_max
            out.append(0.0 if bad else r)
    return torch.tensor(out, dtype=torch.float64)


def verl_ref(old, gen, seq, is_level, is_cap, rs_level, rs_max, rs_min, veto):
    """verl rollout correction (rollout_corr_helper.py): truncated IS weight (token / sequence
    product) × rejection mask (token / sequence product / geometric mean in [lower, upper],
    lower = 1/upper by default) × per-token veto of whole sequences."""
    d = (old - gen).tolist()
    lower = 1.0 / rs_max if rs_min is None else rs_min
    out = [0.0] * len(d)
    for idx in _groups(seq).values():
        total = sum(d[j] for j in idx)
        vetoed = veto is not None and any(d[j] < math.log(veto) for j in idx)
        for i in idx:
            w = {"token": math.exp(d[i]), "sequence": math.exp(total), "none": 1.0}[is_level]
            w = min(w, is_cap) if is_level != "none" and is_cap is not None else w
            stat = {"token": math.exp(d[i]), "sequence": math.exp(total), "geometric": math.exp(total / len(idx))}
            keep = rs_level == "none" or lower <= stat[rs_level] <= rs_max
            out[i] = w if keep and not vetoed else 0.0
    return torch.tensor(out, dtype=torch.float64)


TRL_MODES = {  # TRL mode -> the same correction as this project's keys
    "token_truncate": lambda lo, hi: PolicyLossConfig(is_level="token", tis_cap=hi, tis_floor=lo),
    "token_mask": lambda lo, hi: PolicyLossConfig(is_level="token", tis_cap=None, rs_level="token", rs_max=hi, rs_min=lo or 0.0),
    "sequence_truncate": lambda lo, hi: PolicyLossConfig(is_level="sequence", tis_cap=hi, tis_floor=lo),
    "sequence_mask": lambda lo, hi: PolicyLossConfig(is_level="sequence", tis_cap=None, rs_level="sequence", rs_max=hi, rs_min=lo or 0.0),
}


@pytest.mark.parametrize("mode", list(TRL_MODES))
@pytest.mark.parametrize(("c_min", "c_max"), [(None, 3.0), (0.5, 1.5)])
def test_trl_modes_match_trl_reference(mode, c_min, c_max):
    old, gen, seq = _tokens(90, 9, seed=len(mode) + int(c_max))
    got = mismatch_weights(old, gen, seq, TRL_MODES[mode](c_min, c_max))
    want = trl_ref(old, gen, seq, mode, c_min, c_max)
    torch.testing.assert_close(got.weight, want, atol=1e-12, rtol=1e-10)
    if mode.endswith("mask"):  # the inputs reach both sides of the thresholds
        assert got.rejected.any() and (~got.rejected).any()
        assert torch.equal(got.rejected, want == 0)


@pytest.mark.parametrize("is_level", ["token", "sequence", "none"])
@pytest.mark.parametrize("rs_level", ["none", "token", "sequence", "geometric"])
@pytest.mark.parametrize("veto", [None, 0.4])
def test_verl_is_rs_and_veto_match_verl_reference(is_level, rs_level, veto):
    old, gen, seq = _tokens(120, 11, seed=3, scale=0.5)
    rs_max = 4.0 if rs_level == "sequence" else 1.3
    cfg = PolicyLossConfig(is_level=is_level, rs_level=rs_level, rs_max=rs_max, rs_veto=veto)
    got = mismatch_weights(old, gen, seq, cfg)
    want = verl_ref(old, gen, seq, is_level, 2.0, rs_level, rs_max, None, veto)
    torch.testing.assert_close(got.weight, want, atol=1e-12, rtol=1e-10)
    if rs_level != "none" or veto is not None:
        assert got.rejected.any() and (~got.rejected).any()


def test_extreme_sequences_stay_finite_and_are_rejected_or_capped():
    """Σ log m far past ±20 (a 400-token rollout 0.3 nats off per token): verl clamps the sum
    before exp; truncation caps it, masking drops it, nothing is inf or NaN."""
    old = torch.zeros(400, dtype=torch.float64)  # Σ log m = +60 (first rollout), −60 (second)
    seq = torch.zeros(400, dtype=torch.long)
    seq[200:] = 1
    gen = torch.cat([torch.full((200,), -0.3, dtype=torch.float64), torch.full((200,), 0.3, dtype=torch.float64)])
    trunc = mismatch_weights(old, gen, seq, PolicyLossConfig(is_level="sequence", tis_cap=5.0))
    want = torch.cat([torch.full((200,), 5.0, dtype=torch.float64), torch.full((200,), math.exp(-20), dtype=torch.float64)])
    torch.testing.assert_close(trunc.weight, want, rtol=1e-12, atol=0)
    masked = mismatch_weights(old, gen, seq, PolicyLossConfig(is_level="sequence", tis_cap=None, rs_level="sequence", rs_max=5.0, rs_min=0.0))
    assert masked.rejected[:200].all() and not masked.rejected[200:].any()
    assert torch.isfinite(masked.weight).all()


def test_sequence_modes_need_sequence_ids():
    old, gen, _ = _tokens(10, 2, seed=1)
    with pytest.raises(ValueError, match="sequence index"):
        mismatch_weights(old, gen, None, PolicyLossConfig(is_level="sequence"))
    w = torch.randn(V, D)
    inputs = _policy_inputs(seed=2, on_policy=True, w=w)
    cfg = dataclasses.replace(LossConfig(), policy=dataclasses.replace(LossConfig().policy, is_level="sequence"))
    with pytest.raises(ValueError, match="seq_ids_BT must be"):
        compose_loss(cfg, w, policy=dataclasses.replace(inputs, seq_ids_BT=inputs.seq_ids_BT[:, :5]))


# --- log-ratio clamp -------------------------------------------------------------------


def test_log_ratio_clamp_keeps_huge_ratios_finite():
    """|log r| in [60, 120], Â < 0, no dual clip: unclamped, exp(log r) overflows fp32 and the
    loss is inf; clamped at 20 (verl) loss and gradient are finite and equal the formula."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(64, generator=g) * 3).requires_grad_()
    sign = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)
    old = logp.detach() - sign * (60 + 60 * torch.rand(64, generator=g))
    adv = -0.1 - torch.rand(64, generator=g)
    adv[::4] *= -1  # some Â > 0 too
    assert not torch.isfinite(dapo_token_loss(logp, old, adv, log_ratio_clamp=None).loss).all()
    terms = dapo_token_loss(logp, old, adv)
    (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
    assert torch.isfinite(terms.loss).all() and torch.isfinite(grad).all()
    r = (logp.detach().double() - old.double()).clamp(-20, 20).exp()
    a = adv.double()
    want = torch.maximum(-a * r, -a * r.clamp(0.8, 1.28))
    torch.testing.assert_close(terms.loss.double(), want, rtol=1e-5, atol=0)
    assert (grad == 0).all()  # every |log r| > 20: outside the clamp, no gradient (verl's behaviour)
    prime = prime_dppo_token_loss(logp, old, adv)
    assert torch.isfinite(prime.loss).all()
    # the same through the composer, full-logits and chunked heads: π_old 60-120 nats below π_θ
    w = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_()
    h = torch.randn(2, 12, D, generator=g).requires_grad_()
    inputs = PolicyInputs(h, torch.randint(0, V, (2, 12), generator=g), torch.ones(2, 12, dtype=torch.bool),
                          -0.5 - torch.rand(2, generator=g), 24, old_logprobs_BT=-60 - 60 * torch.rand(2, 12, generator=g))
    outs = []
    for chunked in (False, True):
        out = compose_loss(LossConfig(chunked=chunked, chunk_tokens=5), w, policy=inputs)
        grads = torch.autograd.grad(out.loss, [w, h])
        assert torch.isfinite(out.loss) and out.loss > 1e7 and all(torch.isfinite(x).all() for x in grads)
        outs.append((out.loss, grads))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    unclamped = dataclasses.replace(LossConfig(), policy=dataclasses.replace(LossConfig().policy, log_ratio_clamp=None))
    assert torch.isinf(compose_loss(unclamped, w, policy=inputs).loss)


# --- through the composer: both LM-head paths, packed rows ------------------------------


def _ref_logprobs(h_nD, w_VD, y_n):
    return (h_nD.double() @ w_VD.double().T).log_softmax(-1).gather(-1, y_n.unsqueeze(-1)).squeeze(-1)


def ref_policy_channel(cfg: LossConfig, w, inputs: PolicyInputs, seq_ids_BT):
    """Σ_valid ℓ_t / N in float64 from full logits: DAPO × verl-style mismatch weight, or
    PRIME-RL's −keep·τ_A·Â·r + τ_KL·(log r)²."""
    p = cfg.policy
    mask = inputs.mask_BT
    logp = _ref_logprobs(inputs.hidden_BTD[mask], w, inputs.labels_BT[mask])
    adv = inputs.advantages[mask].double()  # [B, T] per-token advantages
    gen = inputs.gen_logprobs_BT[mask].double()
    if p.kind == "prime_dppo":
        log_r = logp - gen
        dp = (logp.detach().exp() - gen.exp())
        keep = ~(((adv > 0) & (dp > p.dppo_delta_high)) | ((adv < 0) & (dp < -p.dppo_delta_low)))
        loss = -keep.double() * p.adv_tau * adv * log_r.clamp(-20, 20).exp() + p.kl_tau * log_r**2
        return loss.sum() / inputs.num_tokens
    old = logp.detach() if inputs.old_logprobs_BT is None else inputs.old_logprobs_BT[mask].double()
    weight = verl_ref(old, gen, seq_ids_BT[mask], p.is_level, p.tis_cap, p.rs_level, p.rs_max, p.rs_min, p.rs_veto)
    r = (logp - old).clamp(-20, 20).exp()
    loss = torch.maximum(-adv * r, -adv * r.clamp(1 - p.eps_low, 1 + p.eps_high)) * weight
    return loss.sum() / inputs.num_tokens


# row 0 packs two rollouts (positions restart at 0), row 1 holds one
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(12))])


def _policy_inputs(seed, on_policy, w):
    """log m = logπ_old − logπ_gen per rollout: +0.6 (rollout A), −0.05 (B, one token −1.5), +0.1 (C),
    ± 0.3 noise: every rejection rule below keeps some tokens and drops others."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(2, 12, generator=g) > 0.2
    mask[:, 0] = False  # prompt tokens
    mask[0, 8] = True
    inputs = PolicyInputs(
        torch.randn(2, 12, D, generator=g).requires_grad_(), torch.randint(0, V, (2, 12), generator=g), mask,
        torch.randn(2, 12, generator=g), num_tokens=int(mask.sum()) + 3, seq_ids_BT=packed_sequence_ids(POSITIONS),
    )
    log_m = torch.tensor([[0.6] * 5 + [-0.05] * 7, [0.1] * 12]) + 0.3 * torch.randn(2, 12, generator=g)
    log_m[0, 8] = -1.5
    current = _ref_logprobs(inputs.hidden_BTD.detach().reshape(-1, D), w.detach(), inputs.labels_BT.reshape(-1))
    old = current.view(2, 12).float() + (0.0 if on_policy else 0.5 * torch.randn(2, 12, generator=g))
    inputs.gen_logprobs_BT = old - log_m
    inputs.old_logprobs_BT = None if on_policy else old
    return inputs


POLICY_CASES = [  # (policy overrides, on_policy)
    (dict(is_level="sequence", tis_cap=50.0), True),
    (dict(is_level="token", tis_cap=2.0, rs_level="geometric", rs_max=1.5), True),
    (dict(is_level="token", tis_cap=None, rs_level="token", rs_max=1.5, rs_min=0.0), False),  # TRL token_mask
    (dict(is_level="sequence", tis_cap=None, rs_level="sequence", rs_max=3.0, rs_min=0.0), False),
    (dict(is_level="none", rs_veto=0.5), True),
    (dict(kind="prime_dppo", adv_tau=0.5), False),
    (dict(kind="prime_dppo", adv_tau=0.0), False),
]


@pytest.mark.parametrize(("overrides", "on_policy"), POLICY_CASES)
def test_policy_channel_options_equal_reference_on_both_paths(overrides, on_policy):
    w = (torch.randn(V, D, generator=torch.Generator().manual_seed(9)) / D**0.5).requires_grad_()
    inputs = _policy_inputs(seed=len(overrides) + on_policy, on_policy=on_policy, w=w)
    ids = packed_sequence_ids(POSITIONS)
    assert ids[0, :5].unique().numel() == 1 and ids[0, 5:].unique().numel() == 1 and ids[0, 0] != ids[0, 5]
    base = LossConfig()
    ref = ref_policy_channel(dataclasses.replace(base, policy=dataclasses.replace(base.policy, **overrides)),
                             w, inputs, ids)
    want = torch.autograd.grad(ref, [w, inputs.hidden_BTD])
    for chunked in (False, True):
        cfg = dataclasses.replace(base, chunked=chunked, chunk_tokens=5,
                                  policy=dataclasses.replace(base.policy, **overrides))
        out = compose_loss(cfg, w, policy=inputs)
        torch.testing.assert_close(out.loss.double(), ref.detach(), atol=1e-6, rtol=1e-5)
        for got, exp in zip(torch.autograd.grad(out.loss, [w, inputs.hidden_BTD]), want):
            torch.testing.assert_close(got.double(), exp.double(), atol=1e-6, rtol=1e-5)
        if "rs_level" in overrides or "rs_veto" in overrides:
            assert 0 < out.metrics["policy/rejected_sum"] < out.metrics["policy/tokens"]


def test_packing_does_not_change_sequence_level_weights():
    """The same three rollouts packed two-in-a-row or one per row: same loss and gradient."""
    w = torch.randn(V, D, generator=torch.Generator().manual_seed(2)) / D**0.5
    inputs = _policy_inputs(seed=4, on_policy=True, w=w)
    cfg = dataclasses.replace(LossConfig(chunk_tokens=4), policy=dataclasses.replace(
        LossConfig().policy, is_level="sequence", tis_cap=50.0, rs_level="geometric", rs_max=1.5))
    rows = [(0, slice(0, 5)), (0, slice(5, 12)), (1, slice(0, 12))]

    def pad(t, fill):  # one rollout per row, right-padded to 12
        out = torch.full((3, 12, *t.shape[2:]), fill, dtype=t.dtype)
        for i, (b, sl) in enumerate(rows):
            out[i, : sl.stop - sl.start] = t[b, sl]
        return out

    unpacked = PolicyInputs(
        pad(inputs.hidden_BTD.detach(), 0.0).requires_grad_(), pad(inputs.labels_BT, 0), pad(inputs.mask_BT, False),
        pad(inputs.advantages, 0.0), inputs.num_tokens, gen_logprobs_BT=pad(inputs.gen_logprobs_BT, 0.0),
    )
    a = compose_loss(cfg, w, policy=inputs)
    b = compose_loss(cfg, w, policy=unpacked)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-6, rtol=1e-6)
    (ga,) = torch.autograd.grad(a.loss, inputs.hidden_BTD)
    (gb,) = torch.autograd.grad(b.loss, unpacked.hidden_BTD)
    torch.testing.assert_close(torch.cat([ga[0, :5], ga[0, 5:], ga[1]]), torch.cat([gb[0, :5], gb[1, :7], gb[2]]))
    # without the ids the packed row is one sequence: a different weight
    c = compose_loss(cfg, w, policy=dataclasses.replace(inputs, seq_ids_BT=None))
    assert not torch.allclose(a.loss, c.loss)


# --- config keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(("override", "key"), [
    ("--loss.policy.is_level=seq", "loss.policy.is_level"),
    ("--loss.policy.rs_level=mask", "loss.policy.rs_level"),
    ("--loss.policy.rs_max=0", "loss.policy.rs_max"),
    ("--loss.policy.rs_veto=-1", "loss.policy.rs_veto"),
    ("--loss.policy.tis_floor=-0.5", "loss.policy.tis_floor"),
    ("--loss.policy.log_ratio_clamp=0", "loss.policy.log_ratio_clamp"),
    ("--loss.policy.adv_tau=-1", "loss.policy.adv_tau"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize(("overrides", "words"), [
    (["--loss.policy.rs_min=3", "--loss.policy.rs_max=2"], "rs_min"),
    (["--loss.policy.tis_floor=3", "--loss.policy.tis_cap=2"], "tis_floor"),
    (["--loss.policy.kind=prime_dppo", "--loss.policy.rs_level=token"], "rs_level"),
    (["--loss.policy.adv_tau=0.5"], "adv_tau"),
])
def test_inconsistent_values_name_the_keys(overrides, words):
    with pytest.raises(ConfigError, match=r"\[loss\.policy\].*" + words):
        load_config(None, overrides)


def test_options_reach_the_runtime_config():
    job = load_config(None, ["--loss.policy.is_level=sequence", "--loss.policy.rs_level=geometric",
                             "--loss.policy.rs_min=0.5", "--loss.policy.rs_veto=1e-4", "--loss.policy.tis_floor=0.1"])
    assert job.loss.policy == PolicyLossConfig(is_level="sequence", tis_cap=2.0, tis_floor=0.1, rs_level="geometric",
                                               rs_max=2.0, rs_min=0.5, rs_veto=1e-4)
