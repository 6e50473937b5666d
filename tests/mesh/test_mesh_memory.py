"""The start-up memory budget (`mesh.memory`): the estimate's arithmetic against the formula written out here,
the parameter count against transformers' own, and a real `composer-mesh train` of a 32B-shaped checkpoint
(config.json only: counting needs no weights) refused with the numbers before any actor starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from composer_mesh.configs.loader import load_config

REPO = Path(__file__).resolve().parents[2]


def job_with(**overrides):
    items = [f"--{k}={v}" for k, v in overrides.items()]
    return load_config(REPO / "configs/demo_cpu.toml", items)


def test_estimate_is_the_documented_formula():
    from composer_mesh.mesh import memory

    params = 123_456_789
    job = job_with(**{"mesh.trainer_procs": 2, "trainer.max_staleness": 1, "generator.dtype": "bfloat16",
                      "optimizer.name": "adamw"})
    est = memory.estimate(job, params)
    # the frozen reference is kept in the serving dtype (bf16 here)
    reference = 2 if job.loss.preference.needs_reference and job.loss.beta > 0 else 0
    trainer = memory.FIXED_BYTES["trainer"] + (4 + 4 + 8 + reference + memory.TRAINER_REST_BYTES_PER_PARAM) * params / 2
    generator = memory.FIXED_BYTES["generator"] + (2 + memory.GENERATOR_REST_BYTES_PER_PARAM) * params
    assert est.per_process["trainer"] == int(trainer) and est.per_process["generator"] == int(generator)
    assert est.processes == {"controller": 1, "trainer": 2, "generator": 1, "replay": 1}
    assert est.shm == (2 + 1 + 1) * 2 * params  # keep = 2 + max_staleness, a ring of keep + 1 bf16 (serving) slots
    assert est.host == (memory.FIXED_BYTES["controller"] + 2 * int(trainer) + int(generator)
                        + memory.FIXED_BYTES["replay"] + est.shm)
    pinned = memory.estimate(job_with(**{"mesh.trainer_procs": 2, "trainer.max_staleness": 1,
                                         "generator.dtype": "bfloat16", "optimizer.name": "adamw",
                                         "trainer.dpo_reference_dtype": "float32"}), params)
    assert pinned.per_process["trainer"] == int(trainer + (4 - reference) * params / 2)
    # a file-backed reference is page cache, not the trainer's private memory
    mapped = memory.estimate(job_with(**{"mesh.trainer_procs": 2, "trainer.max_staleness": 1,
                                         "generator.dtype": "bfloat16", "optimizer.name": "adamw",
                                         "trainer.dpo_reference_storage": "file"}), params)
    assert mapped.per_process["trainer"] == int(trainer - reference * params / 2)

    muon = memory.estimate(job_with(**{"optimizer.name": "muon", "loss.beta": 0.0}), params)
    assert muon.per_process["trainer"] == int(memory.FIXED_BYTES["trainer"]
                                              + (4 + 4 + 4 + memory.TRAINER_REST_BYTES_PER_PARAM) * params)
    assert muon.processes["replay"] == 0  # no preference channel: no replay process, no reference
    assert muon.shm == (2 + 0 + 1) * 4 * params  # float32 serving: fp32 slots


def test_parameter_count_equals_transformers(tiny_assets):
    from transformers import AutoModelForCausalLM

    from composer_mesh.mesh.memory import parameter_count

    for model_dir in (tiny_assets.dense_dir, tiny_assets.moe_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        assert parameter_count(str(model_dir)) == sum(p.numel() for p in model.parameters())


def test_check_refuses_warns_or_skips(tiny_assets, monkeypatch, caplog):
    from composer_mesh.mesh import memory

    monkeypatch.setattr(memory, "available", lambda: (1 << 20, 1 << 40))  # 1 MiB of RAM, plenty of /dev/shm
    with pytest.raises(ValueError, match=r'memory_check = "warn".*') as refused:
        memory.check(job_with(), str(tiny_assets.dense_dir))
    assert "GiB on this host, 0.0 GiB available" in str(refused.value) and "/dev/shm" in str(refused.value)
    with caplog.at_level("WARNING", logger="composer_mesh.mesh.memory"):
        assert memory.check(job_with(**{"mesh.memory_check": "warn"}), str(tiny_assets.dense_dir)) is not None
    assert "needs" in caplog.text
    assert memory.check(job_with(**{"mesh.memory_check": "off"}), str(tiny_assets.dense_dir)) is None
    monkeypatch.setattr(memory, "available", lambda: (1 << 40, 1 << 20))  # RAM enough, /dev/shm 1 MiB
    with pytest.raises(ValueError, match=r"GiB of /dev/shm, 0\.0 GiB free"):
        memory.check(job_with(), str(tiny_assets.dense_dir))


def test_train_refuses_a_model_the_host_cannot_hold(tmp_path, tiny_assets):
    """A Qwen3-32B-shaped config.json (no weights: counting is on the meta device) with the project's tokenizer."""
    model = tmp_path / "qwen3-32b-shape"
    shutil.copytree(tiny_assets.dense_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                  num_key_value_heads=8, head_dim=128, layer_types=["full_attention"] * 64)
    (model / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1",
               COMPOSER_MESH_CACHE=str(tiny_assets.root.parents[1]))
    out = subprocess.run([sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", str(REPO / "configs/demo_cpu.toml"),
                          f"--model.hf_path={model}", f"--job.output_dir={tmp_path / 'runs'}",
                          "--env.demo.warm_start_steps=0"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")][-1]
    assert line.startswith("error: memory: a 3") and "M-parameter model" in line and "memory_check" in line
    assert not (tmp_path / "runs" / "demo_cpu" / "processes.json").exists()  # no actor started
