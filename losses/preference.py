"""Trace-replay preference channel (channel 3): DPO, IPO and SimPO on chosen/rejected pairs,
with RPO's NLL anchor on the chosen response.

Pairs come from frozen agent traces (consensus of N teachers = chosen, the
recorded student action = rejected). Per-pair losses here; the channel loss is
their sum divided by the global pair count. Semantics: REFERENCES.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from composer_mesh.losses.reduce import upcast


def sequence_logprobs(token_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Σ_t log π(y_t) over the masked (response) tokens of each sequence.  # [B]"""
    return (upcast(token_logprobs_BT) * mask_BT).sum(-1)


def sequence_mean_logprobs(token_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Length-averaged logprob (SimPO's reward); 0 for an empty response.  # [B]"""
    return sequence_logprobs(token_logprobs_BT, mask_BT) / mask_BT.sum(-1).clamp(min=1)


def _log_ratio_gap(chosen_P, rejected_P, ref_chosen_P, ref_rejected_P) -> torch.Tensor:
    """Δ = (π_w − ref_w) − (π_l − ref_l), the reference detached.  # [P]"""
    return (upcast(chosen_P) - upcast(ref_chosen_P).detach()) - (upcast(rejected_P) - upcast(ref_rejected_P).detach())


def smoothed_sigmoid_loss(margin_P: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """−(1−ε)·log σ(m) − ε·log σ(−m): the preference label is flipped with probability ε
    (conservative DPO; TRL's sigmoid DPO and CPO/SimPO `label_smoothing`).  # [P]"""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    loss_P = -F.logsigmoid(margin_P)
    if label_smoothing:
        loss_P = (1.0 - label_smoothing) * loss_P - label_smoothing * F.logsigmoid(-margin_P)
    return loss_P


def dpo_loss(
    chosen_logps_P: torch.Tensor,
    rejected_logps_P: torch.Tensor,
    ref_chosen_logps_P: torch.Tensor,
    ref_rejected_logps_P: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid DPO per pair: −log σ(β·[(π_w − ref_w) − (π_l − ref_l)]), label-smoothed when ε > 0.

    Returns (loss [P], margin β·Δ [P], detached) — the margin is the implicit reward gap.
    """
    margin_P = beta * _log_ratio_gap(chosen_logps_P, rejected_logps_P, ref_chosen_logps_P, ref_rejected_logps_P)
    return smoothed_sigmoid_loss(margin_P, label_smoothing), margin_P.detach()


def ipo_loss(
    chosen_logps_P: torch.Tensor,
    rejected_logps_P: torch.Tensor,
    ref_chosen_logps_P: torch.Tensor,
    ref_rejected_logps_P: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """IPO per pair: (Δ − 1/(2β))² (arXiv:2310.12036 Eq. 17, β = τ).

    The caller passes sums or length averages (TRL averages policy and reference
    logprobs over each response's tokens). Returns (loss [P], Δ [P], detached).
    """
    delta_P = _log_ratio_gap(chosen_logps_P, rejected_logps_P, ref_chosen_logps_P, ref_rejected_logps_P)
    return (delta_P - 1.0 / (2.0 * beta)) ** 2, delta_P.detach()


def simpo_loss(
    chosen_avg_logps_P: torch.Tensor,
    rejected_avg_logps_P: torch.Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SimPO per pair: −log σ(β·(avg π_w − avg π_l) − γ), no reference model, label-smoothed
    when ε > 0 (TRL CPO `loss_type="simpo"`).

    Returns (loss [P], margin β·(avg_w − avg_l) − γ [P], detached).
    """
    margin_P = beta * (upcast(chosen_avg_logps_P) - upcast(rejected_avg_logps_P)) - gamma
    return smoothed_sigmoid_loss(margin_P, label_smoothing), margin_P.detach()


def rpo_nll(chosen_logps_P: torch.Tensor, chosen_len_P: torch.Tensor) -> torch.Tensor:
    """RPO's anchor (Pang et al. 2024, Eq. 3): −log π(y_w | x) / |y_w| per pair.  # [P]

    The chosen response's negative log-likelihood averaged over its own tokens (the
    paper normalises by the chosen sequence's length); the channel adds
    `nll_weight` × this to each pair's loss, so the batch term is the mean over
    pairs. TRL's `rpo_alpha` takes one token mean over all chosen tokens of the
    batch instead, which is the same number when the chosen lengths are equal.
    """
    return -upcast(chosen_logps_P) / chosen_len_P.clamp(min=1)


def pair_weight(margin_P: torch.Tensor) -> torch.Tensor:
    """σ(−m) per pair, detached: the size of the sigmoid loss's gradient, −d/dm log σ(m) = σ(−m) (DPO's
    m = β·Δ). A pair the policy already ranks far above the reference carries almost none.  # [P]"""
    return torch.sigmoid(-upcast(margin_P).detach())
