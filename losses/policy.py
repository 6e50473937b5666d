"""Policy-gradient channel (channel 1): GRPO advantages, DAPO, PRIME-RL DPPO.

Group-level pieces run when a batch is packed (advantages, dynamic-sampling
filter, soft overlong shaping); token-level pieces run inside the loss and are
*per-token* terms, so the channel loss is Σ_valid ℓ_t / N_global with the global
valid-token count passed in explicitly (microbatching and data parallelism do
not change the result). Mismatch weights (TIS, rejection): `losses/mismatch.py`.
RLSD (`rlsd_weights`) scales a token's advantage by how much the hinted teacher of
channel 2 changes its probability. Semantics: shared/design/REFERENCES.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from composer_mesh.configs.sections.loss import PolicyLossConfig
from composer_mesh.losses.reduce import segment_sum, upcast


def _group_index(group_ids_N: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, inverse_N = torch.unique(group_ids_N, return_inverse=True)
    return inverse_N, int(inverse_N.max().item()) + 1 if inverse_N.numel() else 0


def group_stats(
    rewards_N: torch.Tensor, group_ids_N: torch.Tensor, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, group std and group size (each [N]); std of a singleton is 0."""
    r_N = upcast(rewards_N)
    g_N, n_groups = _group_index(group_ids_N)
    size_G = segment_sum(torch.ones_like(r_N), g_N, n_groups)
    mean_G = segment_sum(r_N, g_N, n_groups) / size_G
    sq_G = segment_sum((r_N - mean_G[g_N]) ** 2, g_N, n_groups)
    denom_G = (size_G - 1.0).clamp(min=1.0) if unbiased else size_G
    std_G = torch.where(size_G > 1, (sq_G / denom_G).sqrt(), torch.zeros_like(sq_G))
    return mean_G[g_N], std_G[g_N], size_G[g_N]


def grpo_advantages(rewards_N: torch.Tensor, group_ids_N: torch.Tensor, cfg: PolicyLossConfig) -> torch.Tensor:
    """Â_i = (r_i − mean_g) / (std + ε) under the `[loss.policy]` conventions.  # [N]

    adv_scale: divide by the group std ("group", verl/TRL default), by the std of all rewards in the
        batch ("batch", TRL `scale_rewards="batch"`), or not at all ("none", Dr.GRPO mean-only baseline).
    adv_std: unbiased (N−1, verl and TRL) or biased (N).  adv_eps: added to the std (verl 1e-6, TRL 1e-4).
    singleton: a group of one gets advantage 0 ("zero", TRL-like) or verl's mean 0 / std 1, i.e.
        r / (1 + eps) ("verl").
    """
    if rewards_N.shape != group_ids_N.shape or rewards_N.dim() != 1:
        raise ValueError(f"rewards and group ids must both be [N], got {tuple(rewards_N.shape)}, {tuple(group_ids_N.shape)}")
    unbiased = cfg.adv_std == "unbiased"
    r_N = upcast(rewards_N)
    mean_N, std_N, size_N = group_stats(r_N, group_ids_N, unbiased)
    if cfg.adv_scale == "group":
        adv_N = (r_N - mean_N) / (std_N + cfg.adv_eps)
    elif cfg.adv_scale == "batch":
        batch_std = r_N.std(unbiased=unbiased) if r_N.numel() > 1 else r_N.new_zeros(())
        adv_N = (r_N - mean_N) / (batch_std + cfg.adv_eps)
    else:
        adv_N = r_N - mean_N
    single_N = size_N == 1
    if cfg.singleton == "verl":
        single_adv_N = r_N / (1.0 + cfg.adv_eps) if cfg.adv_scale != "none" else r_N
    else:
        single_adv_N = torch.zeros_like(r_N)
    return torch.where(single_N, single_adv_N, adv_N)


def dynamic_sampling_keep(rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal.  # [N] bool"""
    r_N = upcast(rewards_N)
    g_N, n_groups = _group_index(group_ids_N)
    big = torch.finfo(r_N.dtype).max
    max_G = r_N.new_full((n_groups,), -big).scatter_reduce(0, g_N, r_N, "amax")
    min_G = r_N.new_full((n_groups,), big).scatter_reduce(0, g_N, r_N, "amin")
    return (max_G > min_G)[g_N]


def overlong_penalty(lengths_N: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment added to the reward.  # [N]

    0 for |y| ≤ L_max − L_buf; (L_max − L_buf − |y|) / L_buf up to L_max; −1 beyond.
    """
    if buffer <= 0 or buffer > max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    y_N = lengths_N.to(torch.float64)
    soft_N = ((max_len - buffer) - y_N) / buffer
    return torch.where(y_N > max_len, -1.0, soft_N.clamp(max=0.0)).to(torch.float32)


def _ratio(log_ratio: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """exp(log r), log r clamped to ±clamp first (verl clamps at 20): no overflow to inf."""
    return (log_ratio if clamp is None else log_ratio.clamp(-clamp, clamp)).exp()


@dataclass(frozen=True)
class DapoTerms:
    """Per-token DAPO loss and the masks its metrics need."""

    # per-token −min(ρÂ, clip(ρ)Â) (dual-clipped, mismatch-weighted)
    loss: torch.Tensor
    ratio: torch.Tensor  # ρ (detached)
    # bool: the clipped branch was taken
    clipped: torch.Tensor


def dapo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    mismatch_weight: torch.Tensor | None = None,
    log_ratio_clamp: float | None = 20.0,
) -> DapoTerms:
    """DAPO clipped surrogate per token (elementwise, any shape).

    ρ = exp(clamp(logπ − logπ_old, ±log_ratio_clamp)); ℓ = max(−Âρ, −Â·clip(ρ, 1−ε_low,
    1+ε_high)); with dual clip (c > 1) negative-advantage tokens are capped at −Â·c
    (verl); a mismatch weight (`losses/mismatch.py`) multiplies ℓ. Without the clamp
    an Â < 0 token with log ρ > 89 (fp32) and no dual clip has an infinite loss.
    """
    log_ratio = upcast(logprobs) - upcast(old_logprobs).detach()
    ratio = _ratio(log_ratio, log_ratio_clamp)
    adv = upcast(advantages).detach()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    took_clip = clipped > unclipped
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual-clip c must be > 1, got {dual_clip_c}")
        capped = torch.minimum(loss, -adv * dual_clip_c)
        took_clip = took_clip | ((adv < 0) & (capped < loss))
        loss = torch.where(adv < 0, capped, loss)
    if mismatch_weight is not None:
        loss = loss * mismatch_weight.detach()
    return DapoTerms(loss, ratio.detach(), took_clip)


def prime_dppo_token_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    kl_tau: float = 1e-3,
    adv_tau: float = 1.0,
    log_ratio_clamp: float | None = 20.0,
) -> DapoTerms:
    """PRIME-RL DPPO-mask loss per token: −keep·τ_A·Â·r + τ_KL·(log r)².

    log r = logπ_train − logπ_inf, Δp = π_train − π_inf; tokens with Δp > δ_high
    (Â > 0) or Δp < −δ_low (Â < 0) are masked out of the policy term (`clipped`).
    τ_A is PRIME-RL's `adv_tau` (0 leaves only the KL term); r = exp(log r clamped
    to ±log_ratio_clamp), the (log r)² term is not clamped.
    """
    log_ratio = upcast(logprobs) - upcast(inference_logprobs).detach()
    ratio = _ratio(log_ratio, log_ratio_clamp)
    adv = upcast(advantages).detach()
    delta_p = (upcast(logprobs).exp() - upcast(inference_logprobs).exp()).detach()
    masked = ((adv > 0) & (delta_p > delta_high)) | ((adv < 0) & (delta_p < -delta_low))
    loss = torch.where(masked, 0.0, -adv_tau * adv * ratio) + kl_tau * log_ratio**2
    return DapoTerms(loss, ratio.detach(), masked)


def rlsd_weights(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    w_min: float,
    w_max: float,
) -> torch.Tensor:
    """RLSD token weights (Self-Distilled RLVR, arXiv:2604.03128), elementwise, detached.

    Δ_t = sg(log π_T(y_t | x, hint, y<t) − log π_S(y_t | x, y<t)) and w_t = clip(exp(sign(A_t)·Δ_t), w_min, w_max):
    the verifier's advantage sets the direction, the hinted teacher the size (the advantage becomes A_t·w_t).
    sign(0) = 0, so a zero advantage keeps w = 1.
    """
    delta = (upcast(teacher_logprobs) - upcast(student_logprobs)).detach()
    return (torch.sign(upcast(advantages).detach()) * delta).exp().clamp(w_min, w_max)
