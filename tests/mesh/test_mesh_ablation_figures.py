"""benchmarks/ablation.py's figures from kept runs: the paired delta and its standard error, a run that exited 3.

The paired standard error is checked against the formula written here (sd of the per-seed differences over
sqrt(n)), on random gains.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _ablation():
    spec = importlib.util.spec_from_file_location("ablation", REPO / "benchmarks" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ablation"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _run(ablation, before: float, after: float):
    return ablation.RunResult(heldout=[(0, 0.0, before, 0.0), (10, 5.0, after, 0.0)], train_gain=0.0, wall_s=1.0,
                              train_s=5.0, tokens=0.0, spend_usd=0.0, policy_rollouts=0.0, hinted=0.0, pairs=0.0,
                              replayed=0.0, pair_rate=0.0)


def test_paired_delta_is_the_mean_and_standard_error_of_per_seed_differences():
    ablation = _ablation()
    rng = random.Random(0)
    for n in (2, 3, 6):
        before = [rng.random() for _ in range(n)]
        gains_a, gains_b = [rng.uniform(-0.3, 0.3) for _ in range(n)], [rng.uniform(-0.3, 0.3) for _ in range(n)]
        runs = [_run(ablation, b, b + g) for b, g in zip(before, gains_a)]
        base = [_run(ablation, b, b + g) for b, g in zip(before, gains_b)]
        d = [a - b for a, b in zip(gains_a, gains_b)]
        mean = sum(d) / n
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) / math.sqrt(n)
        assert ablation.paired_delta(runs, base) == pytest.approx((mean, se), abs=1e-4)
    with pytest.raises(ValueError):  # unpaired: a seed missing on one side
        ablation.paired_delta(runs, base[:-1])


def test_a_run_that_trained_nothing_is_read_with_its_base_figures(tmp_path):
    """An untrained run (exit 3) still evaluated before and after: its gain and the base's figures are read."""
    ablation = _ablation()
    before = {"eval/heldout_sampled_pass": 0.025, "eval/heldout_greedy_pass": 0.0, "eval/heldout_hint_gap": -0.025,
              "eval/heldout_all_fail_share": 0.9, "eval/heldout_pass_at_k": 0.1}
    row = {"step": 0, "seconds": 0.6, "reward/mean": 0.0, "eval/heldout_sampled_pass": 0.025,
           "eval/heldout_greedy_pass": 0.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    result = ablation.read_run(tmp_path, {"heldout": {"before": before}}, "coding_hard", 3.0)
    assert result.gain() == 0.0 and result.base == {"hint_gap": -0.025, "all_fail_share": 0.9, "pass_at_k": 0.1}
