"""`TrainerSpec.from_job`: the trainer takes its sections from a loaded recipe."""

from __future__ import annotations

from pathlib import Path

from configs.loader import load_config
from titan_ext.trainer import TrainerSpec


def test_spec_from_recipe_sections_and_checkpoint_folder():
    job = load_config("debug_cpu.toml", ["--trainer.steps=7", "--checkpoint.folder=ck", "--parallelism.ep=2"])
    spec = TrainerSpec.from_job(job)
    assert spec.trainer.steps == 7 and spec.parallelism.ep == 2
    assert spec.model == job.model and spec.loss == job.loss and spec.optimizer == job.optimizer
    assert Path(spec.checkpoint_dir) == Path(job.job.output_dir) / job.job.name / "ck"
    off = TrainerSpec.from_job(load_config("debug_cpu.toml", ["--checkpoint.enabled=false"]))
    assert off.checkpoint_dir == ""
