"""Train/inference mismatch correction for the policy channel: importance weights and rejection.

The generator (vLLM, bf16, other kernels) samples from π_gen, the trainer
scores the same tokens with π_old; every policy token gets a constant
(detached) weight built from log m = logπ_old − logπ_gen:

- importance sampling (IS), truncated: per token min(max(m_t, C_min), C_max)
  (TIS; verl `rollout_is="token"`, TRL `token_truncate`) or per sequence from
  the product Π_t m_t = exp(Σ_t log m_t) (verl `rollout_is="sequence"`, TRL
  `sequence_truncate`);
- rejection sampling (RS, masking): a token, or every token of a sequence, is
  dropped (weight 0) when its statistic leaves [lower, upper]: the token ratio
  m_t (verl `rollout_rs="token"`, TRL `token_mask`), the sequence product
  (verl `"sequence"`, TRL `sequence_mask`) or the sequence geometric mean
  exp(mean_t log m_t) (verl `"geometric"`);
- veto (verl `rollout_token_veto_threshold`): a sequence with any token ratio
  below the veto threshold is dropped whole.

The weight is IS × keep; rejected tokens still count in the channel's token
denominator (TRL's convention; verl removes them from its token mean). Every
log-ratio (and sequence sum) is clamped to ±`LOG_RATIO_BOUND` before `exp`,
as verl does, so no weight overflows. Semantics and defaults: docs/losses.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from composer_mesh.configs.sections.loss import PolicyLossConfig
from composer_mesh.losses.reduce import segment_sum, upcast

# verl's SAFETY_BOUND: exp(20) ≈ 4.9e8, exp(−20) ≈ 2e-9.
LOG_RATIO_BOUND = 20.0

def needs_sequences(cfg: PolicyLossConfig) -> bool:
    """Whether the weight of a token depends on the other tokens of its sequence."""
    return cfg.is_level == "sequence" or cfg.rs_level in ("sequence", "geometric") or cfg.rs_veto is not None


@dataclass(frozen=True)
class MismatchWeights:
    # [N] IS weight × keep (detached)
    weight: torch.Tensor
    # [N] bool: dropped by rejection sampling or veto
    rejected: torch.Tensor


def _log_bound(x: float | None, default: float) -> float:
    return default if x is None else (math.log(x) if x > 0 else -math.inf)


def mismatch_weights(
    old_logprobs_N: torch.Tensor,
    gen_logprobs_N: torch.Tensor,
    seq_N: torch.Tensor | None,
    cfg: PolicyLossConfig,
) -> MismatchWeights:
    """The detached per-token weight (IS × rejection keep) of N policy tokens.

    cfg: the `[loss.policy]` section; its `is_level`, `tis_cap` / `tis_floor` (IS truncation, None:
        unbounded on that side), `rs_level`, `rs_max` / `rs_min` (rejection bounds; rs_min None =
        1/rs_max as verl, 0 = no lower bound) and `rs_veto` apply.
    seq_N: sequence index of each token in [0, S) (needed when `needs_sequences(cfg)`).
    """
    log_m_N = (upcast(old_logprobs_N) - upcast(gen_logprobs_N)).detach()
    token_N = log_m_N.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    seq_sum_N = seq_mean_N = None
    if needs_sequences(cfg):
        if seq_N is None or seq_N.shape != log_m_N.shape:
            raise ValueError("sequence-level mismatch correction needs the sequence index of every token")
        n_seq = int(seq_N.max()) + 1 if seq_N.numel() else 0
        sum_S = segment_sum(log_m_N, seq_N, n_seq)
        seq_sum_N = sum_S.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)[seq_N]
        seq_mean_N = (sum_S / segment_sum(torch.ones_like(log_m_N), seq_N, n_seq).clamp(min=1.0))[seq_N]

    if cfg.is_level == "none":
        weight_N = torch.ones_like(log_m_N)
    else:
        weight_N = (token_N if cfg.is_level == "token" else seq_sum_N).exp()
        if cfg.tis_cap is not None or cfg.tis_floor is not None:
            weight_N = weight_N.clamp(min=cfg.tis_floor, max=cfg.tis_cap)

    keep_N = torch.ones_like(log_m_N, dtype=torch.bool)
    if cfg.rs_level != "none":
        stat_N = {"token": token_N, "sequence": seq_sum_N, "geometric": seq_mean_N}[cfg.rs_level]
        upper = math.log(cfg.rs_max)
        lower = _log_bound(cfg.rs_min, -upper)
        keep_N = (stat_N >= lower) & (stat_N <= upper)
    if cfg.rs_veto is not None:
        bad_N = (log_m_N < math.log(cfg.rs_veto)).to(log_m_N.dtype)
        keep_N = keep_N & (segment_sum(bad_N, seq_N, n_seq)[seq_N] == 0)
    return MismatchWeights(torch.where(keep_N, weight_N, 0.0), ~keep_N)


def packed_sequence_ids(positions_BT: torch.Tensor) -> torch.Tensor:
    """One id per packed document: positions restart at 0 at each document start.  # [B, T]"""
    return (positions_BT == 0).flatten().cumsum(0).view_as(positions_BT)
