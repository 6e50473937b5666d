"""Preference records → validated, data-juicer-normalized dataset (JSONL) with stats.

Two stages:
- `validate_pairs`: checks the chosen/rejected that exist (both present, both
  non-empty, different actions, context present). Invalid records are dropped
  with a reason; nothing is ever re-synthesized.
- `run_recipe`: a data-juicer recipe (`replay/recipes/<name>.yaml` or a path)
  executed by data-juicer's own executor in a child process (its logging and
  imports stay out of the caller), offline, with per-record stats kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from composer_mesh.replay.pairs import action_key

RECIPES_DIR = Path(__file__).with_name("recipes")
_STATS_FIELD = "__dj__stats__"


def validate_pairs(records: Iterable[dict]) -> tuple[list[dict], Counter]:
    """(valid records, reasons for the dropped ones). Never edits chosen/rejected."""
    valid, dropped = [], Counter()
    for rec in records:
        try:
            chosen, rejected = json.loads(rec["chosen_json"]), json.loads(rec["rejected_json"])
            context = json.loads(rec["messages_json"])
        except (KeyError, TypeError, ValueError):
            dropped["unreadable"] += 1
            continue
        if not context:
            dropped["no_context"] += 1
        elif not str(rec.get("chosen", "")).strip() or not str(rec.get("rejected", "")).strip():
            dropped["empty_side"] += 1
        elif action_key(chosen) == action_key(rejected):
            dropped["chosen_equals_rejected"] += 1
        else:
            valid.append(rec)
    return valid, dropped


def load_recipe(recipe: str) -> dict[str, Any]:
    """A recipe by name (replay/recipes/<name>.yaml) or by path."""
    path = Path(recipe) if recipe.endswith((".yaml", ".yml")) else RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no data-juicer recipe {recipe!r} (built-in: {', '.join(names)})")
    return yaml.safe_load(path.read_text())


@dataclass
class NormalizeResult:
    dataset: Path
    records_in: int
    records_out: int
    dropped: dict[str, int] = field(default_factory=dict)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)  # stat -> min / mean / max

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "dataset": str(self.dataset)}


def _summarize_stats(records: list[dict]) -> dict[str, dict[str, float]]:
    values: dict[str, list[float]] = {}
    for rec in records:
        for k, v in (rec.get(_STATS_FIELD) or {}).items():
            if isinstance(v, (int, float)):
                values.setdefault(k, []).append(float(v))
    return {k: {"min": min(v), "mean": sum(v) / len(v), "max": max(v)} for k, v in values.items()}


def run_recipe(records: list[dict], out_dir: str | Path, recipe: str = "default", timeout_s: float = 900) -> NormalizeResult:
    """Validate `records`, run the recipe on them, return where the dataset is and its stats."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    valid, dropped = validate_pairs(records)
    dataset = out_dir / "dataset.jsonl"
    # data-juicer cannot load an empty JSONL; an empty dataset is the answer
    if not valid:
        dataset.write_text("")
        return NormalizeResult(dataset, len(records), 0, dict(dropped))
    work = out_dir / "dj"
    work.mkdir(exist_ok=True)
    source = work / "input.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in valid))
    cfg = {
        **load_recipe(recipe),
        "project_name": "composer-mesh-replay",
        "dataset_path": str(source),
        "export_path": str(dataset),
        "work_dir": str(work),
        "keep_stats_in_res_ds": True,
        "use_cache": False,
        "open_tracer": False,
        "skip_op_error": False,
    }
    cfg_path = work / "recipe.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(work / "data_juicer.log", "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "composer_mesh.replay.normalize", str(cfg_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
        )
    if proc.returncode != 0 or not dataset.exists():
        tail = (work / "data_juicer.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"data-juicer failed (exit {proc.returncode}); log {work / 'data_juicer.log'}:\n{tail}")
    out = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    return NormalizeResult(dataset, len(records), len(out), dict(dropped), _summarize_stats(out))


def _dj_main(cfg_path: str) -> int:
    """Child process: data-juicer's default executor on one config file."""
    # lazy: data-juicer is slow to import and only this child process needs it
    from data_juicer.config import init_configs
    from data_juicer.core import DefaultExecutor

    DefaultExecutor(init_configs(args=["--config", cfg_path])).run()
    return 0


if __name__ == "__main__":
    sys.exit(_dj_main(sys.argv[1]))
