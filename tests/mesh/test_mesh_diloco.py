"""`composer-mesh train configs/diloco_cpu.toml`: DiLoCo in the RL loop, end to end on local process meshes.

Two trainer replica groups (own proc meshes) under the DiLoCo manager actor,
one generator following the post-outer-step weights (every load is digest-
checked against group 0's export by `sync_weights`), rollouts split across
the groups. Shortened: 2 steps, H = 1 → 2 outer rounds. Plus the recipe
combinations the loop refuses, with errors that say what to change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_diloco_recipe_trains_two_replica_groups(tmp_path, tiny_assets):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1",
               COMPOSER_MESH_CACHE=str(tiny_assets.root.parents[1]))
    cmd = [sys.executable, "-m", "mesh.cli", "train", "--no-progress", "configs/diloco_cpu.toml",
           f"--job.output_dir={tmp_path}", "--trainer.steps=2", "--diloco.inner_steps=1",
           "--trainer.prompts_per_step=2", "--generator.max_new_tokens=8"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 2 and summary["steps_run"] == 2
    d = summary["diloco"]
    assert d["outer_step"] == 2 and d["quorum_size"] == 2 and not d["restarts"]
    reps = d["replicas"]
    assert sorted(reps) == ["0", "1"]
    assert all(r["commits"] == 2 and r["failed_syncs"] == 0 and r["outer_step"] == 2 for r in reps.values())
    assert reps["0"]["sync_bytes"] == reps["1"]["sync_bytes"] and reps["0"]["sync_bytes"][0] > 0
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r.get("diloco/outer_step") for r in rows] == [1.0, 2.0]
    assert all(r["diloco/quorum"] == 2.0 for r in rows)


@pytest.mark.parametrize("overrides, message", [
    (["--trainer.mode=async"], "trainer.mode"),
    (["--loss.beta=0.5", "--mesh.replay_procs=1"], "teacher replay"),
    (["--checkpoint.enabled=true"], "checkpoint.enabled = false"),
    (["--diloco.replica_groups=16"], "prompts_per_step"),
])
def test_unsupported_combinations_are_clear_errors(overrides, message):
    from configs.loader import load_config
    from mesh.replicas import check_supported

    job = load_config(REPO / "configs" / "diloco_cpu.toml", overrides)
    with pytest.raises(ValueError, match=message):
        check_supported(job)
