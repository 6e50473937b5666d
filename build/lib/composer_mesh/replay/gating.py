"""Which states are worth paying teachers for, and which teachers to ask.

Value-of-information gating: a scorer measures the student's uncertainty on its
own recorded action (mean token entropy, smallest top-2 probability margin);
a confident student rarely yields a pair, so only uncertain states are
replayed. The scorer is a callback: the trainer's policy inside the
application, `HFScorer` (a local HF model) offline.

Tiered escalation: teachers are asked tier by tier (cheap first); the next tier
is asked only while the votes so far disagree (or are too few for a pair).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from composer_mesh.configs.sections.replay import GatingConfig
from composer_mesh.replay.pairs import Decision, render_action
from composer_mesh.replay.traces import TraceState


@dataclass(frozen=True)
class Uncertainty:
    """entropy: mean next-token entropy (nats) over the action's tokens;
    margin: smallest p(top-1) - p(top-2) over those tokens."""

    entropy: float
    margin: float


Scorer = Callable[[TraceState], Uncertainty]


def uncertainty_from_logits(logits_TV: Any) -> Uncertainty:
    """Uncertainty of T action tokens from their next-token logits [T, V] (a torch tensor)."""
    # lazy: torch is needed only to score with a model; the replay run starts without it
    import torch

    logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    top2_T2 = logp_TV.exp().topk(2, dim=-1).values
    return Uncertainty(float(entropy_T.mean()), float((top2_T2[:, 0] - top2_T2[:, 1]).min()))


class HFScorer:
    """Uncertainty of a local HF causal LM on the recorded action, given the context."""

    def __init__(self, model_dir: str | Path) -> None:
        # lazy: transformers is needed only to score with a local model; the replay run starts without it
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()

    def __call__(self, state: TraceState) -> Uncertainty:
        # lazy: torch is needed only to score with a local model; the replay run starts without it
        import torch

        context = [
            {"role": m["role"], "content": render_action(m) if m["role"] == "assistant" else str(m.get("content") or "")}
            for m in state.context
        ]
        prompt = self.tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompt_ids = list(prompt["input_ids"])
        action_ids = self.tokenizer(render_action(state.action) or " ", add_special_tokens=False)["input_ids"]
        ids_1L = torch.tensor([prompt_ids + action_ids])
        with torch.no_grad():
            logits_1LV = self.model(ids_1L).logits
        # logits at position i predict token i + 1: the action's predictors start one before it
        start = len(prompt_ids) - 1
        return uncertainty_from_logits(logits_1LV[0, start : start + len(action_ids)])


class VOIGate:
    """Query teachers for a state only when the student is uncertain enough."""

    def __init__(self, cfg: GatingConfig, scorer: Scorer) -> None:
        self.cfg = cfg
        self.scorer = scorer

    def __call__(self, state: TraceState) -> tuple[bool, Uncertainty]:
        u = self.scorer(state)
        return (u.entropy >= self.cfg.min_entropy or u.margin <= self.cfg.max_margin), u


def tiers(teachers: dict[str, int], tiered: bool) -> list[list[str]]:
    """Teacher names grouped by tier, lowest first (one group when not tiered)."""
    if not tiered:
        return [list(teachers)]
    levels = sorted(set(teachers.values()))
    return [[name for name, t in teachers.items() if t == level] for level in levels]


def settled(decision: Decision) -> bool:
    """No need to escalate: the votes so far all agree, and either with the student or in a pair."""
    return decision.unanimous and decision.outcome in ("pair", "agrees_with_student")
