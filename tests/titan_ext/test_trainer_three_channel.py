"""The train step's first loss and gradient norm against an independent reference.

The reference is written here from the published formulas (REFERENCES.md) on
transformers' Qwen3 loaded from the same HF files, one unpacked document at a
time (so packing, document masks, hint alignment and the global counts of the
trainer are all checked against plain per-sequence code):

- policy: DAPO at the current weights (ρ = 1, clip inactive) with truncated IS
  weight min(exp(logπ − logπ_gen), 2): ℓ = −Â·ρ·w, Σ over policy tokens / N
  (or, `sequence_is`, w = Π_{t∈rollout} exp(logπ − logπ_gen) per packed rollout);
- hint distillation: generalized JSD, β = 0.5, teacher = the same model on the
  hint-injected document without gradient, Σ over distilled tokens / N;
- trace replay: DPO, β = 0.1, Σ over pairs / P;
- total = policy + 1·distill + 1·preference; gradient norm over all parameters.

With `[loss.distill] rlsd` each policy token's advantage is scaled by RLSD's
w = clip(exp(sign(Â)·(logπ_T − logπ_S)), w_min, w_max), π_T the hinted document's
prediction of the same token; with `kl_guard = c` each distilled token adds
c·(exp(lp_gen − lp) − (lp_gen − lp) − 1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_trainer_harness import HINT_LEN, SEQ_L, global_batch, single_run

pytestmark = pytest.mark.timeout(600)


def _kl(logp, logq):
    return (logp.exp() * (logp - logq)).sum(-1)


def _reference(hf_dir, sequence_is: bool = False, rlsd: tuple[float, float] | None = None, kl_guard: float = 0.0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    batch = global_batch(0)
    docs, doc_len, hint_doc = 2, SEQ_L // 2, SEQ_L // 2 + HINT_LEN
    policy_terms, distill_terms = [], []
    for b in range(batch.tokens_BL.shape[0]):
        for d in range(docs):
            lo, hlo = d * doc_len, d * hint_doc
            logp_s = F.log_softmax(model(batch.tokens_BL[b : b + 1, lo : lo + doc_len]).logits[0], -1)
            with torch.no_grad():
                logp_t = F.log_softmax(model(batch.hint_tokens_BH[b : b + 1, hlo : hlo + hint_doc]).logits[0], -1)
            doc_log_m = []
            for i in range(doc_len):
                j = lo + i
                if batch.policy_mask_BL[b, j]:
                    doc_log_m.append(logp_s[i, batch.labels_BL[b, j]].detach() - batch.generator_logprobs_BL[b, j])
            for i in range(doc_len):
                j = lo + i
                if batch.policy_mask_BL[b, j]:
                    lp = logp_s[i, batch.labels_BL[b, j]]
                    ratio = (lp - lp.detach()).exp()
                    adv = batch.advantages_BL[b, j]
                    if rlsd is not None and batch.hint_index_BL[b, j] >= 0:
                        gap = logp_t[batch.hint_index_BL[b, j] - hlo, batch.labels_BL[b, j]] - lp.detach()
                        adv = adv * (torch.sign(adv) * gap).exp().clamp(*rlsd)
                    if sequence_is:  # one weight per rollout: the product of its token ratios
                        tis = torch.stack(doc_log_m).sum().exp()
                    else:
                        tis = (lp.detach() - batch.generator_logprobs_BL[b, j]).exp().clamp(max=2.0)
                    policy_terms.append(-adv * ratio * tis)
                if batch.distill_mask_BL[b, j]:
                    t = batch.hint_index_BL[b, j] - hlo
                    m = torch.logsumexp(torch.stack([logp_t[t] + torch.log(torch.tensor(0.5)),
                                                     logp_s[i] + torch.log(torch.tensor(0.5))]), 0)
                    x = batch.generator_logprobs_BL[b, j] - logp_s[i, batch.labels_BL[b, j]]
                    distill_terms.append(0.5 * _kl(logp_t[t], m) + 0.5 * _kl(logp_s[i], m)
                                         + kl_guard * (x.exp() - x - 1))

    def seq_logp(tokens, labels):
        logp = F.log_softmax(model(tokens.unsqueeze(0)).logits[0], -1)
        keep = labels >= 0
        return logp[keep].gather(-1, labels[keep].unsqueeze(-1)).sum()

    pair_losses = []
    for p in range(batch.pairs):
        c = seq_logp(batch.chosen_tokens_PS[p], batch.chosen_labels_PS[p])
        r = seq_logp(batch.rejected_tokens_PS[p], batch.rejected_labels_PS[p])
        delta = (c - batch.ref_chosen_logprobs_P[p]) - (r - batch.ref_rejected_logprobs_P[p])
        pair_losses.append(-F.logsigmoid(0.1 * delta))
    policy = torch.stack(policy_terms).sum() / batch.policy_tokens
    distill = torch.stack(distill_terms).sum() / batch.distill_tokens
    preference = torch.stack(pair_losses).sum() / batch.pairs
    total = policy + distill + preference
    total.backward()
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    value = lambda t: float(t.detach())  # noqa: E731
    return {"policy": value(policy), "distill": value(distill), "preference": value(preference),
            "loss": value(total), "grad_norm": value(grad_norm),
            "counts": (len(policy_terms), len(distill_terms), len(pair_losses))}


@pytest.mark.slow
def test_first_step_matches_reference(tiny_assets):
    first = single_run(str(tiny_assets.dense_dir))["history"]["single_adamw"][0]
    ref = _reference(tiny_assets.dense_dir)
    batch = global_batch(0)
    assert ref["counts"] == (batch.policy_tokens, batch.distill_tokens, batch.pairs)
    assert first["policy/tokens"] == batch.policy_tokens
    assert first["distill/tokens"] == batch.distill_tokens
    assert first["preference/pairs"] == batch.pairs
    for channel in ("policy", "distill", "preference"):
        assert first[f"{channel}/loss"] != 0.0, channel  # all three channels are on
        assert first[f"{channel}/loss"] == pytest.approx(ref[channel], abs=1e-5, rel=1e-4), channel
    assert first["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert first["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_every_step_has_three_active_channels(tiny_assets):
    for step, metrics in enumerate(single_run(str(tiny_assets.dense_dir))["history"]["single_muon"], 1):
        assert metrics["step"] == step
        total = metrics["policy/loss"] + metrics["distill/loss"] + metrics["preference/loss"]
        assert metrics["loss"] == pytest.approx(total, abs=1e-6)  # alpha = beta = 1
        assert min(abs(metrics[f"{c}/loss"]) for c in ("policy", "distill", "preference")) > 0


@pytest.mark.slow
def test_logged_lr_is_the_steps_own(tiny_assets):
    """Each step logs the LR its optimizer step ran at: warmup_steps = 1 and a linear decay to 0 over the
    D = STEPS − 1 steps after it (the [optimizer] docs: step s runs at factor 1 − (s − W) / D after warmup)."""
    from test_trainer_harness import STEPS

    history = single_run(str(tiny_assets.dense_dir))["history"]["single_adamw"]
    warmup, decay = 1, STEPS - 1
    expected = [0.02 * (1.0 if s < warmup else 1.0 - (s - warmup) / decay) for s in range(STEPS)]
    assert [m["lr"] for m in history] == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_sequence_level_is_weights_each_packed_rollout(tiny_assets, tmp_path):
    """`is_level = "sequence"` on the trainer's path: two rollouts per packed row, each weighted
    by its own ratio product (the trainer's sequence ids come from the positions)."""
    from test_trainer_harness import run_ranks

    configs = {"seq_is": {"optimizer": "adamw", "policy": {"is_level": "sequence", "tis_cap": None}}}
    args = {"configs": configs, "steps": 1, "hf_path": str(tiny_assets.dense_dir)}
    first = run_ranks("trajectory", 1, tmp_path, args)["history"]["seq_is"][0]
    ref = _reference(tiny_assets.dense_dir, sequence_is=True)
    assert first["policy/loss"] == pytest.approx(ref["policy"], abs=1e-5, rel=1e-4)
    assert first["policy/loss"] != pytest.approx(_reference(tiny_assets.dense_dir)["policy"], abs=1e-5, rel=1e-4)


@pytest.mark.slow
def test_rlsd_and_kl_guard_on_the_trainer_path(tiny_assets, tmp_path):
    """`[loss.distill] rlsd` and `kl_guard` through the train step: the hinted teacher's forward, gathered by
    `hint_index_BL`, sizes the policy tokens of the hinted rollouts (`hinted_BL`), and the guard adds its k3 on
    the distilled tokens against the packed generator logprobs; both against the reference above."""
    from test_trainer_harness import run_ranks

    configs = {"rlsd": {"optimizer": "adamw", "distill": {"rlsd": True, "rlsd_w_min": 0.5, "rlsd_w_max": 2.0,
                                                          "kl_guard": 0.5}}}
    args = {"configs": configs, "steps": 1, "hf_path": str(tiny_assets.dense_dir)}
    first = run_ranks("trajectory", 1, tmp_path, args)["history"]["rlsd"][0]
    ref = _reference(tiny_assets.dense_dir, rlsd=(0.5, 2.0), kl_guard=0.5)
    plain = _reference(tiny_assets.dense_dir)
    for channel in ("policy", "distill"):
        assert first[f"{channel}/loss"] == pytest.approx(ref[channel], abs=1e-5, rel=1e-4), channel
        assert first[f"{channel}/loss"] != pytest.approx(plain[channel], abs=1e-5, rel=1e-4), channel
    assert first["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert first["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert first["policy/rlsd_tokens"] == first["policy/tokens"] and first["distill/kl_guard_mean"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [True, False])
def test_taid_schedule_advances_and_is_saved(tiny_assets, tmp_path, adaptive):
    from test_trainer_harness import run_ranks

    args = {"hf_path": str(tiny_assets.dense_dir), "optimizer": "adamw", "steps": 4, "taid_adaptive": adaptive}
    result = run_ranks("taid", 1, tmp_path, args)
    t = result["t"]
    if not adaptive:  # `[loss.distill] taid_adaptive = false`: the line t_start -> t_end over the run's 4 steps
        assert t == pytest.approx([0.4 + 0.6 * step / 4 for step in range(1, 5)])
    assert t[0] == pytest.approx(0.4 if adaptive else 0.55)  # adaptive: the first update only records the loss
    assert all(b >= a for a, b in zip(t, t[1:])) and t[-1] > t[0] and t[-1] <= 1.0
    assert all(d > 0 for d in result["distill"])  # TAID's cross-entropy to the interpolated target
    assert result["saved"]["t"] == pytest.approx(t[-1])


def test_bf16_master_weights_are_refused_naming_the_key():
    """`[model] dtype` is not the trainer's master-weight dtype: bfloat16 there is refused before anything is built,
    with the key to use instead (its masters stay float32; FSDP computes in `parallelism.param_dtype`)."""
    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.titan_ext.spec import TrainerSpec
    from composer_mesh.titan_ext.trainer import Trainer

    with pytest.raises(ValueError, match=r"model\.dtype = 'bfloat16'.*parallelism\.param_dtype"):
        Trainer(TrainerSpec(model=ModelConfig(flavour="tiny", device="cpu", dtype="bfloat16")))
