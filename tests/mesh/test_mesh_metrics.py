"""Metrics sink: JSONL rows, TensorBoard event scalars read back, progress bar, and the PNG plot."""

from __future__ import annotations

import json

from composer_mesh.configs.sections.metrics import MetricsConfig
from composer_mesh.mesh.controller import StepRecord


def record(step: int, reward: float) -> StepRecord:
    metrics = {"reward/mean": reward, "policy/loss": -0.1 * step, "distill/loss": 0.5 / step,
               "preference/loss": 0.69, "step": float(step), "async/max_staleness": 0.0}
    return StepRecord(step, metrics, reward, [0, 0], 0, 2, 1.5)


def test_jsonl_tensorboard_progress_and_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from composer_mesh.mesh.metrics import MetricsSink, plot_run, read_metrics

    with MetricsSink(MetricsConfig(progress_bar=True), tmp_path, total_steps=3) as sink:
        for step, reward in ((1, 0.1), (2, 0.3), (3, 0.6)):
            sink(record(step, reward))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["reward/mean"] == 0.6 and rows[0]["staleness"] == [0, 0]

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("distill/loss")
    assert [e.step for e in events] == [1, 2, 3] and abs(events[1].value - 0.25) < 1e-6

    # a resumed run appends: the last row of a step wins
    with MetricsSink(MetricsConfig(tensorboard=False, progress_bar=False), tmp_path, 3, start_step=2) as sink:
        sink(record(3, 0.9))
    assert [r["reward/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.1, 0.3, 0.9]

    png = plot_run(tmp_path / "metrics.jsonl", tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    drawn = json.loads((tmp_path / "run.json").read_text())
    assert drawn[0]["series"] == {"train": [[1, 0.1], [2, 0.3], [3, 0.9]]} and "0.10 \u2192 0.90" in drawn[0]["title"]


def test_plot_starts_held_out_curves_at_the_baseline_names_pass_rates_and_marks_channels_off(tmp_path):
    """What plot.png shows, read from the numbers it drew: the held-out curves begin at the step-0 baseline, a
    coding run's panels say pass rate, a channel the run never trained is "off" with no curve."""
    from composer_mesh.mesh.metrics import plot_run

    rows = [{"step": s, "reward/mean": 0.2 * s, "coding/turns": 2.0, "policy/loss": 1.0 / s,
             **({"eval/heldout_greedy_pass": 0.1 * s, "eval/heldout_sampled_pass": 0.15 * s,
                 "eval/heldout_greedy": 0.5} if s % 2 == 0 else {})} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    baseline = (0, {"eval/heldout_greedy_pass": 0.05, "eval/heldout_sampled_pass": 0.07, "eval/heldout_greedy": 0.4})
    plot_run(tmp_path / "metrics.jsonl", tmp_path / "plot.png", baseline)
    train, heldout, policy, distill, preference = json.loads((tmp_path / "plot.json").read_text())
    assert heldout["series"] == {"greedy": [[0, 0.05], [2, 0.2], [4, 0.4]], "sampled": [[0, 0.07], [2, 0.3], [4, 0.6]]}
    assert heldout["title"].startswith("held-out pass rate") and "greedy 0.05 \u2192 0.40" in heldout["title"]
    assert "pass" in train["title"] and policy["series"] == {"policy": [[1, 1.0], [2, 0.5], [3, 1 / 3], [4, 0.25]]}
    assert distill == {"title": "distill loss: off", "series": {}} and preference["title"] == "preference loss: off"
    # a run without a baseline (resumed) draws what its rows hold
    plot_run(tmp_path / "metrics.jsonl", tmp_path / "plot.png")
    assert json.loads((tmp_path / "plot.json").read_text())[1]["series"]["greedy"][0] == [2, 0.2]


def test_a_row_cut_short_by_a_kill_is_skipped_then_overwritten(tmp_path):
    import pytest

    from composer_mesh.mesh.metrics import MetricsSink, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean": 0.2}\n{"step": 3, "rew')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]  # the controller was killed writing step 3
    with MetricsSink(MetricsConfig(tensorboard=False, progress_bar=False), tmp_path, 3, start_step=2) as sink:
        sink(record(3, 0.9))  # the resumed run logs step 3 on a line of its own
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(path)] == [(1, 0.1), (2, 0.2), (3, 0.9)]
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 3

    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a metrics row"):
        read_metrics(path)
