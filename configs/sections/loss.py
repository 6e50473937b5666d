"""`[loss]`: the three-channel loss (policy + α·hint-distill + β·trace-replay).

Nested tables `[loss.policy]`, `[loss.distill]`, `[loss.preference]`. The
runtime twin is `losses.composer.ComposerConfig.from_section(job.loss)`; a test
keeps the two field for field in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from configs.fields import option


@dataclass(frozen=True)
class PolicyLossConfig:
    kind: Literal["dapo", "prime_dppo"] = option(
        "dapo", doc="policy loss: DAPO clipped surrogate or PRIME-RL DPPO-mask + (log r)^2 KL", choices=("dapo", "prime_dppo")
    )
    adv_scale: Literal["group", "batch", "none"] = option(
        "group",
        doc="GRPO advantage scaling: group std, batch std (TRL scale_rewards=batch) or none (Dr.GRPO mean-only)",
        choices=("group", "batch", "none"),
    )
    adv_std: Literal["unbiased", "biased"] = option(
        "unbiased", doc="std estimator for advantages (verl and TRL: unbiased)", choices=("unbiased", "biased")
    )
    adv_eps: float = option(1e-6, doc="epsilon added to the std (verl 1e-6, TRL 1e-4)", ge=0.0)
    singleton: Literal["zero", "verl"] = option(
        "zero", doc="advantage of a one-sample group: 0, or verl's mean 0 / std 1 (= r)", choices=("zero", "verl")
    )
    eps_low: float = option(0.2, doc="DAPO lower clip: ratio >= 1 - eps_low", ge=0.0, lt=1.0)
    eps_high: float = option(0.28, doc="DAPO upper clip (clip-higher): ratio <= 1 + eps_high", ge=0.0)
    dual_clip_c: float | None = option(
        None, doc="dual-clip bound c (> 1) for negative advantages; unset = off", gt=1.0
    )
    tis_cap: float | None = option(
        2.0, doc="truncated importance sampling cap C on exp(logp_old - logp_gen); unset = no TIS", gt=0.0
    )
    dppo_delta_low: float = option(0.2, doc="PRIME-DPPO: mask A<0 tokens with p_train - p_inf < -delta_low", ge=0.0)
    dppo_delta_high: float = option(0.2, doc="PRIME-DPPO: mask A>0 tokens with p_train - p_inf > delta_high", ge=0.0)
    kl_tau: float = option(1e-3, doc="PRIME-DPPO: weight of the (log r)^2 mismatch KL term", ge=0.0)
    overlong_max_len: int = option(0, doc="DAPO soft overlong punishment L_max in tokens; 0 = off", ge=0)
    overlong_buffer: int = option(0, doc="DAPO soft overlong buffer L_buf in tokens (0 < L_buf <= L_max when on)", ge=0)
    dynamic_sampling: bool = option(True, doc="DAPO dynamic sampling: drop groups whose rewards are all equal")


@dataclass(frozen=True)
class DistillLossConfig:
    kind: Literal["jsd", "taid", "eopd"] = option(
        "jsd", doc="hint distillation divergence: generalized JSD, TAID or entropy-aware OPD", choices=("jsd", "taid", "eopd")
    )
    beta: float = option(0.5, doc="JSD teacher weight: 0 = KL(teacher||student), 1 = KL(student||teacher)", ge=0.0, le=1.0)
    temperature: float = option(1.0, doc="divides student and teacher logits (no T^2 factor)", gt=0.0)
    top_k: int = option(0, doc="restrict both distributions to the teacher's top-k ids, renormalised; 0 = full vocab", ge=0)
    taid_t_start: float = option(0.4, doc="TAID initial interpolation t", ge=0.0, lt=1.0)
    taid_t_end: float = option(1.0, doc="TAID cap on t", gt=0.0, le=1.0)
    taid_alpha: float = option(5e-4, doc="TAID adaptive step size alpha", ge=0.0, le=1.0)
    taid_beta: float = option(0.99, doc="TAID momentum of the relative loss change", ge=0.0, lt=1.0)
    eopd_h_max: float | None = option(None, doc="entropy-aware OPD entropy scale; unset = log(vocab)", gt=0.0)


@dataclass(frozen=True)
class PreferenceLossConfig:
    kind: Literal["dpo", "simpo"] = option("dpo", doc="trace-replay preference loss", choices=("dpo", "simpo"))
    dpo_beta: float = option(0.1, doc="DPO beta", gt=0.0)
    simpo_beta: float = option(2.0, doc="SimPO beta (official default 2.0)", gt=0.0)
    simpo_gamma: float = option(0.5, doc="SimPO absolute margin gamma (TRL simpo_gamma)", ge=0.0)


@dataclass(frozen=True)
class LossConfig:
    alpha: float = option(1.0, doc="weight of the hint-distillation channel (0 = off)", ge=0.0)
    beta: float = option(1.0, doc="weight of the trace-replay preference channel (0 = off)", ge=0.0)
    chunked: bool = option(True, doc="apply the LM head chunk by chunk (never full [B, T, V] logits)")
    chunk_tokens: int = option(0, doc="tokens per LM-head chunk; 0 = derived from chunk_budget_mib", ge=0)
    chunk_budget_mib: float = option(32.0, doc="fp32 logits budget of one chunk in MiB", gt=0.0)
    policy: PolicyLossConfig = option(default_factory=PolicyLossConfig, doc="policy-gradient channel")
    distill: DistillLossConfig = option(default_factory=DistillLossConfig, doc="hint-distillation channel")
    preference: PreferenceLossConfig = option(default_factory=PreferenceLossConfig, doc="trace-replay channel")
