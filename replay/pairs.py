"""Teacher votes against the recorded action → preference pairs.

At one trace step every teacher proposes the next assistant message. Actions
are compared by an equivalence key (tool calls by name + canonical JSON
arguments, or normalised text); when at least `min_agree` teachers agree on an
action that differs from the student's, and that action wins the vote
(plurality of teachers, or a weighted-consensus share of the voting weight),
the pair is chosen = that action, rejected = the student's action.
"""

from __future__ import annotations

import json
import unicodedata
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from composer_mesh.replay.cache import canonical_json
from composer_mesh.replay.traces import TraceState

Equivalence = Literal["tool_call", "text"]
Strategy = Literal["plurality", "weighted"]


def normalize_text(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed: 'Run  the Tests.\\n' == 'run the tests.'"""
    return " ".join(unicodedata.normalize("NFKC", text or "").casefold().split())


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as canonical JSON (key order and spacing do not matter)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return normalize_text(arguments)
    return canonical_json(arguments)


def _calls(message: dict) -> tuple[tuple[str, str], ...]:
    """(name, canonical arguments) of each tool call, order-free (parallel calls commute)."""
    out = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        out.append((str(fn.get("name", "")), canonical_arguments(fn.get("arguments", "{}"))))
    return tuple(sorted(out))


def action_key(message: dict, mode: Equivalence = "tool_call") -> tuple:
    """Equivalence class of an assistant action (its reasoning never counts)."""
    calls = _calls(message)
    if mode == "tool_call" and calls:
        return ("tool", calls)
    if mode == "text":
        return ("text", normalize_text(message.get("content") or ""), calls)
    return ("text", normalize_text(message.get("content") or ""))


def render_action(message: dict) -> str:
    """Readable text of an action: reasoning, content, then one line per tool call."""
    parts = []
    if message.get("reasoning"):
        parts.append(f"<think>{message['reasoning']}</think>")
    if message.get("content"):
        parts.append(str(message["content"]))
    parts += [f"<tool_call>{name} {args}</tool_call>" for name, args in _calls(message)]
    return "\n".join(parts)


@dataclass(frozen=True)
class Vote:
    """One teacher's proposal at a state (message None when its call failed)."""

    teacher: str
    message: dict | None
    cost_usd: float = 0.0
    cached: bool = False
    error: str | None = None


@dataclass(frozen=True)
class PreferencePair:
    """chosen = the teachers' consensus action, rejected = the student's recorded action."""

    trace_id: str
    step: int
    context: tuple[dict, ...]
    chosen: dict
    rejected: dict
    # teacher -> "chosen" | "student" | "other" | "failed"
    votes: dict[str, str]
    agree: int
    teachers: tuple[str, ...]
    costs_usd: dict[str, float] = field(default_factory=dict)
    strategy: str = "plurality"
    # winner's share of the valid votes (or of the voting weight)
    support: float = 0.0
    # the run's episode the state comes from (TraceState.env_seed / env_split); None: a frozen trace
    env_seed: int | None = None
    env_split: str = "train"

    def to_record(self) -> dict[str, Any]:
        """A flat JSONL record (uniform schema: data-juicer's JSON loader needs it)."""
        prompt = "\n".join(f"[{m['role']}] {render_action(m) if m['role'] == 'assistant' else m.get('content', '')}" for m in self.context)
        chosen, rejected = render_action(self.chosen), render_action(self.rejected)
        users = [m.get("content", "") for m in self.context if m["role"] in ("user", "tool")]
        return {
            "id": f"{self.trace_id}:{self.step}",
            "trace_id": self.trace_id,
            "step": self.step,
            "text": f"{prompt}\n<chosen>\n{chosen}\n<rejected>\n{rejected}",
            "prompt": prompt,
            "query": users[-1] if users else "",
            "chosen": chosen,
            "rejected": rejected,
            "messages_json": canonical_json(list(self.context)),
            "chosen_json": canonical_json(self.chosen),
            "rejected_json": canonical_json(self.rejected),
            "votes_json": canonical_json(self.votes),
            "costs_json": canonical_json(self.costs_usd),
            "agree": self.agree,
            "teachers": list(self.teachers),
            "strategy": self.strategy,
            "support": self.support,
        }


@dataclass(frozen=True)
class Decision:
    """outcome: pair | agrees_with_student | no_consensus | too_few_votes."""

    outcome: str
    pair: PreferencePair | None = None
    unanimous: bool = False  # every valid vote fell in one class


def decide(
    state: TraceState,
    votes: Sequence[Vote],
    *,
    min_agree: int,
    strategy: Strategy = "plurality",
    weights: dict[str, float] | None = None,
    min_weight_fraction: float = 0.5,
    equivalence: Equivalence = "tool_call",
) -> Decision:
    """Vote on one state. The winner is the class with the most teachers (plurality)
    or the most weight (weighted, and its share must exceed `min_weight_fraction`);
    a tie for first is no consensus. A pair needs a winner that is not the
    student's action and at least `min_agree` teachers in it."""
    valid = [v for v in votes if v.message is not None]
    student = action_key(state.action, equivalence)
    classes: dict[tuple, list[Vote]] = defaultdict(list)
    for v in valid:
        classes[action_key(v.message, equivalence)].append(v)
    unanimous = len(classes) == 1
    if not valid:
        return Decision("too_few_votes")
    weights = weights or {}
    score = (lambda vs: sum(weights.get(v.teacher, 1.0) for v in vs)) if strategy == "weighted" else len
    ranked = sorted(classes.items(), key=lambda kv: -score(kv[1]))
    total = sum(score(vs) for vs in classes.values())
    win_key, win_votes = ranked[0]
    if len(ranked) > 1 and score(ranked[1][1]) == score(win_votes):
        return Decision("no_consensus", unanimous=unanimous)
    if win_key == student:
        return Decision("agrees_with_student", unanimous=unanimous)
    support = score(win_votes) / total
    if strategy == "weighted" and support <= min_weight_fraction:
        return Decision("no_consensus", unanimous=unanimous)
    if len(win_votes) < min_agree:
        return Decision("too_few_votes", unanimous=unanimous)
    labels = {}
    for v in votes:
        if v.message is None:
            labels[v.teacher] = "failed"
        else:
            key = action_key(v.message, equivalence)
            labels[v.teacher] = "chosen" if key == win_key else "student" if key == student else "other"
    pair = PreferencePair(
        trace_id=state.trace_id,
        step=state.step,
        context=state.context,
        chosen=win_votes[0].message,
        rejected=state.action,
        votes=labels,
        agree=len(win_votes),
        teachers=tuple(v.teacher for v in votes),
        costs_usd={v.teacher: v.cost_usd for v in votes},
        strategy=strategy,
        support=support,
        env_seed=state.env_seed,
        env_split=state.env_split,
    )
    return Decision("pair", pair, unanimous=unanimous)
