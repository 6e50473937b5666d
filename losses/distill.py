"""Hint-distillation divergences (channel 2): generalized JSD, TAID, entropy-aware OPD.

The teacher is the policy itself run on a context with a textual hint inserted
at the error turn; its logits arrive aligned to the student's response tokens
and are always treated as constants (no gradient reaches the teacher).

Each divergence maps one row of student logits and one row of teacher logits to
a per-token value; `losses/logprobs.py` evaluates them chunk by chunk from hidden
states, and the channel loss is the sum over valid tokens divided by the global
valid-token count (`losses/reduce.py`).

Semantics (see shared/design/REFERENCES.md):
- generalized JSD (OPSD / TRL `generalized_jsd_loss`): logits / T (no T² factor),
  optional teacher top-k with renormalisation of both distributions over the
  teacher's top-k ids; β = 0 → KL(p_t ‖ p_s), β = 1 → KL(p_s ‖ p_t), otherwise
  β·KL(p_t ‖ m) + (1−β)·KL(p_s ‖ m) with m = β·p_t + (1−β)·p_s.
- TAID (SakanaAI/TAID): target softmax((1−t)·stopgrad(z_s) + t·z_t), loss the
  cross-entropy −Σ target·log p_s (the official `forward_kl`); `TAIDSchedule`
  is the adaptive, monotone, capped schedule of t (or the linear one alone).
- entropy-aware OPD: w = clamp(H(p_t)/h_max, 0, 1), w·KL(p_t‖p_s) + (1−w)·KL(p_s‖p_t).
- KL guard (`kl_guard_k3`): k3 = exp(lp_gen − lp) − (lp_gen − lp) − 1 per distilled token, lp the policy's
  logprob of the sampled token and lp_gen the generator's; `[loss.distill] kl_guard` weights its token mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from composer_mesh.losses.reduce import upcast

DistillKind = Literal["jsd", "taid", "eopd"]


@dataclass(frozen=True)
class DistillSpec:
    """What divergence to compute per token (the runtime form of `[loss.distill]`).

    kind: jsd | taid | eopd.  beta: JSD mixture weight of the teacher.
    temperature: divides both logits.  top_k: teacher top-k support (0 = full vocab).
    taid_t: TAID interpolation t for this step.  h_max: EOPD entropy scale (None = log V).
    """

    kind: DistillKind = "jsd"
    beta: float = 0.5
    temperature: float = 1.0
    top_k: int = 0
    taid_t: float = 0.4
    h_max: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("jsd", "taid", "eopd"):
            raise ValueError(f"distill kind must be jsd, taid or eopd, got {self.kind!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"distill beta must be in [0, 1], got {self.beta}")
        if self.temperature <= 0:
            raise ValueError(f"distill temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"distill top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.taid_t <= 1.0:
            raise ValueError(f"TAID t must be in [0, 1], got {self.taid_t}")


def _kl(logp_NV: torch.Tensor, logq_NV: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row from log-probabilities.  # [N]"""
    return (logp_NV.exp() * (logp_NV - logq_NV)).sum(-1)


def _support(
    student_logits_NV: torch.Tensor, teacher_logits_NV: torch.Tensor, spec: DistillSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled fp32 logits, restricted to the teacher's top-k when asked."""
    s_NV, t_NV = upcast(student_logits_NV), upcast(teacher_logits_NV.detach())
    if spec.temperature != 1.0:
        s_NV, t_NV = s_NV / spec.temperature, t_NV / spec.temperature
    if spec.top_k and spec.top_k < t_NV.shape[-1]:
        idx_NK = t_NV.topk(spec.top_k, dim=-1).indices
        s_NV, t_NV = s_NV.gather(-1, idx_NK), t_NV.gather(-1, idx_NK)
    return s_NV, t_NV


def generalized_jsd(
    student_logits_NV: torch.Tensor, teacher_logits_NV: torch.Tensor, spec: DistillSpec
) -> torch.Tensor:
    """Per-token generalized JSD (β endpoints are the two KL directions).  # [N]"""
    s_NV, t_NV = _support(student_logits_NV, teacher_logits_NV, spec)
    logs_NV, logt_NV = s_NV.log_softmax(-1), t_NV.log_softmax(-1)
    if spec.beta == 0.0:
        return _kl(logt_NV, logs_NV)
    if spec.beta == 1.0:
        return _kl(logs_NV, logt_NV)
    logm_NV = torch.logaddexp(logs_NV + math.log1p(-spec.beta), logt_NV + math.log(spec.beta))
    return spec.beta * _kl(logt_NV, logm_NV) + (1.0 - spec.beta) * _kl(logs_NV, logm_NV)


def taid_divergence(
    student_logits_NV: torch.Tensor, teacher_logits_NV: torch.Tensor, spec: DistillSpec
) -> torch.Tensor:
    """Per-token TAID loss −Σ p_t·log p_s, p_t = softmax((1−t)·sg(z_s) + t·z_t).  # [N]"""
    s_NV, t_NV = _support(student_logits_NV, teacher_logits_NV, spec)
    target_NV = ((1.0 - spec.taid_t) * s_NV.detach() + spec.taid_t * t_NV).softmax(-1)
    return -(target_NV * s_NV.log_softmax(-1)).sum(-1)


def entropy_aware_opd(
    student_logits_NV: torch.Tensor, teacher_logits_NV: torch.Tensor, spec: DistillSpec
) -> torch.Tensor:
    """Per-token w·KL(p_t‖p_s) + (1−w)·KL(p_s‖p_t), w = clamp(H(p_t)/h_max, 0, 1).  # [N]"""
    s_NV, t_NV = _support(student_logits_NV, teacher_logits_NV, spec)
    logs_NV, logt_NV = s_NV.log_softmax(-1), t_NV.log_softmax(-1)
    h_max = spec.h_max if spec.h_max is not None else math.log(t_NV.shape[-1])
    teacher_entropy_N = -(logt_NV.exp() * logt_NV).sum(-1)
    w_N = (teacher_entropy_N / h_max).clamp(0.0, 1.0)
    return w_N * _kl(logt_NV, logs_NV) + (1.0 - w_N) * _kl(logs_NV, logt_NV)


def kl_guard_k3(logprobs: torch.Tensor, gen_logprobs: torch.Tensor) -> torch.Tensor:
    """k3(π_θ ‖ π_gen) per sampled token: exp(x) − x − 1 with x = lp_gen − lp (≥ 0, 0 where they agree); the
    gradient reaches the policy's logprob only.  # same shape"""
    x = upcast(gen_logprobs).detach() - upcast(logprobs)
    return x.exp() - x - 1.0


_DIVERGENCES = {"jsd": generalized_jsd, "taid": taid_divergence, "eopd": entropy_aware_opd}


def token_divergence(
    student_logits_NV: torch.Tensor, teacher_logits_NV: torch.Tensor, spec: DistillSpec
) -> torch.Tensor:
    """The divergence `spec.kind` per token row; the teacher gets no gradient.  # [N]"""
    if student_logits_NV.shape != teacher_logits_NV.shape:
        raise ValueError(
            f"student and teacher logits must have the same shape, got "
            f"{tuple(student_logits_NV.shape)} and {tuple(teacher_logits_NV.shape)}"
        )
    return _DIVERGENCES[spec.kind](student_logits_NV, teacher_logits_NV, spec)


class TAIDSchedule:
    """TAID interpolation t (SakanaAI/TAID `update_t`).

    t starts at t_start; after each step the relative loss change feeds a
    momentum m ← β·m + (1−β)·(prev − loss)/prev, and
    t ← min(t_end, max(t_start + (t_end − t_start)·step/total, t + α·σ(m)·(1 − t))).
    t never decreases and never exceeds t_end. With `adaptive=False` (TAID's
    `disable_adaptive`) t is the linear schedule alone, from every update on
    (the official code keeps t_start after the first step): min(t_end, t_target).
    """

    def __init__(
        self, t_start: float = 0.4, t_end: float = 1.0, alpha: float = 5e-4, beta: float = 0.99,
        adaptive: bool = True,
    ) -> None:
        if not (0.0 <= t_start < 1.0 and 0.0 < t_end <= 1.0 and t_start <= t_end):
            raise ValueError(f"TAID needs 0 <= t_start < 1, 0 < t_end <= 1, t_start <= t_end; got {t_start}, {t_end}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"TAID alpha must be in [0, 1], got {alpha}")
        self.t_start, self.t_end, self.alpha, self.beta, self.adaptive = t_start, t_end, alpha, beta, adaptive
        self.t = t_start
        self.momentum = 0.0
        self.prev_loss: float | None = None

    def update(self, loss: float, step: int, total_steps: int) -> float:
        """Advance t after a step whose distillation loss was `loss`; returns the new t."""
        loss = float(loss)
        progress = step / max(total_steps, 1)
        t_target = self.t_start + (self.t_end - self.t_start) * progress
        if not self.adaptive:
            self.t = min(self.t_end, t_target)
            self.prev_loss = loss
            return self.t
        if self.prev_loss is None:
            self.prev_loss = loss
            return self.t
        relative_change = (self.prev_loss - loss) / (self.prev_loss + 1e-15)
        self.momentum = self.beta * self.momentum + (1.0 - self.beta) * relative_change
        adaptive_delta = 1.0 / (1.0 + math.exp(-self.momentum))
        self.t = min(self.t_end, max(t_target, self.t + self.alpha * adaptive_delta * (1.0 - self.t)))
        self.prev_loss = loss
        return self.t

    def state_dict(self) -> dict[str, float | None]:
        return {"t": self.t, "momentum": self.momentum, "prev_loss": self.prev_loss}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.t, self.momentum, self.prev_loss = state["t"], state["momentum"], state["prev_loss"]
