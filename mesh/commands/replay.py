"""`composer-mesh replay CONFIG.toml`: frozen traces → teachers → preference dataset."""

from __future__ import annotations

import argparse

NAME = "replay"
HELP = "Replay frozen agent traces with teacher models into a normalized preference dataset (resumable)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="recipe with [replay] and [teachers] (e.g. configs/replay_local.toml)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value ...")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs and CI); put it before CONFIG")


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from mesh.commands import load_job
    from mesh.commands.serve_teachers import build_responder
    from replay.pipeline import run_replay

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
            from replay.gating import HFScorer

            scorer = HFScorer(rc.gating.scorer_model)
        if args.no_progress:
            summary = run_replay(rc, tc, responder=responder, scorer=scorer)
        else:
            summary = _with_progress_bar(run_replay, rc, tc, responder, scorer)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    brief = {k: summary[k] for k in ("states", "outcomes", "pairs_raw", "spend_usd", "budget_usd", "teacher_calls")}
    brief["dataset_records"] = summary["dataset"]["records_out"]
    brief["failures"] = len(summary["failures"])
    print(json.dumps(brief))
    return 0


def _with_progress_bar(run_replay, rc, tc, responder, scorer):
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
