"""`composer-mesh train configs/diloco_cpu.toml`: DiLoCo in the RL loop, end to end on local process meshes.

Two trainer replica groups (own proc meshes) under the DiLoCo manager actor,
one generator following the post-outer-step weights through `TopologySync`
(every load is digest-checked against group 0's export by
`ReplicaController.sync_generators`), rollouts split across
the groups, a teacher-replay actor serving both, per-group checkpoints and
a resumed run (2 FSDP procs per group, H = 2, 3 + 1 steps). Plus the recipe
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


def _train(tmp_path, tiny_assets, *overrides: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1",
               COMPOSER_MESH_CACHE=str(tiny_assets.root.parents[1]))
    cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", "configs/diloco_cpu.toml",
           f"--job.output_dir={tmp_path}", "--diloco.inner_steps=2", "--diloco.procs_per_group=2",
           "--trainer.prompts_per_step=2", "--generator.max_new_tokens=8", *overrides]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _group_model(folder: Path) -> dict:
    """A DCP checkpoint's model tensors, gathered from its ranks' shards."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, folder / "gathered.pt")
    return torch.load(folder / "gathered.pt", weights_only=False)["model"]


@pytest.mark.slow
def test_diloco_recipe_trains_checkpoints_and_resumes(tmp_path, tiny_assets):
    """2 groups × 2 FSDP procs, all three channels (one teacher-replay actor for both groups), H = 2:
    3 steps (one outer sync; each group checkpoints step 3, one step into round 2), then a resumed run
    takes step 4, whose sync continues the round: outer step 2, no heal, both groups identical."""
    import torch

    from composer_mesh.mesh.supervision import load_state

    first = _train(tmp_path, tiny_assets, "--trainer.steps=3")
    assert first["final_step"] == 3 and first["steps_run"] == 3
    d = first["diloco"]
    assert d["outer_step"] == 1 and d["quorum_size"] == 2 and not d["restarts"]
    reps = d["replicas"]
    assert sorted(reps) == ["0", "1"]
    assert all(r["commits"] == 1 and r["failed_syncs"] == 0 and r["healed"] == 0 for r in reps.values())
    assert reps["0"]["sync_bytes"] == reps["1"]["sync_bytes"] and reps["0"]["sync_bytes"][0] > 0
    assert first["replay"]["pairs_made"] > 0 and first["replay"]["spend_usd"] > 0
    run_dir = Path(first["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r.get("diloco/outer_step") for r in rows] == [None, 1.0, None]
    assert sum(r["preference/pairs_in_batch"] for r in rows) > 0, "no replay pair reached a DiLoCo group"
    ckpt = run_dir / "checkpoints"
    assert all((ckpt / f"replica_{g}" / "step-00000003").is_dir() for g in (0, 1))
    # each group's controller state for step 3: its own prompt stream, the replay queue
    for g in (0, 1):
        state = load_state(ckpt / f"replica_{g}" / "controller", 3)
        assert state is not None and state.version == 3 and state.replay is not None
    # a prompt a step (+ tied retries)
    assert load_state(ckpt / "replica_0" / "controller", 3).prompt_cursor >= 3

    second = _train(tmp_path, tiny_assets, "--trainer.steps=4")
    assert second["start_step"] == 3 and second["final_step"] == 4 and second["steps_run"] == 1
    reps = second["diloco"]["replicas"]
    assert all(r["outer_step"] == 2 and r["commits"] == 1 and r["healed"] == 0 and r["failed_syncs"] == 0
               for r in reps.values()), reps
    models = [_group_model(ckpt / f"replica_{g}" / "step-00000004") for g in (0, 1)]
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0]), "groups differ after the resumed sync"

    # `composer-mesh export` of a DiLoCo run: group 0's newest checkpoint, equal to the run's final hf/.
    from safetensors.torch import load_file

    from composer_mesh.mesh.cli import main

    assert main(["export", str(run_dir), str(tmp_path / "export")]) == 0
    final = load_file(run_dir / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert final.keys() == exported.keys() and all(final[k].equal(exported[k]) for k in final)


@pytest.mark.parametrize("overrides, message", [
    (["--trainer.mode=async"], "one weight publication per replica group"),
    (["--replay.gating.enabled=true"], "replay.gating.enabled = false"),
    (["--diloco.replica_groups=16"], "prompts_per_step"),
])
def test_unsupported_combinations_are_clear_errors(overrides, message):
    from composer_mesh.configs.loader import load_config
    from composer_mesh.mesh.replicas import check_supported

    job = load_config(REPO / "configs" / "diloco_cpu.toml", overrides)
    with pytest.raises(ValueError, match=message):
        check_supported(job)


@pytest.mark.slow
def test_a_failing_group_stops_the_other_within_seconds():
    """Group 1 fails right after its first outer sync (say its generator died); group 0 goes on into the
    second sync and waits for a quorum group 1 will never join (its Manager still heartbeats, and
    quorum_timeout_s is 600 s). `run_groups` shuts the lighthouse down; group 0's pending quorum is aborted
    and the run raises group 1's error within seconds."""
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    from composer_mesh.configs.sections.diloco import DiLoCoConfig
    from composer_mesh.mesh.replicas import run_groups
    from composer_mesh.titan_ext.diloco import DiLoCoReplica, ReplicaAssignment

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

        # group 0 is entering its second sync
        zero_syncing = threading.Event()

        def drive(g: int, stop: threading.Event) -> None:
            model, optimizer, replica = members[g]
            try:
                for step in range(3 * cfg.inner_steps):
                    if stop.is_set():
                        return
                    if g == 0 and step == 2 * cfg.inner_steps - 1:
                        zero_syncing.set()
                    model.weight.grad = torch.ones_like(model.weight)
                    # the 2nd, 4th, ... step waits for a quorum of both groups
                    optimizer.step()
                    if g == 1 and replica.commits == 1:
                        assert zero_syncing.wait(30)
                        # group 0 is waiting for the quorum now
                        time.sleep(0.5)
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


def test_group_streams_split_the_step_and_resume_each_stream():
    """prompts_per_step 5 and 3 pairs over 2 groups, resumed at step 4: shares 3 + 2 and 2 + 1, each group
    continues its own stream at step × share, and the groups' problem seeds never meet."""
    from composer_mesh.mesh.controller import ControllerConfig
    from composer_mesh.mesh.requests import RequestLedger
    from composer_mesh.mesh.replicas import group_streams

    cfg = ControllerConfig(steps=10, prompts_per_step=5, max_seq_len=64, pairs_per_step=3, seed=7)
    streams = group_streams(cfg, 2, prompt_cursor=4 * 5)
    assert [(c.prompts_per_step, c.pairs_per_step, cursor) for c, cursor in streams] == [(3, 2, 12), (2, 1, 8)]
    seeds = [{r.seed for r in RequestLedger(c.seed, 0).take(10_000)} for c, _ in streams]
    assert not seeds[0] & seeds[1]
    assert all(c.steps == 10 and c.max_seq_len == 64 for c, _ in streams)


def test_merged_step_metrics_sum_counts_keep_maxima_and_skip_only_when_every_group_skipped():
    from composer_mesh.mesh.replicas import merge_metrics

    trained = {"rollouts/policy": 6.0, "rollouts/dropped_reason/equal_rewards": 1.0, "coding/tool_errors/timeout": 2.0,
               "rollouts/dropped_prompt_tokens": 300.0, "coding/grade_s_max": 0.5, "loss/total": 1.0,
               "coding/calls_refused": 1.0, "coding/calls_refused/calls_per_message": 1.0, "coding/grading_s_max": 9.0}
    skipped = {"skipped": 1.0, "rollouts/policy": 0.0, "rollouts/dropped_reason/equal_rewards": 2.0,
               "rollouts/dropped_reason/prompt_too_long": 1.0, "rollouts/dropped_prompt_tokens": 700.0,
               "coding/tool_errors": 3.0, "coding/grade_s_max": 2.0, "loss/total": 3.0}
    merged = merge_metrics([trained, skipped])
    assert "skipped" not in merged  # one group trained: the step trained (trained_summary counts it)
    assert merged["rollouts/policy"] == 6.0 and merged["coding/tool_errors"] == 3.0
    assert merged["rollouts/dropped_reason/equal_rewards"] == 3.0
    assert merged["rollouts/dropped_reason/prompt_too_long"] == 1.0
    assert merged["coding/tool_errors/timeout"] == 2.0
    assert merged["rollouts/dropped_prompt_tokens"] == 700.0 and merged["coding/grade_s_max"] == 2.0
    assert merged["loss/total"] == 2.0
    assert (merged["coding/calls_refused"], merged["coding/calls_refused/calls_per_message"]) == (1.0, 1.0)
    assert merged["coding/grading_s_max"] == 9.0
    assert merge_metrics([skipped, dict(skipped)])["skipped"] == 1.0
