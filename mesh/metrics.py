"""Run metrics: one JSON line per step, TensorBoard scalars, a rich progress bar, a final PNG.

`MetricsSink` is the controller's `on_step` callback. Every step's record (the
trainer's reduced metrics plus reward, staleness and timing) goes to
`metrics.jsonl` and to TensorBoard event files under the run directory (and,
every `[metrics] rollouts_every` steps, the step's episodes to `rollouts.jsonl`); the
progress bar shows reward and the three channels' losses. `plot_run` draws
reward, the held-out curves from their step-0 baseline and each loss channel
per step from the JSONL file (so it also works on a finished or resumed run),
and writes the numbers it drew beside the PNG.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from composer_mesh.configs.sections.metrics import MetricsConfig

CHANNEL_LOSSES = ("policy/loss", "distill/loss", "preference/loss")
# logged by mesh.evaluation, on the steps it ran
HELDOUT = ("eval/heldout_greedy", "eval/heldout_sampled")


class MetricsSink:
    """Writes each step record where `[metrics]` asks; use as a context manager."""

    def __init__(self, cfg: MetricsConfig, run_dir: str | Path, total_steps: int, start_step: int = 0) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = None
        if cfg.jsonl:
            _drop_partial_row(self.run_dir / "metrics.jsonl")
            self.jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.tb = None
        if cfg.tensorboard:
            # lazy: start-up time; torch's TensorBoard writer loads only when [metrics] tensorboard is on
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.progress = None
        if cfg.progress_bar:
            self.progress = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]:.3f}  policy {task.fields[policy]:.4f}  "
                           "distill {task.fields[distill]:.4f}  replay {task.fields[preference]:.4f}"),
                TimeElapsedColumn(),
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, reward=0.0,
                                               policy=0.0, distill=0.0, preference=0.0)
            self.progress.start()

    def __call__(self, record: Any) -> None:
        """Log one `mesh.controller.StepRecord`."""
        row = {"step": record.step, "seconds": record.seconds, "groups": record.groups,
               "staleness": record.staleness, "pair_keys": record.pair_keys, **record.metrics}
        if record.rollouts:
            with open(self.run_dir / "rollouts.jsonl", "a", encoding="utf-8") as f:
                f.writelines(json.dumps({"step": record.step, **r}, default=str) + "\n" for r in record.rollouts)
        if record.step % self.cfg.log_every == 0:
            if self.jsonl is not None:
                self.jsonl.write(json.dumps(row) + "\n")
                self.jsonl.flush()
            self.scalars(record.step, record.metrics)
        if self.progress is not None:
            m = record.metrics
            self.progress.update(self.task, completed=record.step, reward=m.get("reward/mean", 0.0),
                                 **{c.split("/")[0]: m.get(c, 0.0) for c in CHANNEL_LOSSES})

    def scalars(self, step: int, metrics: dict[str, Any]) -> None:
        """TensorBoard scalars of `step` (the finite numbers in `metrics`)."""
        if self.tb is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(name, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _drop_partial_row(path: Path) -> None:
    """Cut a last row that a killed run left without its newline, so the next row starts on a line of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, the last row per step (a resumed run may repeat steps).

    A last row without its newline (a run killed mid-write) is not a logged step and is skipped;
    any other unreadable row is an error naming its line."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    rows: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows[int(row["step"])] = row
        except (ValueError, KeyError, TypeError) as exc:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}:{number}: not a metrics row ({exc})") from None
    return [rows[s] for s in sorted(rows)]


def process_age_s() -> float:
    """Seconds since this process started (the kernel's start time, 10 ms ticks), for summary.json's
    `timeline_s`: it counts the interpreter's start and imports before any run code; NaN without /proc."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return math.nan
    # field 22, counted after the parenthesised command name (which may hold spaces)
    start_ticks = int(stat[stat.rfind(")") + 2:].split()[19])
    return round(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 2)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (0.6 s to import on a 2-core box: a run loads it on a thread of its
    own while its steps run, `mesh.api.Run.run`)."""
    # lazy: choosing the Agg backend is process-wide, so only plotting may do it, before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    # lazy: pyplot must load after the backend is chosen
    import matplotlib.pyplot as plt

    return plt


def plot_panels(rows: list[dict[str, Any]], baseline: tuple[int, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """What `plot_run` draws, panel by panel: {"title", "series": {label: [[step, value], ...]}}. The held-out
    curves start at the run's step-0 `baseline` (an evaluation before training; a resumed run has none); coding
    tasks show pass rates (every hidden test passed) under that name; a loss channel the run did not train has no
    series and the title says "off"."""
    coding = any(k.startswith("coding/") for r in rows for k in r)
    base_step, base = baseline if baseline is not None else (None, {})

    def series(name: str, with_baseline: bool = False) -> list[list[float]]:
        points = [[base_step, base[name]]] if with_baseline and name in base else []
        return points + [[r["step"], r[name]] for r in rows if isinstance(r.get(name), (int, float))]

    def span(points: list[list[float]]) -> str:
        return f"{points[0][1]:.2f} \u2192 {points[-1][1]:.2f}"

    train = {"train": series("reward/mean")}
    panels = [{"title": f"train {'reward (hidden-test pass share)' if coding else 'reward'}: {span(train['train'])}",
               "series": train}]
    names = [f"{n}_pass" for n in HELDOUT] if coding else list(HELDOUT)
    heldout = {n.split("_")[1 if coding else -1]: series(n, with_baseline=True) for n in names}
    heldout = {label: points for label, points in heldout.items() if points}
    if heldout:
        what = "pass rate" if coding else "reward"
        figures = ", ".join(f"{label} {span(points)}" for label, points in heldout.items())
        panels.append({"title": f"held-out {what}: {figures}", "series": heldout})
    for name in CHANNEL_LOSSES:
        points = series(name)
        label = name.split("/")[0]
        title = f"{label} loss: {points[-1][1]:.3g} at step {points[-1][0]:g}" if points else f"{label} loss: off"
        panels.append({"title": title, "series": {label: points} if points else {}})
    return panels


def plot_run(metrics_path: str | Path, out_png: str | Path, baseline: tuple[int, dict[str, Any]] | None = None) -> Path:
    """The run on one PNG (`plot_panels`: training reward, held-out curves from their step-0 `baseline`, each
    loss channel or "off"); the numbers drawn go to a JSON file beside it (`plot.json` for `plot.png`)."""
    plt = pyplot()
    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path}: no metrics to plot")
    panels = plot_panels(rows, baseline)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, points in panel["series"].items():
            ax.plot(*zip(*points), marker=".", label=label if len(panel["series"]) > 1 else None)
        if len(panel["series"]) > 1:
            ax.legend(fontsize=8)
        if not panel["series"]:
            ax.text(0.5, 0.5, "off", ha="center", va="center", transform=ax.transAxes, fontsize=16, color="gray")
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel("step")
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    out_png.with_suffix(".json").write_text(json.dumps(panels, indent=1) + "\n")
    return out_png
