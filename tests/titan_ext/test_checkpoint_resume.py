"""Kill and resume: 6 steps straight == 3 steps, SIGKILL, fresh processes, 3 more (bitwise).

Two gloo ranks, FSDP2, sharded Muon, all three loss channels. The straight run
is the `fsdp_muon` run of the parallel-trajectory launch. Phase 1 checkpoints
at step 3 (DCP: model + optimizer; per rank: step, LR schedule, data cursor,
RNG), signals, and is SIGKILLed while running. A half-written step-4 directory
(no COMPLETE marker) is planted to stand for a save the kill interrupted.
Phase 2 starts from nothing but the checkpoint folder.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from composer_mesh.configs.sections.checkpoint import CheckpointConfig
from test_trainer_harness import STEPS, kill_ranks, launch, run_ranks, two_rank_run, zygote, _tail
from composer_mesh.titan_ext.checkpoint import COMPLETE, Checkpointer, step_dir_name

pytestmark = pytest.mark.timeout(600)


def _wait_ready(pids: list[int], out_dir: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((out_dir / f"ready_{r}").exists() for r in range(len(pids))):
            return
        codes = zygote().request(op="wait", pids=pids, timeout=0)["codes"]
        if any(c != "timeout" for c in codes):
            raise AssertionError(f"phase 1 exited early ({codes}):\n{_tail(out_dir / 'rank0.log')}")
        time.sleep(0.5)
    kill_ranks(pids)
    raise AssertionError(f"phase 1 did not reach its step-3 checkpoint:\n{_tail(out_dir / 'rank0.log')}")


@pytest.mark.slow
def test_kill_and_resume_is_bitwise_identical(tiny_assets, tmp_path):
    hf = str(tiny_assets.dense_dir)
    straight = torch.load(two_rank_run(hf)[1] / "params_fsdp_muon.pt")

    args = {"optimizer": "muon", "steps": STEPS, "hf_path": hf, "checkpoint": {"every_steps": 3, "keep_last": 2}}
    pids = launch("resume_phase1", 2, tmp_path, args)
    _wait_ready(pids, tmp_path)
    assert kill_ranks(pids) == [-9, -9]  # a real kill, not an exit

    ckpt = tmp_path / "ckpt"
    assert (ckpt / step_dir_name(3) / COMPLETE).is_file()
    interrupted = ckpt / step_dir_name(4)
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"truncated")

    result = run_ranks("resume_phase2", 2, tmp_path, args, timeout=400)
    assert result["resumed_at"] == 3
    assert result["cursor"] == STEPS  # the data cursor came back with the checkpoint
    resumed = torch.load(tmp_path / "params_resumed.pt")
    assert sorted(resumed) == sorted(straight)
    differing = [k for k in straight if not torch.equal(straight[k], resumed[k])]
    assert differing == [], f"not bitwise identical: {differing}"


def test_resume_step_selection(tmp_path):
    folder = tmp_path / "ckpt"
    for step, complete in ((2, True), (4, True), (6, False)):
        (folder / step_dir_name(step)).mkdir(parents=True)
        if complete:
            (folder / step_dir_name(step) / COMPLETE).write_text(f"{step}\n")
    assert Checkpointer(CheckpointConfig(), folder).complete_steps() == [2, 4]
    assert Checkpointer(CheckpointConfig(), folder).resume_step() == 4  # step 6 never completed
    assert Checkpointer(CheckpointConfig(load_step=2), folder).resume_step() == 2
    assert Checkpointer(CheckpointConfig(resume=False), folder).resume_step() is None
    with pytest.raises(FileNotFoundError, match="load_step = 6"):
        Checkpointer(CheckpointConfig(load_step=6), folder).resume_step()
    assert Checkpointer(CheckpointConfig(), tmp_path / "absent").resume_step() is None
    every = Checkpointer(CheckpointConfig(every_steps=3), folder)
    assert [s for s in range(8) if every.should_save(s)] == [3, 6]
    assert not Checkpointer(CheckpointConfig(enabled=False), folder).should_save(3)
