"""The three-channel loss: policy + α·hint-distillation + β·trace-replay preference.

The trainer passes one input dataclass per channel (hidden states, not logits:
the LM head is applied here, chunk by chunk, see `losses/logprobs.py`). Each
channel is a sum over its valid tokens (or pairs) divided by the *global* count
the caller passes in, so microbatches and data-parallel ranks add up to the
full-batch loss. A channel is off when its weight is 0 or its inputs are None.
The configuration is the `[loss]` section itself (`configs.sections.loss.LossConfig`).

Metrics are 0-d tensors ready for distributed reduction: names ending in `_max`
reduce with MAX, all others with SUM (losses are already divided by global
counts; `*_sum` / `tokens` / `pairs` are sums and counts). `summarize_metrics`
turns reduced sums into means.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from composer_mesh.configs.sections.loss import DistillLossConfig, LossConfig, PolicyLossConfig, PreferenceLossConfig
from composer_mesh.losses.distill import DistillSpec, kl_guard_k3
from composer_mesh.losses.logprobs import (
    ChunkLossFn,
    FusedHead,
    Teacher,
    TokenStats,
    chunk_tokens_for,
    chunked_token_stats,
    fused_pair_logprobs,
    fused_token_loss,
    token_stats_naive,
)
from composer_mesh.losses.mismatch import mismatch_weights, needs_sequences
from composer_mesh.losses.policy import dapo_token_loss, prime_dppo_token_loss, rlsd_weights
from composer_mesh.losses.preference import dpo_loss, ipo_loss, pair_weight, rpo_nll, simpo_loss
from composer_mesh.losses.reduce import global_mean, math_dtype, segment_sum, upcast

CHANNELS = ("policy", "distill", "preference")


# --- per-channel inputs ---


@dataclass
class PolicyInputs:
    """Rollout tokens for the policy-gradient channel.

    hidden_BTD: final hidden states; position t predicts labels_BT[:, t].
    labels_BT: the sampled token ids (long).  mask_BT: completion tokens that carry loss.
    advantages: [B] per sequence or [B, T] per token.
    num_tokens: valid tokens in the *global* batch (all microbatches, all DP ranks).
    old_logprobs_BT: π_old recomputed by the trainer (None: on-policy, ρ = 1 at the current weights).
    gen_logprobs_BT: the generator's logprobs (mismatch IS / rejection for DAPO; the reference of PRIME-DPPO).
    seq_ids_BT: which sequence each token belongs to (equal ids = same sequence; packed rows hold
        several); None: each row is one sequence. Read by sequence-level mismatch correction only.
    rlsd_mask_BT: tokens whose advantage RLSD weights (`[loss.distill] rlsd`: sampled tokens of hinted
        rollouts with a teacher position); None: no token is weighted.
    rlsd_teacher_hidden_BTD: the hinted teacher's hidden states aligned to these tokens (as
        `DistillInputs.teacher_hidden_BTD`); read where `rlsd_mask_BT` is set, never given gradient.
    """

    hidden_BTD: torch.Tensor
    labels_BT: torch.Tensor
    mask_BT: torch.Tensor
    advantages: torch.Tensor
    num_tokens: torch.Tensor | int
    old_logprobs_BT: torch.Tensor | None = None
    gen_logprobs_BT: torch.Tensor | None = None
    seq_ids_BT: torch.Tensor | None = None
    rlsd_mask_BT: torch.Tensor | None = None
    rlsd_teacher_hidden_BTD: torch.Tensor | None = None


@dataclass
class DistillInputs:
    """Student tokens at error turns and the hinted teacher's states aligned to them.

    hidden_BTD: the student's (policy without hint) final hidden states.
    teacher_hidden_BTD: the policy's hidden states on the hinted context, hint tokens
        removed so that [:, t] predicts the same response token as the student's [:, t].
    mask_BT: the student's tokens of the error turn (and after, if chosen).
    num_tokens: global count of distilled tokens.
    teacher_weight_VD: the teacher's LM head (None: the policy's own head, detached).
    labels_BT / gen_logprobs_BT: the sampled token ids and the generator's logprobs of them (the KL guard,
        `[loss.distill] kl_guard > 0`, needs both).
    """

    hidden_BTD: torch.Tensor
    teacher_hidden_BTD: torch.Tensor
    mask_BT: torch.Tensor
    num_tokens: torch.Tensor | int
    teacher_weight_VD: torch.Tensor | None = None
    labels_BT: torch.Tensor | None = None
    gen_logprobs_BT: torch.Tensor | None = None


@dataclass
class PreferenceInputs:
    """Chosen / rejected continuations of P replayed trace states.

    *_hidden_BTD: final hidden states ([P, T, D]); *_labels_BT: the continuation ids;
    *_mask_BT: continuation tokens; num_pairs: global pair count.
    ref_*_logps_P: Σ reference logprobs of each continuation (DPO only).
    """

    chosen_hidden_BTD: torch.Tensor
    chosen_labels_BT: torch.Tensor
    chosen_mask_BT: torch.Tensor
    rejected_hidden_BTD: torch.Tensor
    rejected_labels_BT: torch.Tensor
    rejected_mask_BT: torch.Tensor
    num_pairs: torch.Tensor | int
    ref_chosen_logps_P: torch.Tensor | None = None
    ref_rejected_logps_P: torch.Tensor | None = None


@dataclass
class ComposerOutput:
    # scalar: policy + α·distill + β·preference
    loss: torch.Tensor
    active_channels: tuple[str, ...]
    metrics: dict[str, torch.Tensor]


# --- the channels ---


def _bool_mask(mask_BT: torch.Tensor, like_BT: torch.Size, what: str) -> torch.Tensor:
    if mask_BT.shape != like_BT:
        raise ValueError(f"{what} mask must be {tuple(like_BT)}, got {tuple(mask_BT.shape)}")
    return mask_BT.bool()


def _chunk_tokens(cfg: LossConfig, weight_VD: torch.Tensor, label_only: bool) -> int:
    return cfg.chunk_tokens or chunk_tokens_for(weight_VD.shape[0], cfg.chunk_budget_mib, label_only=label_only)


def _head_loss(
    cfg: LossConfig,
    head: FusedHead | None,
    scale: float,
    hidden_nD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_n: torch.Tensor | None,
    loss_fn: ChunkLossFn,
    teacher: Teacher | None = None,
    want_entropy: bool = False,
) -> tuple[torch.Tensor, TokenStats]:
    """Σ of `loss_fn` over tokens: chunked with the gradient of scale·loss into `head`
    (the returned value is detached), or with full logits and plain autograd (head None)."""
    if head is not None:
        return fused_token_loss(
            hidden_nD, weight_VD, labels_n, loss_fn, teacher=teacher, want_entropy=want_entropy,
            chunk_tokens=_chunk_tokens(cfg, weight_VD, label_only=teacher is None), head=head, scale=scale,
        )
    stats = token_stats_naive(hidden_nD, weight_VD, labels_n, teacher=teacher, want_entropy=want_entropy)
    loss = loss_fn(stats, slice(None))
    detached = TokenStats(*(None if v is None else v.detach() for v in vars(stats).values()))
    return loss, detached


def _policy_terms(cfg: PolicyLossConfig, logp, old, gen, adv, weight):
    """Per-token terms; `weight` is the precomputed mismatch weight (None: from this chunk's
    tokens, token-level only)."""
    if cfg.kind == "prime_dppo":
        return prime_dppo_token_loss(
            logp, gen, adv, delta_low=cfg.dppo_delta_low, delta_high=cfg.dppo_delta_high, kl_tau=cfg.kl_tau,
            adv_tau=cfg.adv_tau, log_ratio_clamp=cfg.log_ratio_clamp,
        )
    old = logp.detach() if old is None else old
    if weight is None and gen is not None:
        weight = mismatch_weights(old, gen, None, cfg).weight
    return dapo_token_loss(
        logp, old, adv, eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c,
        mismatch_weight=weight, log_ratio_clamp=cfg.log_ratio_clamp,
    )


def _sequence_index(inputs: PolicyInputs, mask: torch.Tensor) -> torch.Tensor:
    """Sequence of each valid token as 0..S−1 (rows when no `seq_ids_BT`).  # [n]"""
    if inputs.seq_ids_BT is None:
        ids_BT = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1).expand_as(mask)
    else:
        ids_BT = inputs.seq_ids_BT
        if ids_BT.shape != mask.shape:
            raise ValueError(f"policy seq_ids_BT must be {tuple(mask.shape)}, got {tuple(ids_BT.shape)}")
    return torch.unique(ids_BT[mask], return_inverse=True)[1]


@torch.no_grad()
def _label_logprobs(cfg: LossConfig, chunked: bool, weight_VD, hidden_nD, labels_n) -> torch.Tensor:
    """log p(label) of each row of `hidden_nD` under the head `weight_VD`, without gradient (one head matmul
    per token: chunk by chunk when `chunked`).  # [n]"""
    hidden_nD, weight_VD = hidden_nD.detach(), weight_VD.detach()
    if chunked:
        return chunked_token_stats(hidden_nD, weight_VD, labels_n, want_entropy=False,
                                   chunk_tokens=_chunk_tokens(cfg, weight_VD, label_only=True)).logprobs
    return token_stats_naive(hidden_nD, weight_VD, labels_n, want_entropy=False).logprobs


def _sequence_mismatch(cfg: LossConfig, head, weight_VD, inputs, mask, labels_n, old_n, gen_n):
    """Mismatch weights of all valid tokens before the head loop (when π_old is given, or a
    correction looks at whole sequences); on-policy (no π_old given) π_old is the current
    policy, scored here without gradient (one extra head matmul per token).  # MismatchWeights of [n]"""
    if old_n is None:
        old_n = _label_logprobs(cfg, head is not None, weight_VD, inputs.hidden_BTD[mask], labels_n)
    return mismatch_weights(old_n, gen_n, _sequence_index(inputs, mask), cfg.policy)


@dataclass(frozen=True)
class _Rlsd:
    """RLSD's inputs over the channel's valid tokens: which are weighted, and the hinted teacher's logprob of
    each (0 where not weighted)."""

    on_n: torch.Tensor
    teacher_logprobs_n: torch.Tensor

    def advantages(self, cfg: DistillLossConfig, adv_n: torch.Tensor, student_logprobs_n: torch.Tensor,
                   sl: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A·w, w) for tokens `sl`: w from `rlsd_weights` where RLSD applies, 1 elsewhere."""
        sl = slice(None) if sl is None else sl
        w = rlsd_weights(self.teacher_logprobs_n[sl], student_logprobs_n, adv_n, cfg.rlsd_w_min, cfg.rlsd_w_max)
        w = torch.where(self.on_n[sl], w, torch.ones_like(w))
        return adv_n * w, w


def _rlsd_inputs(cfg: LossConfig, head, weight_VD, inputs: PolicyInputs, mask, labels_n) -> _Rlsd | None:
    """The hinted teacher's logprobs of the RLSD tokens (`[loss.distill] rlsd` with a mask given), scored once
    without gradient before the head loop (one head matmul per such token)."""
    if not cfg.distill.rlsd or inputs.rlsd_mask_BT is None:
        return None
    if inputs.rlsd_teacher_hidden_BTD is None or inputs.rlsd_teacher_hidden_BTD.shape != inputs.hidden_BTD.shape:
        raise ValueError("RLSD needs rlsd_teacher_hidden_BTD aligned to the policy's hidden states "
                         f"{tuple(inputs.hidden_BTD.shape)}")
    on_n = _bool_mask(inputs.rlsd_mask_BT, mask.shape, "rlsd")[mask]
    teacher_n = torch.zeros(on_n.shape, dtype=math_dtype(inputs.hidden_BTD), device=on_n.device)
    if bool(on_n.any()):
        teacher_n[on_n] = upcast(_label_logprobs(
            cfg, head is not None, weight_VD, inputs.rlsd_teacher_hidden_BTD[mask][on_n], labels_n[on_n]))
    return _Rlsd(on_n, teacher_n)


def policy_channel(
    cfg: LossConfig,
    weight_VD: torch.Tensor,
    inputs: PolicyInputs,
    head: FusedHead | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_valid ℓ_t / num_tokens for DAPO or PRIME-DPPO, plus metrics (chunked: gradient of
    scale·loss into `head`, loss returned detached)."""
    pcfg = cfg.policy
    mask = _bool_mask(inputs.mask_BT, inputs.labels_BT.shape, "policy")
    if pcfg.kind == "prime_dppo" and inputs.gen_logprobs_BT is None:
        raise ValueError("policy kind prime_dppo needs gen_logprobs_BT (the inference engine's logprobs)")
    adv = inputs.advantages
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(mask)
    adv_n = adv[mask]
    labels_n = inputs.labels_BT[mask]
    old_n = None if inputs.old_logprobs_BT is None else inputs.old_logprobs_BT[mask]
    gen_n = None if inputs.gen_logprobs_BT is None else inputs.gen_logprobs_BT[mask]
    mismatch = None
    if pcfg.kind == "dapo" and gen_n is not None and (old_n is not None or needs_sequences(pcfg)):
        mismatch = _sequence_mismatch(cfg, head, weight_VD, inputs, mask, labels_n, old_n, gen_n)
    rlsd = _rlsd_inputs(cfg, head, weight_VD, inputs, mask, labels_n)
    count = torch.as_tensor(inputs.num_tokens, dtype=torch.float32, device=mask.device)
    part = lambda x, sl: None if x is None else x[sl]  # noqa: E731
    weight_n = None if mismatch is None else mismatch.weight

    def loss_fn(stats: TokenStats, sl: slice) -> torch.Tensor:
        adv = adv_n[sl] if rlsd is None else rlsd.advantages(cfg.distill, adv_n[sl], stats.logprobs, sl)[0]
        terms = _policy_terms(pcfg, stats.logprobs, part(old_n, sl), part(gen_n, sl), adv, part(weight_n, sl))
        return global_mean(terms.loss, count)

    loss, stats = _head_loss(cfg, head, scale, inputs.hidden_BTD[mask], weight_VD, labels_n, loss_fn, want_entropy=True)
    old = stats.logprobs if old_n is None else upcast(old_n)
    if mismatch is None and pcfg.kind == "dapo" and gen_n is not None:
        mismatch = mismatch_weights(old, gen_n, None, pcfg)
    adv_w_n, rlsd_w_n = (adv_n, None) if rlsd is None else rlsd.advantages(cfg.distill, adv_n, stats.logprobs)
    terms = _policy_terms(pcfg, stats.logprobs, old_n, gen_n, adv_w_n, None if mismatch is None else mismatch.weight)
    bound = pcfg.log_ratio_clamp or float("inf")
    # log π_θ / π_old on samples from π_old
    log_r = (stats.logprobs - old).clamp(-bound, bound)
    metrics = {
        "policy/loss": loss.detach(),
        "policy/tokens": loss.new_tensor(float(adv_n.numel())),
        "policy/clipped_sum": terms.clipped.float().sum(),
        "policy/ratio_sum": terms.ratio.sum(),
        "policy/ratio_max": terms.ratio.max() if adv_n.numel() else loss.new_zeros(()),
        "policy/entropy_sum": stats.entropy.sum(),
        "policy/kl_k3_sum": (log_r.exp() - 1 - log_r).sum(),
    }
    if gen_n is not None:
        # log π_train_old / π_gen on samples from π_gen
        log_m = (old - upcast(gen_n)).clamp(-bound, bound)
        metrics["policy/mismatch_k3_sum"] = (log_m.exp() - 1 - log_m).sum()
    if mismatch is not None:
        metrics["policy/is_weight_sum"] = mismatch.weight.sum()
        metrics["policy/rejected_sum"] = mismatch.rejected.float().sum()
    if rlsd is not None:
        on = rlsd.on_n
        # means over the RLSD tokens (summarize_metrics): the weight, and the hinted teacher's gain Δ_t
        metrics["policy/rlsd_tokens"] = loss.new_tensor(float(on.sum()))
        metrics["policy/rlsd_weight_sum"] = rlsd_w_n[on].sum()
        metrics["policy/rlsd_gap_sum"] = (rlsd.teacher_logprobs_n - stats.logprobs)[on].sum()
    return loss, metrics


def distill_spec(cfg: DistillLossConfig, taid_t: float | None = None) -> DistillSpec:
    """The per-step divergence spec (`taid_t` from a `TAIDSchedule`; default t_start)."""
    return DistillSpec(
        kind=cfg.kind,
        beta=cfg.beta,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        taid_t=cfg.taid_t_start if taid_t is None else taid_t,
        h_max=cfg.eopd_h_max,
    )


def distill_channel(
    cfg: LossConfig,
    weight_VD: torch.Tensor,
    inputs: DistillInputs,
    taid_t: float | None = None,
    head: FusedHead | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_valid (divergence_t + kl_guard·k3_t) / num_tokens, teacher without gradient (the k3 term only with
    `[loss.distill] kl_guard > 0`, against the generator's logprobs of the sampled tokens)."""
    mask = _bool_mask(inputs.mask_BT, inputs.hidden_BTD.shape[:2], "distill")
    if inputs.teacher_hidden_BTD.shape != inputs.hidden_BTD.shape:
        raise ValueError(
            f"teacher hidden states must be aligned to the student's: {tuple(inputs.teacher_hidden_BTD.shape)} "
            f"vs {tuple(inputs.hidden_BTD.shape)}"
        )
    teacher_w = weight_VD if inputs.teacher_weight_VD is None else inputs.teacher_weight_VD
    teacher = Teacher(inputs.teacher_hidden_BTD[mask].detach(), teacher_w.detach(), distill_spec(cfg.distill, taid_t))
    count = torch.as_tensor(inputs.num_tokens, dtype=torch.float32, device=mask.device)
    guard = cfg.distill.kl_guard
    labels_n = gen_n = None
    if guard:
        if inputs.labels_BT is None or inputs.gen_logprobs_BT is None:
            raise ValueError("loss.distill.kl_guard > 0 needs the distilled tokens' labels_BT and gen_logprobs_BT")
        labels_n, gen_n = inputs.labels_BT[mask], inputs.gen_logprobs_BT[mask]

    def loss_fn(stats: TokenStats, sl: slice) -> torch.Tensor:
        terms = stats.divergence if not guard else stats.divergence + guard * kl_guard_k3(stats.logprobs, gen_n[sl])
        return global_mean(terms, count)

    loss, stats = _head_loss(cfg, head, scale, inputs.hidden_BTD[mask], weight_VD, labels_n, loss_fn, teacher=teacher)
    metrics = {
        "distill/loss": loss.detach(),
        "distill/tokens": loss.new_tensor(float(mask.sum())),
        "distill/divergence_sum": stats.divergence.sum(),
    }
    if guard:
        metrics["distill/kl_guard_sum"] = kl_guard_k3(stats.logprobs, gen_n).sum()
    return loss, metrics


# Sequence-level losses over pairs shorter than this (mean tokens) recompute logits in
# backward instead: the fused path adds and zeroes one [V, D] buffer per pair.
MIN_FUSED_PAIR_TOKENS = 64


def _pair_losses(pref: PreferenceLossConfig, inputs: PreferenceInputs, chosen_P, rejected_P, c_len_P, r_len_P):
    """(per-pair loss, margin, DPO weight) from sequence logprob sums (averaged here when the kind wants means).

    The weight is σ(−m) with the kind's sigmoid margin m (DPO β·Δ, SimPO β·(avg_w − avg_l) − γ; IPO, whose
    margin is Δ itself: β·Δ); a pair under `min_weight` has its loss multiplied by 0 here, so it adds nothing
    on any path (it still counts in num_pairs, which the batch fixed)."""
    ref_c, ref_r = inputs.ref_chosen_logps_P, inputs.ref_rejected_logps_P
    if pref.length_averaged:
        chosen_P, rejected_P = chosen_P / c_len_P, rejected_P / r_len_P
        ref_c = None if ref_c is None else ref_c / c_len_P
        ref_r = None if ref_r is None else ref_r / r_len_P
    if pref.kind == "dpo":
        per_pair, margin = dpo_loss(chosen_P, rejected_P, ref_c, ref_r, pref.dpo_beta, pref.label_smoothing)
    elif pref.kind == "ipo":
        per_pair, margin = ipo_loss(chosen_P, rejected_P, ref_c, ref_r, pref.dpo_beta)
    else:
        per_pair, margin = simpo_loss(chosen_P, rejected_P, pref.simpo_beta, pref.simpo_gamma, pref.label_smoothing)
    weight = pair_weight(pref.dpo_beta * margin if pref.kind == "ipo" else margin)
    return per_pair, margin, weight


def _kept(pref: PreferenceLossConfig, weight_P: torch.Tensor) -> torch.Tensor:
    """1 for pairs whose DPO weight reaches `min_weight`, 0 for the others.  # [P]"""
    return (weight_P >= pref.min_weight).to(weight_P.dtype)


def _fused_pair_seq_logps(cfg, head, scale, weight_VD, inputs, c_mask, r_mask, c_len_P, r_len_P):
    """Σ logprobs of each chosen / rejected sequence, gradient into `head` pair by pair.

    Tokens are laid out pair by pair (chosen then rejected). Both losses depend on a
    pair only through a·Σ_chosen − b·Σ_rejected, so a token's upstream gradient is
    k_p·w_t with w = +1 / −1 (DPO, IPO on sums) or +1/|c| / −1/|r| (SimPO, IPO on
    length averages) and
    k_p = ∂loss/∂(Σ_chosen)/w_chosen, known once the pair's tokens are done.
    """
    pref = cfg.preference
    n_pairs = c_mask.shape[0]
    mean = pref.length_averaged
    pieces, weights, segments, start = [], [], [], 0
    for p in range(n_pairs):
        c_h, r_h = inputs.chosen_hidden_BTD[p][c_mask[p]], inputs.rejected_hidden_BTD[p][r_mask[p]]
        c_w = 1.0 / c_len_P[p] if mean else c_len_P.new_ones(())
        r_w = 1.0 / r_len_P[p] if mean else r_len_P.new_ones(())
        pieces += [(c_h, inputs.chosen_labels_BT[p][c_mask[p]]), (r_h, inputs.rejected_labels_BT[p][r_mask[p]])]
        weights += [c_w.expand(c_h.shape[0]), -r_w.expand(r_h.shape[0])]
        segments.append(slice(start, start + c_h.shape[0] + r_h.shape[0]))
        start = segments[-1].stop
    hidden_nD = torch.cat([h for h, _ in pieces])
    labels_n = torch.cat([y for _, y in pieces])
    sums = hidden_nD.new_zeros((2, n_pairs), dtype=math_dtype(hidden_nD))  # [chosen | rejected, P]

    def segment_scale(p: int, logprobs: torch.Tensor) -> torch.Tensor:
        n_chosen = int(c_mask[p].sum())
        c = logprobs[:n_chosen].sum().requires_grad_()
        r = logprobs[n_chosen:].sum()
        sums[0, p], sums[1, p] = c.detach(), r
        one = slice(p, p + 1)
        sub = dataclasses.replace(
            inputs,
            ref_chosen_logps_P=None if inputs.ref_chosen_logps_P is None else inputs.ref_chosen_logps_P[one],
            ref_rejected_logps_P=None if inputs.ref_rejected_logps_P is None else inputs.ref_rejected_logps_P[one],
        )
        with torch.enable_grad():
            per_pair, _, weight = _pair_losses(pref, sub, c[None], r[None], c_len_P[one], r_len_P[one])
            (g_c,) = torch.autograd.grad(global_mean(per_pair * _kept(pref, weight), inputs.num_pairs) * scale, c)
        return g_c * c_len_P[p] if mean else g_c

    token_weight_n = torch.cat(weights) if weights else hidden_nD.new_zeros(0)
    chunk = _chunk_tokens(cfg, weight_VD, label_only=True)
    fused_pair_logprobs(head, hidden_nD, labels_n, token_weight_n, segments, segment_scale, chunk)
    return sums[0], sums[1]


def preference_channel(
    cfg: LossConfig,
    weight_VD: torch.Tensor,
    inputs: PreferenceInputs,
    head: FusedHead | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_pairs (DPO/IPO/SimPO loss + nll_weight·RPO NLL) / num_pairs (sequence-level). Chunked: fused pair by pair
    (gradient of scale·loss into `head`, loss returned detached), or — for short pairs —
    per-token stats with recomputation in backward (loss differentiable)."""
    pref = cfg.preference
    c_mask = _bool_mask(inputs.chosen_mask_BT, inputs.chosen_labels_BT.shape, "chosen")
    r_mask = _bool_mask(inputs.rejected_mask_BT, inputs.rejected_labels_BT.shape, "rejected")
    n_pairs = c_mask.shape[0]
    if r_mask.shape[0] != n_pairs:
        raise ValueError(f"chosen and rejected must have the same number of pairs, got {n_pairs} and {r_mask.shape[0]}")
    if pref.kind != "simpo" and (inputs.ref_chosen_logps_P is None or inputs.ref_rejected_logps_P is None):
        raise ValueError(f"preference kind {pref.kind} needs ref_chosen_logps_P and ref_rejected_logps_P")
    c_len_P, r_len_P = c_mask.sum(-1).clamp(min=1).float(), r_mask.sum(-1).clamp(min=1).float()
    n_tokens = int(c_mask.sum() + r_mask.sum())
    chunk = _chunk_tokens(cfg, weight_VD, label_only=True)
    fused = head is not None and n_pairs > 0 and n_tokens >= n_pairs * min(chunk, MIN_FUSED_PAIR_TOKENS)
    if fused:
        chosen_P, rejected_P = _fused_pair_seq_logps(
            cfg, head, scale, weight_VD, inputs, c_mask, r_mask, c_len_P, r_len_P
        )
    else:
        hidden_nD = torch.cat([inputs.chosen_hidden_BTD[c_mask], inputs.rejected_hidden_BTD[r_mask]])
        labels_n = torch.cat([inputs.chosen_labels_BT[c_mask], inputs.rejected_labels_BT[r_mask]])
        rows = torch.arange(n_pairs, device=c_mask.device).unsqueeze(-1)
        seq_n = torch.cat([rows.expand_as(c_mask)[c_mask], n_pairs + rows.expand_as(r_mask)[r_mask]])
        if head is not None:
            stats = chunked_token_stats(
                hidden_nD, weight_VD, labels_n, want_entropy=False, chunk_tokens=chunk
            )
        else:
            stats = token_stats_naive(hidden_nD, weight_VD, labels_n, want_entropy=False)
        seq_logps = segment_sum(stats.logprobs, seq_n, 2 * n_pairs)
        chosen_P, rejected_P = seq_logps[:n_pairs], seq_logps[n_pairs:]
    per_pair, margin, weight = _pair_losses(pref, inputs, chosen_P, rejected_P, c_len_P, r_len_P)
    kept = _kept(pref, weight)
    nll_P = None
    if pref.nll_weight:
        nll_P = rpo_nll(chosen_P, c_len_P)
        per_pair = per_pair + pref.nll_weight * nll_P
        if fused:
            _fused_chosen_nll(cfg, head, scale, weight_VD, inputs, c_mask, c_len_P, kept)
    loss = global_mean(per_pair * kept, inputs.num_pairs)
    metrics = {
        "preference/loss": loss.detach(),
        "preference/pairs": loss.new_tensor(float(n_pairs)),
        "preference/margin_sum": margin.sum(),
        "preference/accuracy_sum": (margin > 0).float().sum(),
        # σ(−m) per pair (before dropping): how much DPO gradient the step's pairs carry
        "preference/weight_sum": weight.sum(),
        "preference/dropped_low_weight": (1.0 - kept).sum(),
        # log π(y | x) / |y| per pair: whether the pair loss lowers both likelihoods while it moves the margin
        # (DPO's likelihood displacement; what RPO's anchor holds up)
        "preference/chosen_logp_sum": (chosen_P.detach() / c_len_P).sum(),
        "preference/rejected_logp_sum": (rejected_P.detach() / r_len_P).sum(),
    }
    if nll_P is not None:
        metrics["preference/nll_sum"] = nll_P.detach().sum()
    return loss, metrics


def _fused_chosen_nll(cfg, head, scale, weight_VD, inputs, c_mask, c_len_P, kept_P) -> None:
    """Gradient of nll_weight·Σ_kept pairs rpo_nll / num_pairs into `head` (the fused pair pass carries only
    the pair loss: its one scale per pair cannot give chosen and rejected tokens different weights)."""
    rows = torch.arange(c_mask.shape[0], device=c_mask.device).unsqueeze(-1).expand_as(c_mask)[c_mask]
    count = torch.as_tensor(inputs.num_pairs, dtype=c_len_P.dtype, device=c_len_P.device).clamp(min=1.0)
    # [n] d(loss)/d(log p) of each chosen token is −weight_n
    weight_n = cfg.preference.nll_weight * kept_P[rows] / (c_len_P[rows] * count)
    _head_loss(
        cfg, head, scale, inputs.chosen_hidden_BTD[c_mask], weight_VD, inputs.chosen_labels_BT[c_mask],
        lambda stats, sl: -(weight_n[sl] * stats.logprobs).sum(),
    )


def compose_loss(
    cfg: LossConfig,
    head_weight_VD: torch.Tensor,
    *,
    policy: PolicyInputs | None = None,
    distill: DistillInputs | None = None,
    preference: PreferenceInputs | None = None,
    taid_t: float | None = None,
) -> ComposerOutput:
    """total = w·policy + α·distill + β·preference over the channels that are on (w: `policy_weight`).

    Chunked, the channels share one `FusedHead` (one `[V, D]` head-gradient buffer);
    preference runs first so that a single pair needs no scratch buffer.
    """
    head = FusedHead(head_weight_VD) if cfg.chunked else None
    runs = {
        "policy": (policy, cfg.policy_weight, lambda x, w: policy_channel(cfg, head_weight_VD, x, head, w)),
        "distill": (distill, cfg.alpha, lambda x, w: distill_channel(cfg, head_weight_VD, x, taid_t, head, w)),
        "preference": (preference, cfg.beta, lambda x, w: preference_channel(cfg, head_weight_VD, x, head, w)),
    }
    order = ("preference", "policy", "distill") if cfg.chunked else CHANNELS
    losses: dict[str, torch.Tensor] = {}
    metrics: dict[str, torch.Tensor] = {}
    for name in order:
        inputs, weight, run = runs[name]
        if inputs is None or weight == 0.0:
            continue
        losses[name], channel_metrics = run(inputs, weight)
        metrics.update(channel_metrics)
    if not losses:
        raise ValueError("no loss channel is active: pass at least one of policy / distill / preference inputs")
    active = tuple(name for name in CHANNELS if name in losses)
    # channels whose loss carries a graph add it; the others' gradients are in `head`
    in_head = sum((runs[n][1] * losses[n] for n in active if not losses[n].requires_grad), head_weight_VD.new_zeros(()))
    total = head.attach(in_head.float()) if head is not None else in_head.float()
    for name in active:
        if losses[name].requires_grad:
            total = total + runs[name][1] * losses[name]
    metrics["loss"] = total.detach()
    return ComposerOutput(total, active, metrics)


def metric_reduce_op(name: str) -> Literal["sum", "max"]:
    """How a metric combines across ranks / microbatches."""
    return "max" if name.endswith("_max") else "sum"


# sums over a subset of a channel's tokens, and the count they are averaged by
SUBSET_COUNTS = {"policy/rlsd_": "policy/rlsd_tokens"}


def summarize_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Reduced metrics → readable means (`x_sum` / tokens or pairs becomes `x_mean`; `SUBSET_COUNTS` names
    the sums over a subset of the tokens)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        channel = name.split("/")[0]
        count_key = f"{channel}/pairs" if channel == "preference" else f"{channel}/tokens"
        count_key = next((c for prefix, c in SUBSET_COUNTS.items() if name.startswith(prefix)), count_key)
        if name.endswith("_sum") and count_key in metrics:
            out[name[: -len("_sum")] + "_mean"] = float(value) / max(float(metrics[count_key]), 1.0)
        else:
            out[name] = float(value)
    return out
