"""`composer-mesh train` end to end on local process meshes (tiny model, demo task, local teachers), and --resume.

A shortened demo_cpu run: two steps, then the same command with three steps
resumes from the checkpoint and runs only the third. Checks the run's files
(metrics.jsonl, TensorBoard events, plot.png, checkpoints, summary) and that
the hint-distillation and trace-replay channels carried loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_mesh.configs.loader import load_config

REPO = Path(__file__).resolve().parents[2]

RECIPE = """
base = "{repo}/configs/demo_cpu.toml"

[job]
output_dir = "{out}"

[trainer]
prompts_per_step = 2

[generator]
max_new_tokens = 8

[checkpoint]
every_steps = 2

[replay]
min_agree = 2

[replay.local_server]
enabled = true
responder = "solver"

[teachers]
budget_usd = 0.5

[[teachers.models]]
name = "a"
model = "local-a"
price_in_per_mtok = 1.0
price_out_per_mtok = 4.0
max_tokens = 16

[[teachers.models]]
name = "b"
model = "local-b"
price_in_per_mtok = 1.0
price_out_per_mtok = 4.0
max_tokens = 16
"""


def train(recipe: Path, steps: int, cache: Path, timeout: float = 500, overrides: tuple[str, ...] = ()) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", COMPOSER_MESH_CACHE=str(cache))
    cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", str(recipe),
           f"--trainer.steps={steps}", *overrides]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_shipped(tmp_path: Path, name: str, steps: int, cache: Path, timeout: float,
                  overrides: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    """`configs/<name>.toml` as shipped (output under `tmp_path`; `overrides` on top) for `steps`: the summary and
    every metrics row, with the evaluations before step 1 and after the last checked (none where it does not evaluate)."""
    recipe = tmp_path / f"{name}.toml"
    recipe.write_text(f'base = "{REPO}/configs/{name}.toml"\n\n[job]\noutput_dir = "{tmp_path / "runs"}"\n')
    summary = train(recipe, steps, cache, timeout=timeout, overrides=overrides)
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    if load_config(REPO / "configs" / f"{name}.toml", list(overrides)).trainer.eval_every:
        assert (summary["heldout"]["before"]["step"], summary["heldout"]["after"]["step"]) == (0, steps)
    else:
        assert "heldout" not in summary
    return summary, rows


def heldout_gain(summary: dict, key: str) -> float:
    """The run's held-out figure `key` after its last step minus before its first."""
    return summary["heldout"]["after"][key] - summary["heldout"]["before"][key]


@pytest.mark.slow
def test_train_command_runs_and_resumes(tmp_path, tiny_assets):
    recipe = tmp_path / "demo.toml"
    recipe.write_text(RECIPE.format(repo=REPO, out=tmp_path / "runs"))
    cache = tiny_assets.root.parents[1]  # the suite's asset cache: no rebuild in the child

    first = train(recipe, 2, cache)
    run = Path(first["run_dir"])
    assert first["start_step"] == 0 and first["final_step"] == 2
    assert (run / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    assert first["replay"]["pairs_made"] > 0 and 0 < first["replay"]["spend_usd"] <= 0.5
    # the solver teachers' answers beat the student's failed ones in the demo environment: all verified
    assert first["replay"]["pairs_verified"] == first["replay"]["pairs_made"]
    assert first["replay"]["pairs_refuted"] == first["replay"]["pairs_unverifiable"] == 0
    trainer_memory, generator_memory = first["memory"]["trainer"][0], first["memory"]["generator"][0]
    assert {"load", "first_sync", "step", "sync", "checkpoint", "export"} <= trainer_memory.keys()
    assert {"load", "first_sync", "generate"} <= generator_memory.keys()
    for peak in (*trainer_memory.values(), *generator_memory.values()):
        assert 0 < peak["private"] <= peak["peak_rss"] < 8 << 30  # a tiny model: well under 8 GiB per process

    second = train(recipe, 3, cache)
    assert second["start_step"] == 2 and second["steps_run"] == 1 and second["final_step"] == 3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["distill/loss"] > 0 and r["distill/tokens"] > 0
        assert r["preference/loss"] > 0 and r["preference/pairs"] == 2
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "plot.png").read_bytes()[:4] == b"\x89PNG"

    # The run's final weights as a servable HF directory, equal to the export of its last checkpoint.
    from safetensors.torch import load_file

    from composer_mesh.mesh.cli import main

    assert second["hf"] == str(run / "hf")
    assert json.loads((run / "hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    final, exported = load_file(run / "hf" / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert final.keys() == exported.keys() and all(final[k].equal(exported[k]) for k in final)


def test_role_specs_follow_the_recipe():
    """The generators get `[model] device` (they stayed on CPU on GPU hosts); the frozen DPO reference — one more
    parameter copy per trainer rank — is built only when a preference channel can run (a replay actor)."""
    from composer_mesh.configs.loader import load_config
    from composer_mesh.mesh.placement import generator_spec, trainer_spec_for

    for device in ("auto", "cpu", "cuda"):
        job = load_config(REPO / "configs" / "demo_cpu.toml", [f"--model.device={device}"])
        assert generator_spec(job, "/weights").device == device
    job = load_config(REPO / "configs" / "demo_cpu.toml", ["--trainer.dpo_reference=frozen"])
    assert job.loss.beta > 0 and job.loss.preference.kind == "dpo"
    assert trainer_spec_for(job, preference_pairs=True).trainer.dpo_reference == "frozen"
    without = trainer_spec_for(job, preference_pairs=False)
    assert without.trainer.dpo_reference == "policy" and without.trainer.steps == job.trainer.steps
    assert without.loss == job.loss and without.model == job.model


def test_torch_threads_share_the_host():
    """0 = the host's CPUs over the processes placed on it (local: all roles share this host); set = as set."""
    from composer_mesh.configs.sections.mesh import MeshConfig
    from composer_mesh.mesh.placement import torch_threads

    local = MeshConfig(trainer_procs=2, generator_procs=3, replay_procs=1)
    assert [torch_threads(local, r, 12) for r in ("trainer", "generator")] == [2, 2]
    assert torch_threads(local, "trainer", 2) == 1  # never 0
    colocated = MeshConfig(placement="colocated", trainer_procs=2, replay_procs=0)
    assert torch_threads(colocated, "generator", 8) == 4
    cluster = MeshConfig(backend="slurm", trainer_procs=8, generator_procs=2)
    assert [torch_threads(cluster, r, 64) for r in ("trainer", "generator")] == [8, 32]
    assert torch_threads(MeshConfig(trainer_threads=3, generator_threads=5), "generator", 64) == 5
    # taking turns (sync loop): a role shares the host with its own processes only (replay runs no torch)
    assert [torch_threads(local, r, 12, turns=True) for r in ("trainer", "generator")] == [6, 4]
    assert [torch_threads(MeshConfig(replay_procs=0), r, 2, turns=True) for r in ("trainer", "generator")] == [2, 2]
    assert torch_threads(MeshConfig(replay_procs=1), "trainer", 2, turns=True) == 2
    assert torch_threads(colocated, "generator", 8, turns=True) == 4


def test_roles_take_turns_only_in_a_synchronous_loop_without_diloco():
    """The recipes' thread counts on a 2-core host: grpo (sync, no replay) gives each role both cores; async
    and DiLoCo recipes keep the shared count."""
    import dataclasses

    from composer_mesh.configs.loader import load_config
    from composer_mesh.mesh.placement import generator_spec, trainer_spec_for

    job = load_config(REPO / "configs" / "grpo.toml")
    counts = lambda j: (trainer_spec_for(j, preference_pairs=False).torch_threads,  # noqa: E731
                        generator_spec(j, "w").torch_threads)
    cpus = os.cpu_count() or 1
    assert counts(job) == (cpus, cpus)
    asynchronous = dataclasses.replace(job, trainer=dataclasses.replace(job.trainer, mode="async"))
    assert counts(asynchronous) == (max(1, cpus // 2),) * 2
    diloco = dataclasses.replace(job, diloco=dataclasses.replace(job.diloco, enabled=True))
    assert counts(diloco) == (max(1, cpus // 2),) * 2
