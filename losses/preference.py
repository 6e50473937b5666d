"""Trace-replay preference channel (channel 3): DPO and SimPO on chosen/rejected pairs.

Pairs come from frozen agent traces (consensus of N teachers = chosen, the
recorded student action = rejected). Per-pair losses here; the channel loss is
their sum divided by the global pair count. Semantics: REFERENCES.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from losses.reduce import upcast


def sequence_logprobs(token_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Σ_t log π(y_t) over the masked (response) tokens of each sequence.  # [B]"""
    return (upcast(token_logprobs_BT) * mask_BT).sum(-1)


def sequence_mean_logprobs(token_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Length-averaged logprob (SimPO's reward); 0 for an empty response.  # [B]"""
    return sequence_logprobs(token_logprobs_BT, mask_BT) / mask_BT.sum(-1).clamp(min=1)


def dpo_loss(
    chosen_logps_P: torch.Tensor,
    rejected_logps_P: torch.Tensor,
    ref_chosen_logps_P: torch.Tensor,
    ref_rejected_logps_P: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid DPO per pair: −log σ(β·[(π_w − ref_w) − (π_l − ref_l)]).

    Returns (loss [P], margin β·Δ [P], detached) — the margin is the implicit reward gap.
    """
    delta_P = (upcast(chosen_logps_P) - upcast(ref_chosen_logps_P).detach()) - (
        upcast(rejected_logps_P) - upcast(ref_rejected_logps_P).detach()
    )
    return -F.logsigmoid(beta * delta_P), (beta * delta_P).detach()


def simpo_loss(
    chosen_avg_logps_P: torch.Tensor,
    rejected_avg_logps_P: torch.Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SimPO per pair: −log σ(β·(avg π_w − avg π_l) − γ), no reference model.

    Returns (loss [P], margin β·(avg_w − avg_l) − γ [P], detached).
    """
    margin_P = beta * (upcast(chosen_avg_logps_P) - upcast(rejected_avg_logps_P)) - gamma
    return -F.logsigmoid(margin_P), margin_P.detach()
