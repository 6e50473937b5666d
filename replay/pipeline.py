"""The replay run: traces → states → (gate) → teachers tier by tier → pairs → dataset.

Resumable by construction: every paid response is in the durable cache before
it is used and votes are a pure function of the responses, so a restarted run
re-asks only what was never answered and ends with the same pairs. Pairs are
written in (trace, step) order, then validated and normalized by data-juicer;
`summary.json` records counts, spend, cache hits, failures and stats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from composer_mesh.configs.sections.replay import ReplayConfig
from composer_mesh.configs.sections.teachers import TeachersConfig
from composer_mesh.replay.cache import ResponseCache
from composer_mesh.replay.gating import Scorer, VOIGate, settled, tiers
from composer_mesh.replay.normalize import run_recipe
from composer_mesh.replay.pairs import PreferencePair, Vote, decide
from composer_mesh.replay.server import FaultPlan, Responder, TeacherServer
from composer_mesh.replay.teachers import SKIPS, TeacherClient, tool_specs
from composer_mesh.replay.trace_io import ParseStats
from composer_mesh.replay.traces import TraceState, load_traces, trace_paths, trace_states


@dataclass
class StateResult:
    """What happened at one state."""

    trace_id: str
    step: int
    # pair | agrees_with_student | no_consensus | too_few_votes | gated_out | budget | context_length
    outcome: str
    teachers_asked: tuple[str, ...] = ()
    failures: list[dict] = field(default_factory=list)
    pair: PreferencePair | None = None
    uncertainty: dict | None = None
    # teachers that answered without an answer, and why ({"teacher", "reason"}: a reply's `refusal`)
    refusals: list[dict] = field(default_factory=list)


@dataclass
class Progress:
    """Running totals handed to the progress callback after each state."""

    states_done: int = 0
    states_total: int = 0
    pairs: int = 0
    spend_usd: float = 0.0
    cache_hits: int = 0


def load_states(cfg: ReplayConfig) -> tuple[list[TraceState], dict[str, Any]]:
    """All states of the configured trace files (a directory: its `*.jsonl`), and parse stats.

    Per file and in total: lines, skips and drops by reason with `file:line`,
    states refused, and warnings (empty input, a file with no usable trace, no
    state at all).
    """
    states, per_file, total = [], {}, ParseStats()
    paths, total.warnings = trace_paths(cfg.traces)
    for path in paths:
        traces, stats = load_traces(path, cfg.trace_format)
        for trace in traces:
            built = trace_states(trace, cfg.max_context_messages, stats)
            stats.states += len(built)
            states.extend(built)
        per_file[str(path)] = stats.as_dict()
        total.add(stats)
    if not states:
        total.warnings.append(f"no replayable state in {len(paths)} trace file(s)")
    if cfg.max_states:
        states = states[: cfg.max_states]
    return states, {"files": per_file, "total": total.as_dict()}


async def replay_states(
    states: list[TraceState],
    client: TeacherClient,
    cfg: ReplayConfig,
    *,
    gate: Callable[[TraceState], tuple[bool, Any]] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> list[StateResult]:
    """Ask the teachers about each state (tier by tier), vote, and return results in state order."""
    specs = client.cfg.models
    groups = tiers({t.name: t.tier for t in specs}, cfg.gating.tiered)
    weights = {t.name: t.weight for t in specs}
    slots = asyncio.Semaphore(cfg.concurrency)
    progress = Progress(states_total=len(states))

    async def one(state: TraceState) -> StateResult:
        async with slots:
            result = await _replay_one(state, client, cfg, groups, weights, gate)
        progress.states_done += 1
        progress.pairs += result.pair is not None
        progress.spend_usd = client.budget.spent_usd
        progress.cache_hits = client.stats.cache_hits
        if on_progress is not None:
            on_progress(progress)
        return result

    return list(await asyncio.gather(*(one(s) for s in states)))


async def _replay_one(state, client, cfg, groups, weights, gate) -> StateResult:
    uncertainty = None
    if gate is not None:
        wanted, u = await asyncio.to_thread(gate, state)
        uncertainty = dataclasses.asdict(u)
        if not wanted:
            return StateResult(state.trace_id, state.step, "gated_out", uncertainty=uncertainty)
    tools = tool_specs(state.tools) or None
    votes: list[Vote] = []
    failures: list[dict] = []
    refusals: list[dict] = []
    decision = None
    for group in groups:
        replies = await asyncio.gather(*(client.complete(name, list(state.context), tools) for name in group))
        for r in replies:
            votes.append(Vote(r.teacher, r.message, r.cost_usd, r.cached, r.error.kind if r.error else None))
            if r.error is not None:
                failures.append({"teacher": r.teacher, "kind": r.error.kind, "status": r.error.status,
                                 "attempts": r.attempts, "message": r.error.message})
            elif r.message.get("refusal"):
                refusals.append({"teacher": r.teacher, "reason": r.message["refusal"]})
        decision = decide(
            state, votes, min_agree=cfg.min_agree, strategy=cfg.strategy, weights=weights,
            min_weight_fraction=cfg.min_weight_fraction, equivalence=cfg.equivalence,
        )
        if settled(decision):
            break
    outcome = decision.outcome
    if decision.pair is None and failures:
        skips = [f["kind"] for f in failures if f["kind"] in SKIPS]
        # too long for the teachers, nothing failed
        if len(skips) == len(failures) and "context_length" in skips:
            outcome = "context_length"
        if "budget" in skips:
            outcome = "budget"
    return StateResult(state.trace_id, state.step, outcome, tuple(v.teacher for v in votes), failures,
                       decision.pair, uncertainty, refusals)


def group_refusals(counts: Mapping[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """(teacher, reason) -> replies, as teacher -> reason -> how many of its replies said it could not answer."""
    out: dict[str, dict[str, int]] = {}
    for (teacher, reason), n in sorted(counts.items()):
        out.setdefault(teacher, {})[reason] = n
    return out


def group_failures(failures: Iterable[dict], message_chars: int = 200) -> dict[str, dict[str, dict]]:
    """Teacher -> reason -> {count, status, message (the first, truncated)}; skips (budget,
    context length) included under their own reasons."""
    out: dict[str, dict[str, dict]] = {}
    for f in failures:
        reason = f["kind"] if f.get("status") is None else f"{f['kind']} {f['status']}"
        group = out.setdefault(f["teacher"], {}).setdefault(reason, {"count": 0, "status": f.get("status"),
                                                                     "message": f["message"][:message_chars]})
        group["count"] += 1
    return out


def run_replay(
    cfg: ReplayConfig,
    teachers: TeachersConfig,
    *,
    responder: Responder | None = None,
    scorer: Scorer | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> dict[str, Any]:
    """The whole run; returns (and writes to `<output_dir>/summary.json`) the summary.

    responder: answers for the local server when `cfg.local_server.enabled`;
    scorer: the student-uncertainty scorer when `cfg.gating.enabled`.
    """
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    states, parse = load_states(cfg)
    if cfg.gating.enabled and scorer is None:
        raise ValueError("replay.gating.enabled needs a scorer (set replay.gating.scorer_model)")
    server = None
    if cfg.local_server.enabled:
        if responder is None:
            raise ValueError("replay.local_server.enabled needs a responder")
        server = TeacherServer(
            responder, host=cfg.local_server.host, port=cfg.local_server.port,
            faults=FaultPlan(latency_s=cfg.local_server.latency_s),
            request_log=cfg.local_server.request_log or None,
        ).start()
        teachers = dataclasses.replace(teachers, base_url=server.url)
    cache = ResponseCache(teachers.cache_path or out / "cache.jsonl")
    gate = VOIGate(cfg.gating, scorer) if cfg.gating.enabled else None
    try:
        client = TeacherClient(teachers, cache)

        async def main() -> list[StateResult]:
            try:
                return await replay_states(states, client, cfg, gate=gate, on_progress=on_progress)
            finally:
                await client.aclose()

        results = asyncio.run(main())
    finally:
        cache.close()
        if server is not None:
            server.stop()
    pairs = [r.pair for r in results if r.pair is not None]
    raw = out / "pairs_raw.jsonl"
    records = [p.to_record() for p in pairs]
    raw.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    normalized = run_recipe(records, out, cfg.recipe)
    summary = {
        "states": len(states),
        "outcomes": dict(Counter(r.outcome for r in results)),
        "pairs_raw": len(pairs),
        "dataset": normalized.as_dict(),
        "spend_usd": client.budget.spent_usd,
        "budget_usd": client.budget.cap_usd,
        "prior_spend_usd": cache.prior_spend_nusd / 1e9,
        "budget_refusals": client.budget.refusals,
        "budget_overruns": client.budget.overruns,
        "inflight_at_previous_kill": cache.unresolved_at_load,
        "client": client.stats.as_dict(),
        "failures": [{"trace_id": r.trace_id, "step": r.step, **f} for r in results for f in r.failures],
        "failures_by_teacher": group_failures(f for r in results for f in r.failures),
        "refusals_by_teacher": group_refusals(Counter((x["teacher"], x["reason"]) for r in results
                                                      for x in r.refusals)),
        "states_failed": sum(r.outcome == "too_few_votes" and any(f["kind"] not in SKIPS for f in r.failures)
                             for r in results),
        "parse": parse,
        "teacher_calls": sum(len(r.teachers_asked) for r in results),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
