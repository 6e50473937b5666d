"""[metrics]: what the run reports and where."""

from __future__ import annotations

from dataclasses import dataclass

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class MetricsConfig:
    log_every: int = option(1, ge=1, doc="Log metrics every N steps.")
    jsonl: bool = option(True, doc="Write metrics.jsonl in the run directory.")
    tensorboard: bool = option(True, doc="Write TensorBoard event files.")
    progress_bar: bool = option(True, doc="Show a rich progress bar on a terminal.")
    plot: bool = option(True, doc="Write a PNG of reward and per-channel losses at the end.")
    rollouts_every: int = option(
        0, ge=0, doc="Append every N steps that step's episodes (each turn's text, reward, task, grade) to "
        "rollouts.jsonl in the run directory; 0 = never."
    )
