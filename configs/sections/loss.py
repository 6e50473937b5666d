"""`[loss]`: the three-channel loss (policy + α·hint-distill + β·trace-replay).

Nested tables `[loss.policy]`, `[loss.distill]`, `[loss.preference]`. The loss
code (`losses/`) takes these dataclasses as its configuration, field for field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from composer_mesh.configs.fields import option


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
    is_level: Literal["token", "sequence", "none"] = option(
        "token",
        doc="mismatch IS weight (DAPO): per-token ratio exp(logp_old - logp_gen), per-sequence product, or none",
        choices=("token", "sequence", "none"),
    )
    tis_cap: float | None = option(2.0, doc="upper truncation C_max of the IS weight; unset = not truncated above", gt=0.0)
    tis_floor: float | None = option(None, doc="lower truncation C_min of the IS weight (TRL clip_min); unset = none", ge=0.0)
    rs_level: Literal["none", "token", "sequence", "geometric"] = option(
        "none",
        doc="mismatch rejection (DAPO): mask tokens / sequences whose token ratio, sequence product or "
        "geometric mean leaves [rs_min, rs_max]",
        choices=("none", "token", "sequence", "geometric"),
    )
    rs_max: float = option(2.0, doc="rejection upper threshold on the ratio statistic", gt=0.0)
    rs_min: float | None = option(None, doc="rejection lower threshold; unset = 1/rs_max (verl), 0 = no lower bound", ge=0.0)
    rs_veto: float | None = option(
        None, doc="drop a whole sequence holding a token with exp(logp_old - logp_gen) below this (verl veto)", gt=0.0
    )
    log_ratio_clamp: float | None = option(
        20.0, doc="clamp log r to +-this before exp in the DAPO / DPPO ratio (verl: 20); unset = no clamp", gt=0.0
    )
    adv_tau: float = option(1.0, doc="PRIME-DPPO: temperature on the advantage term (0 = KL term only)", ge=0.0)
    dppo_delta_low: float = option(0.2, doc="PRIME-DPPO: mask A<0 tokens with p_train - p_inf < -delta_low", ge=0.0)
    dppo_delta_high: float = option(0.2, doc="PRIME-DPPO: mask A>0 tokens with p_train - p_inf > delta_high", ge=0.0)
    kl_tau: float = option(1e-3, doc="PRIME-DPPO: weight of the (log r)^2 mismatch KL term", ge=0.0)
    overlong_max_len: int = option(0, doc="DAPO soft overlong punishment L_max in tokens; 0 = off", ge=0)
    overlong_buffer: int = option(0, doc="DAPO soft overlong buffer L_buf in tokens (0 < L_buf <= L_max when on)", ge=0)
    dynamic_sampling: bool = option(True, doc="DAPO dynamic sampling: drop groups whose rewards are all equal")

    def __post_init__(self) -> None:
        if self.tis_floor is not None and self.tis_cap is not None and self.tis_floor > self.tis_cap:
            raise ValueError(f"tis_floor ({self.tis_floor}) must be <= tis_cap ({self.tis_cap})")
        if self.rs_min is not None and self.rs_min >= self.rs_max:
            raise ValueError(f"rs_min ({self.rs_min}) must be < rs_max ({self.rs_max})")
        if self.kind == "prime_dppo" and (self.rs_level != "none" or self.rs_veto is not None):
            raise ValueError("rs_level / rs_veto apply to kind = 'dapo' (prime_dppo masks by its own delta_p rule)")
        if self.kind == "dapo" and self.adv_tau != 1.0:
            raise ValueError(f"adv_tau ({self.adv_tau}) applies to kind = 'prime_dppo' only")


# `[loss.distill] hint_kind` values (`replay.hints.make_hint_generator` builds each)
HINT_KINDS = ("template", "feedback", "reference", "reference_prefix", "failing_test", "llm")
# `[loss.distill] targets`: which failed rollouts get a hint (`mesh.hinting.HintMaker`)
HINT_TARGETS = ("failed", "all_fail_groups")


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
    taid_adaptive: bool = option(True, doc="TAID adaptive update of t; false = linear t_start -> t_end over the run's steps")
    eopd_h_max: float | None = option(None, doc="entropy-aware OPD entropy scale; unset = log(vocab)", gt=0.0)
    # what the hints of this channel hold (`replay.hints.make_hint_generator`)
    hint_kind: Literal["template", "feedback", "reference", "reference_prefix", "failing_test", "llm"] = option(
        "template",
        doc="what the teacher's hint holds: a template per error kind, the environment's feedback on the failure "
        "(SDPO), the task's reference solution (OPSD), the first lines the reference writes (a share adapted per "
        "task: hint_reveal_*), the hidden tests the attempt failed, or a teacher model's advice (hint_teacher)",
        choices=HINT_KINDS,
    )
    hint_max_chars: int = option(
        2000, doc="cap on the privileged text (feedback, reference, its lines or the failed tests) of one hint", ge=1
    )
    hint_teacher: str = option("", doc="hint_kind = 'llm': the [[teachers.models]] name that writes the hints")
    hint_reveal_start: float = option(
        0.5, doc="hint_kind = 'reference_prefix': share of the reference's written lines shown for a task at first",
        ge=0.0, le=1.0,
    )
    hint_reveal_step: float = option(
        0.25, doc="hint_kind = 'reference_prefix': the task's share grows by this after a group of it where every "
        "sample failed and shrinks by it after a group with a pass (AdaBack-style), within [0, 1]",
        ge=0.0, le=1.0,
    )
    targets: Literal["failed", "all_fail_groups"] = option(
        "failed",
        doc="which rollouts get a hint: every failed one, or only those of groups where no sample passed (where "
        "the policy gradient has no signal)",
        choices=HINT_TARGETS,
    )
    rlsd: bool = option(
        False,
        doc="RLSD: scale each sampled token's policy-gradient advantage of a hinted rollout by "
        "clip(exp(sign(A) * (log p_teacher - log p_student)), rlsd_w_min, rlsd_w_max) (needs hints, not alpha)",
    )
    rlsd_w_min: float = option(0.8, doc="RLSD: lower clip of the token weight", ge=0.0, le=1.0)
    rlsd_w_max: float = option(1.2, doc="RLSD: upper clip of the token weight", ge=1.0)
    kl_guard: float = option(
        0.0,
        doc="adds kl_guard x the mean over distilled tokens of k3 = exp(lp_gen - lp) - (lp_gen - lp) - 1 "
        "(policy vs the generator's logprobs of the sampled token) to the channel; 0 = off",
        ge=0.0,
    )

    def __post_init__(self) -> None:
        if self.hint_kind == "llm" and not self.hint_teacher:
            raise ValueError("loss.distill.hint_kind = 'llm' needs loss.distill.hint_teacher (a [[teachers.models]] name)")
        if self.hint_kind != "llm" and self.hint_teacher:
            raise ValueError(f"loss.distill.hint_teacher applies to hint_kind = 'llm' only (hint_kind is {self.hint_kind!r})")


@dataclass(frozen=True)
class PreferenceLossConfig:
    kind: Literal["dpo", "ipo", "simpo"] = option(
        "dpo", doc="trace-replay preference loss", choices=("dpo", "ipo", "simpo")
    )
    dpo_beta: float = option(0.1, doc="DPO beta; IPO's tau (its target margin is 1/(2 beta), as TRL's beta)", gt=0.0)
    simpo_beta: float = option(2.0, doc="SimPO beta (official default 2.0)", gt=0.0)
    simpo_gamma: float = option(0.5, doc="SimPO absolute margin gamma (TRL simpo_gamma)", ge=0.0)
    label_smoothing: float = option(
        0.0, doc="DPO / SimPO label smoothing eps (conservative DPO): preference flipped with probability eps", ge=0.0, lt=0.5
    )
    ipo_average: bool = option(True, doc="IPO on length-averaged logprobs (TRL); false = sequence sums (paper)")
    nll_weight: float = option(
        0.0,
        doc="RPO anchor: adds nll_weight x the chosen response's per-token mean NLL to each pair's loss (0 = off)",
        ge=0.0,
    )
    min_weight: float = option(
        0.0,
        doc="drop pairs whose DPO weight sigmoid(-margin) (DPO: margin = beta * delta) is below this: they add "
        "nothing and are counted (preference/dropped_low_weight); 0 = keep every pair",
        ge=0.0, lt=1.0,
    )

    def __post_init__(self) -> None:
        if self.kind == "ipo" and self.label_smoothing:
            raise ValueError("label_smoothing applies to kind 'dpo' and 'simpo', not 'ipo'")

    @property
    def needs_reference(self) -> bool:
        """DPO and IPO score against a frozen reference policy."""
        return self.kind in ("dpo", "ipo")

    @property
    def length_averaged(self) -> bool:
        """The loss sees each response's mean token logprob (SimPO; IPO as TRL), not the sum."""
        return self.kind == "simpo" or (self.kind == "ipo" and self.ipo_average)


@dataclass(frozen=True)
class LossConfig:
    policy_weight: float = option(
        1.0, doc="weight of the policy-gradient channel (0 = off: no rollout is trained by it; an ablation control)",
        ge=0.0,
    )
    alpha: float = option(1.0, doc="weight of the hint-distillation channel (0 = off)", ge=0.0)
    beta: float = option(1.0, doc="weight of the trace-replay preference channel (0 = off)", ge=0.0)
    chunked: bool = option(True, doc="apply the LM head chunk by chunk (never full [B, T, V] logits)")
    chunk_tokens: int = option(0, doc="tokens per LM-head chunk; 0 = derived from chunk_budget_mib", ge=0)
    chunk_budget_mib: float = option(32.0, doc="fp32 logits budget of one chunk in MiB", gt=0.0)
    policy: PolicyLossConfig = option(default_factory=PolicyLossConfig, doc="policy-gradient channel")
    distill: DistillLossConfig = option(default_factory=DistillLossConfig, doc="hint-distillation channel")
    preference: PreferenceLossConfig = option(default_factory=PreferenceLossConfig, doc="trace-replay channel")

    def __post_init__(self) -> None:
        if self.policy_weight == 0 and self.alpha == 0 and self.beta == 0:
            raise ValueError("policy_weight, alpha and beta are all 0: no loss channel would train")
