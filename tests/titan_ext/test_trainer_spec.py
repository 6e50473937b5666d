"""`TrainerSpec.from_job`, and what the trainer does with bad batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_mesh.configs.loader import load_config
from composer_mesh.titan_ext.spec import TrainerSpec


def test_spec_from_recipe_sections_and_checkpoint_folder():
    job = load_config("demo_cpu.toml", ["--trainer.steps=7", "--checkpoint.folder=ck", "--parallelism.ep=2"])
    spec = TrainerSpec.from_job(job)
    assert spec.trainer.steps == 7 and spec.parallelism.ep == 2
    assert spec.model == job.model and spec.loss == job.loss and spec.optimizer == job.optimizer
    assert Path(spec.checkpoint_dir) == Path(job.job.output_dir) / job.job.name / "ck"
    off = TrainerSpec.from_job(load_config("demo_cpu.toml", ["--checkpoint.enabled=false"]))
    assert off.checkpoint_dir == ""


def test_reference_dtype_is_the_serving_dtype_unless_set():
    assert TrainerSpec.from_job(load_config("demo_cpu.toml")).reference_dtype == "float32"
    bf16 = load_config("demo_cpu.toml", ["--generator.dtype=bfloat16"])
    assert TrainerSpec.from_job(bf16).reference_dtype == "bfloat16"
    pinned = load_config("demo_cpu.toml", ["--generator.dtype=bfloat16", "--trainer.dpo_reference_dtype=float32"])
    assert TrainerSpec.from_job(pinned).reference_dtype == "float32"
    # a spec made without a recipe has no serving dtype of its own: float32, as before the option
    assert TrainerSpec().reference_dtype == "float32"


@pytest.mark.slow
def test_bad_batches_fail_clearly_and_lose_nothing(tiny_assets, tmp_path):
    from test_trainer_harness import run_ranks

    result = run_ranks("bad_input", 1, tmp_path, {"hf_path": str(tiny_assets.dense_dir), "optimizer": "adamw"})
    errors = result["errors"]
    assert "tokens_BL holds token id 2048 >= the model's vocabulary size 2048" in errors["token_out_of_vocab"]
    assert errors["nan_advantages"].startswith("FloatingPointError: non-finite gradient norm")
    assert "dpo needs ref_chosen_logprobs_P" in errors["dpo_without_reference"]
    assert result["unchanged"]  # weights and optimizer state as before the bad batches
    assert result["step"] == 2 and result["loss"] == result["loss"]  # a good batch still trains
