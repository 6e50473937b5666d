"""Action equivalence, voting strategies, uncertainty gating and tiered escalation."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter

import pytest

from composer_mesh.configs.sections.replay import GatingConfig, ReplayConfig
from composer_mesh.configs.sections.teachers import TeachersConfig, TeacherSpec
from composer_mesh.replay.gating import HFScorer, Uncertainty, VOIGate, uncertainty_from_logits
from composer_mesh.replay.pairs import Vote, action_key, decide
from composer_mesh.replay.pipeline import replay_states
from composer_mesh.replay.server import TeacherServer
from composer_mesh.replay.teachers import TeacherClient
from composer_mesh.replay.traces import TraceState


def call(name: str, args: dict, id_: str = "x") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_tool_call_equivalence_ignores_argument_order_spacing_ids_and_call_order():
    a = {"role": "assistant", "content": "let me look", "tool_calls": [call("Read", {"path": "a", "limit": 5}, "1"), call("Bash", {"command": "ls"}, "2")]}
    b = {"role": "assistant", "content": "checking", "reasoning": "hmm", "tool_calls": [
        {"id": "9", "type": "function", "function": {"name": "Bash", "arguments": '{ "command" : "ls" }'}},
        {"id": "8", "type": "function", "function": {"name": "Read", "arguments": '{"limit":5,"path":"a"}'}}]}
    c = {"role": "assistant", "content": "", "tool_calls": [call("Read", {"path": "b", "limit": 5}), call("Bash", {"command": "ls"})]}
    assert action_key(a) == action_key(b) != action_key(c)
    assert action_key(a, "text") != action_key(b, "text")  # text mode compares the words too
    t1 = {"role": "assistant", "content": "  The answer is  42.\n"}
    t2 = {"role": "assistant", "content": "the ANSWER is 42."}
    assert action_key(t1) == action_key(t2) and action_key(t1, "text") == action_key(t2, "text")
    assert action_key(t1) != action_key(a)


def _state(action: dict) -> TraceState:
    return TraceState("tr", 0, ({"role": "user", "content": "q"},), action)


def _reference(student: str, votes: list[str | None], k: int, strategy: str, weights: list[float], frac: float) -> str | None:
    """The winner by the published rule, written independently: None when no pair."""
    tally: dict[str, float] = {}
    count: Counter = Counter()
    for v, w in zip(votes, weights):
        if v is not None:
            tally[v] = tally.get(v, 0.0) + (w if strategy == "weighted" else 1.0)
            count[v] += 1
    if not tally:
        return None
    best = max(tally.values())
    leaders = [a for a, s in tally.items() if s == best]
    if len(leaders) != 1 or leaders[0] == student or count[leaders[0]] < k:
        return None
    if strategy == "weighted" and best / sum(tally.values()) <= frac:
        return None
    return leaders[0]


@pytest.mark.parametrize("strategy", ["plurality", "weighted"])
def test_decide_matches_reference_on_random_votes(strategy):
    rng = random.Random(0)
    actions = ["ANSWER: 1", "answer: 1 ", "ANSWER: 2", "ANSWER: 3"]  # first two are equivalent
    def canon(a):
        return " ".join(a.casefold().split())

    pairs = 0
    for _ in range(2000):
        n = rng.randint(1, 6)
        votes = [rng.choice(actions + [None]) for _ in range(n)]
        weights = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(n)]
        student = rng.choice(actions)
        k = rng.randint(1, 3)
        d = decide(
            _state({"role": "assistant", "content": student}),
            [Vote(f"t{i}", None if v is None else {"role": "assistant", "content": v}) for i, v in enumerate(votes)],
            min_agree=k, strategy=strategy, weights={f"t{i}": w for i, w in enumerate(weights)}, min_weight_fraction=0.5,
        )
        ref = _reference(canon(student), [None if v is None else canon(v) for v in votes], k, strategy, weights, 0.5)
        assert (d.pair is None) == (ref is None), (votes, student, k)
        if d.pair is not None:
            pairs += 1
            assert canon(d.pair.chosen["content"]) == ref and d.pair.rejected["content"] == student
            assert d.pair.agree == sum(1 for v in votes if v is not None and canon(v) == ref)
            assert Counter(d.pair.votes.values())["chosen"] == d.pair.agree
            assert Counter(d.pair.votes.values())["failed"] == votes.count(None)
    assert pairs > 200


def test_uncertainty_from_logits_matches_the_formula():
    import torch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g) * 3
    u = uncertainty_from_logits(logits)
    ents, margins = [], []
    for row in logits.tolist():
        z = [math.exp(x - max(row)) for x in row]
        p = [x / sum(z) for x in z]
        ents.append(-sum(q * math.log(q) for q in p))
        top = sorted(p, reverse=True)
        margins.append(top[0] - top[1])
    assert u.entropy == pytest.approx(sum(ents) / len(ents), rel=1e-5)
    assert u.margin == pytest.approx(min(margins), rel=1e-5)


def test_gate_thresholds():
    gate = VOIGate(GatingConfig(enabled=True, min_entropy=1.0, max_margin=0.1), lambda s: s.action["u"])
    def s(e, m):
        return _state({"role": "assistant", "content": "", "u": Uncertainty(e, m)})

    assert gate(s(1.2, 0.9))[0] and gate(s(0.1, 0.05))[0] and not gate(s(0.5, 0.5))[0]


def test_hf_scorer_scores_the_action_tokens(tiny_assets):
    import torch

    scorer = HFScorer(tiny_assets.dense_dir)
    state = TraceState("t", 0, ({"role": "user", "content": "12 + 7"},), {"role": "assistant", "content": "ANSWER: 19"})
    u = scorer(state)
    tok, model = scorer.tokenizer, scorer.model
    prompt = tok.apply_chat_template([{"role": "user", "content": "12 + 7"}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    action = tok("ANSWER: 19", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + action])).logits[0]
    # token action[t] sits at position len(prompt)+t and is predicted by the logits one before it
    rows = [logits[len(prompt) + t - 1] for t in range(len(action))]
    ref = uncertainty_from_logits(torch.stack(rows))
    assert u.entropy == pytest.approx(ref.entropy) and u.margin == pytest.approx(ref.margin)
    assert 0 < u.entropy <= math.log(logits.shape[-1]) + 1e-4


def test_tiered_escalation_asks_expensive_teachers_only_on_disagreement():
    def responder(model, messages, params):
        q = messages[-1]["content"]
        if model == "cheap-b" and q == "split":
            return "ANSWER: 5"
        return "ANSWER: 4"

    states = [
        TraceState("t", 0, ({"role": "user", "content": "agree"},), {"role": "assistant", "content": "ANSWER: 3"}),
        TraceState("t", 1, ({"role": "user", "content": "split"},), {"role": "assistant", "content": "ANSWER: 3"}),
        TraceState("t", 2, ({"role": "user", "content": "student right"},), {"role": "assistant", "content": "ANSWER: 4"}),
    ]
    with TeacherServer(responder) as server:
        specs = (TeacherSpec(name="a", model="cheap-a", tier=0), TeacherSpec(name="b", model="cheap-b", tier=0),
                 TeacherSpec(name="c", model="big-c", tier=1), TeacherSpec(name="d", model="big-d", tier=1))
        client = TeacherClient(TeachersConfig(models=specs, base_url=server.url))

        async def go():
            try:
                return await replay_states(states, client, ReplayConfig(min_agree=2))
            finally:
                await client.aclose()

        results = asyncio.run(go())
    asked = {r.step: set(r.teachers_asked) for r in results}
    assert asked == {0: {"a", "b"}, 1: {"a", "b", "c", "d"}, 2: {"a", "b"}}
    assert [r.outcome for r in results] == ["pair", "pair", "agrees_with_student"]
    assert results[1].pair.agree == 3 and results[1].pair.votes == {"a": "chosen", "b": "other", "c": "chosen", "d": "chosen"}
    assert Counter(r["model"] for r in server.log) == {"cheap-a": 3, "cheap-b": 3, "big-c": 1, "big-d": 1}
