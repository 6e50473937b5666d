"""`composer-mesh train configs/diloco_cpu.toml`: DiLoCo in the RL loop, end to end on local process meshes.

Two trainer replica groups (own proc meshes) under the DiLoCo manager actor,
one generator following the post-outer-step weights (every load is digest-
checked against group 0's export by `sync_weights`), rollouts split across
the groups. Shortened: 2 steps, H = 1 → 2 outer rounds. Plus the recipe
combinations the loop refuses, with errors that say what to change, and
`run_groups` stopping every group within seconds when one fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
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


def test_a_failing_group_stops_the_other_within_seconds():
    """Group 1 fails right after its first outer sync (say its generator died); group 0 goes on into the
    second sync and waits for a quorum group 1 will never join (its Manager still heartbeats, and
    quorum_timeout_s is 600 s). `run_groups` shuts the lighthouse down; group 0's pending quorum is aborted
    and the run raises group 1's error within seconds."""
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    from configs.sections.diloco import DiLoCoConfig
    from mesh.replicas import run_groups
    from titan_ext.diloco import DiLoCoReplica, ReplicaAssignment

    cfg = DiLoCoConfig(inner_steps=2, replica_groups=2, min_replicas=2, heartbeat_timeout_ms=1000,
                       timeout_s=30, quorum_timeout_s=600)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=cfg.join_timeout_ms,
                                  heartbeat_timeout_ms=cfg.heartbeat_timeout_ms)
    stores, members = [], []
    errors: dict[int, str] = {}
    failed_at: list[float] = []
    try:
        for g in range(2):
            stores.append(TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30)))
            model = nn.Linear(4, 1, bias=False)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            members.append((model, optimizer, DiLoCoReplica(
                cfg, model, optimizer, ReplicaAssignment(f"replica_{g}", g, lighthouse.address()),
                store_addr="127.0.0.1", store_port=stores[-1].port)))

        def drive(g: int, stop: threading.Event) -> None:
            model, optimizer, replica = members[g]
            try:
                for _ in range(3 * cfg.inner_steps):
                    if stop.is_set():
                        return
                    model.weight.grad = torch.ones_like(model.weight)
                    optimizer.step()  # the 2nd, 4th, ... step waits for a quorum of both groups
                    if g == 1 and replica.commits == 1:
                        failed_at.append(time.monotonic())
                        raise ValueError("group 1: its generator died")
            except BaseException as exc:
                errors[g] = str(exc)
                raise

        with pytest.raises(RuntimeError, match="replica group 1 failed") as info:
            run_groups(drive, 2, lighthouse.shutdown)
        seconds = time.monotonic() - failed_at[0]
    finally:
        for _, _, replica in members:
            replica.close()
        lighthouse.shutdown()
    assert "its generator died" in str(info.value.__cause__)
    assert "lighthouse" in errors.get(0, ""), f"group 0 did not abort its pending sync: {errors}"
    assert seconds < 10, f"group 0 stopped {seconds:.1f} s after group 1 failed (quorum_timeout_s = 600)"
    print(f"\ngroup 1 failed; the run stopped {seconds:.2f} s later (heartbeat_timeout_ms = 1000)")
