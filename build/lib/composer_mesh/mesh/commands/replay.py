"""`composer-mesh replay CONFIG.toml`: frozen traces → teachers → preference dataset."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from composer_mesh.mesh.commands import load_job

NAME = "replay"
HELP = "Replay frozen agent traces with teacher models into a normalized preference dataset (resumable)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="recipe with [replay] and [teachers] (e.g. configs/replay_local.toml)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value ...")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs and CI); put it before CONFIG")


def run(args: argparse.Namespace) -> int:
    # lazy: start-up time: every command module loads to build the CLI; the replay pipeline and teacher server load only here
    from composer_mesh.mesh.responders import build_responder
    from composer_mesh.replay.pipeline import run_replay
    from composer_mesh.replay.teachers import SKIPS

    cfg = load_job(args)
    if cfg is None:
        return 2
    rc, tc = cfg.replay, cfg.teachers
    try:
        responder = (
            build_responder(rc.local_server.responder, rc.local_server.model_dir, rc.local_server.noise)
            if rc.local_server.enabled else None
        )
        scorer = None
        if rc.gating.enabled:
            # lazy: the HF scorer loads only when gating is on
            from composer_mesh.replay.gating import HFScorer

            scorer = HFScorer(rc.gating.scorer_model)
        if args.no_progress:
            summary = run_replay(rc, tc, responder=responder, scorer=scorer)
        else:
            summary = _with_progress_bar(run_replay, rc, tc, responder, scorer)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parse = summary["parse"]["total"]
    print(parse_report(summary["parse"]["files"], parse, summary["states"]))
    for warning in parse["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if summary["failures"]:
        print(failure_report(summary["failures_by_teacher"], summary["client"]["stopped"]))
    brief = {k: summary[k] for k in ("states", "outcomes", "pairs_raw", "spend_usd", "budget_usd", "teacher_calls")}
    brief["dataset_records"] = summary["dataset"]["records_out"]
    kinds = Counter(f["kind"] for f in summary["failures"])
    brief["failures"] = sum(n for kind, n in kinds.items() if kind not in SKIPS)
    brief["budget_refusals"] = kinds["budget"]
    brief["context_skips"] = kinds["context_length"]
    for key in ("skipped", "dropped", "states_dropped", "warnings"):
        brief[key] = parse[key]
    print(json.dumps(brief))
    if summary["states"] and not summary["pairs_raw"] and summary["states_failed"]:
        print(f"error: no pair made; {summary['states_failed']} of {summary['states']} states failed on teacher "
              "errors (above)", file=sys.stderr)
        return 1
    return 0 if summary["states"] else 1


def failure_report(by_teacher: dict[str, dict[str, dict]], stopped: dict[str, str]) -> str:
    """Human summary of failed and skipped teacher calls: a row per teacher and reason, with the first message."""
    # lazy: start-up time: every command module loads to build the CLI; the teacher client loads only here
    from composer_mesh.replay.teachers import SKIPS

    lines = ["teacher calls without an answer (teacher, reason, calls, first message):"]
    for teacher, reasons in by_teacher.items():
        for reason, g in sorted(reasons.items(), key=lambda kv: -kv[1]["count"]):
            label = "skipped" if reason.split()[0] in SKIPS else "failed"
            lines.append(f"  {teacher:<16} {label:<8} {reason:<20} {g['count']:>5}  {g['message']}")
    for teacher, message in stopped.items():
        lines.append(f"  {teacher:<16} stopped: its first calls all failed with: {message[:200]}")
    return "\n".join(lines)


def parse_report(files: dict[str, dict], total: dict, states: int) -> str:
    """Human summary of trace parsing: a row per file, then each reason with its count and first `file:line`s."""
    lines = [f"traces: {len(files)} file(s), {total['lines']} lines ({total['parsed']} parsed), "
             f"{total['traces']} traces, {total['states']} states built, {states} replayed"]
    for path, f in files.items():
        counts = f"{f['lines']} lines, {f['parsed']} parsed, {f['traces']} traces, {f['states']} states"
        lines.append(f"  file {path}: {counts}")
    for key, label in (("skipped", "skipped line"), ("dropped", "dropped record"),
                       ("states_dropped", "dropped state"), ("notes", "kept, repaired")):
        for reason, n in sorted(total[key].items()):
            where = total["where"].get(reason, [])
            more = ", ..." if n > len(where) else ""
            lines.append(f"  {label:<15} {reason:<40} {n:>6}  at {', '.join(where)}{more}")
    return "\n".join(lines)


def _with_progress_bar(run_replay, rc, tc, responder, scorer):
    # lazy: rich loads only when a progress bar is drawn
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TextColumn("states"),
        TextColumn("pairs {task.fields[pairs]}  spend ${task.fields[spend]:.4f}  cache hits {task.fields[hits]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns) as bar:
        task = bar.add_task("replay", total=None, pairs=0, spend=0.0, hits=0)

        def update(p) -> None:
            bar.update(task, completed=p.states_done, total=p.states_total, pairs=p.pairs, spend=p.spend_usd, hits=p.cache_hits)

        return run_replay(rc, tc, responder=responder, scorer=scorer, on_progress=update)
