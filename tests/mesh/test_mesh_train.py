"""`composer-mesh train` end to end on local process meshes (tiny model, demo task, local teachers), and --resume.

A shortened debug_cpu run: two steps, then the same command with three steps
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

REPO = Path(__file__).resolve().parents[2]

RECIPE = """
base = "{repo}/configs/debug_cpu.toml"

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


def train(recipe: Path, steps: int, cache: Path, timeout: float = 500) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", COMPOSER_MESH_CACHE=str(cache))
    cmd = [sys.executable, "-m", "mesh.cli", "train", "--no-progress", str(recipe), f"--trainer.steps={steps}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_train_command_runs_and_resumes(tmp_path, tiny_assets):
    recipe = tmp_path / "demo.toml"
    recipe.write_text(RECIPE.format(repo=REPO, out=tmp_path / "runs"))
    cache = tiny_assets.root.parents[1]  # the suite's asset cache: no rebuild in the child

    first = train(recipe, 2, cache)
    run = Path(first["run_dir"])
    assert first["start_step"] == 0 and first["final_step"] == 2
    assert (run / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    assert first["replay"]["pairs_made"] > 0 and 0 < first["replay"]["spend_usd"] <= 0.5

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

    from mesh.cli import main

    assert second["hf"] == str(run / "hf")
    assert json.loads((run / "hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    final, exported = load_file(run / "hf" / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert final.keys() == exported.keys() and all(final[k].equal(exported[k]) for k in final)
