"""Fault drills: real processes, real SIGKILLs, recovery checked against an uninterrupted run.

- Generator + trainer (`fault_drill.py`, its own process): generator 1's OS
  process is SIGKILLed during step 2's work, then the trainer's after step 3
  (checkpoints every 2 steps, so the trainer restarts from step 2 and step 3
  is trained again). The run ends at the configured step, every requested
  prompt seed is trained exactly once, and per-step metrics and the final
  weights equal an uninterrupted run's bitwise.
- Hung generator (same script): generator 1's process is SIGSTOPped during
  step 2's work; its `generate` call outlives the deadline (floor 20 s), the
  process is killed and replaced on a fresh one, the share re-issued: seeds
  0–7 trained once, steps 1–2 bitwise equal to the uninterrupted run's.
- Controller: `composer-mesh train` with the local teacher server, SIGKILLed
  between steps (no teacher call in flight), then run again: the step log is
  contiguous up to the configured count, the server's request log shows
  no request twice, and the killed run's shared-memory weight folder is gone.
- The request ledger and the state file without meshes: re-queued requests
  keep their group id and seed, late duplicates are dropped, the state file is
  replaced atomically.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from composer_mesh.actors.rollout import EpisodeRequest, RolloutGroup
from composer_mesh.mesh.supervision import UNANSWERED
from test_mesh_train import RECIPE  # tests/mesh is on sys.path (pytest's rootdir-less "prepend" import)

REPO = Path(__file__).resolve().parents[2]
DRILL = Path(__file__).with_name("fault_drill.py")


def child_env(cache: Path) -> dict[str, str]:
    # Monarch's supervision settings come from [mesh] supervision_poll_s / state_query_s (placement sets them)
    return dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", COMPOSER_MESH_CACHE=str(cache))


def drill(tmp_path: Path, tiny_assets, name: str, *flags: str, steps: int = 4) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(DRILL), str(out), "--assets", str(tiny_assets.dense_dir), "--run", str(tmp_path / name),
           "--steps", str(steps), *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(tiny_assets.root.parents[1]), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def last_per_step(result: dict) -> dict[int, dict]:
    return {r["step"]: r for r in result["records"]}  # a step trained again after a rollback: its last record


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_assets):
    tmp = tmp_path_factory.mktemp("drills")
    base = drill(tmp, tiny_assets, "uninterrupted")
    hit = drill(tmp, tiny_assets, "faulted", "--kill-generator-at", "1", "--kill-trainer-at", "3", "--respawn", "live")
    return base, hit


SLOW = pytest.mark.timeout(1500)  # two child runs in the fixture; a loaded 2-core box stretches them
HANG_FLOOR_S = 20.0  # the deadline floor in the hung drill; the others keep the default (120 s)


@pytest.mark.slow
@SLOW
def test_hung_generator_is_replaced_within_its_deadline(runs, tmp_path, tiny_assets):
    base, _ = runs
    hit = drill(tmp_path, tiny_assets, "hung", "--stop-generator-at", "1", "--hang-floor", str(HANG_FLOOR_S),
                steps=2)
    # noticed by whichever comes first: the call's deadline (ActorHung), or Monarch's supervision poll finding the
    # stopped process's agent silent for [mesh] state_query_s (5 s); either way the process is killed and replaced
    (error,) = hit["restart_errors"]
    assert hit["restarts"] == ["generator"] and ("ActorHung" in error or UNANSWERED in error), error
    stopped = hit["killed"]["stopped"]
    assert stopped in hit["pids_before"]["generator"] and stopped not in hit["pids_after"]["generator"]
    with pytest.raises(ProcessLookupError):  # killed, not left stopped
        os.kill(stopped, 0)
    (detected,) = hit["stop_to_restart_s"]
    hung = re.search(r"within its ([0-9.]+) s deadline", error)
    deadline = float(hung.group(1)) if hung else HANG_FLOOR_S  # the floor bounds the deadline from below
    steps = last_per_step(hit)
    # deadline = max(floor, tokens × max(bound, 4 × the slowest measured s/token)); the call was issued right
    # after the SIGSTOP, so the replacement begins at most one deadline (plus the issue delay) after it
    assert HANG_FLOOR_S <= deadline < 60 and detected <= deadline + 1.0, \
        f"replacement began {detected:.1f} s after the SIGSTOP (deadline {deadline:.1f} s)"
    print(f"hung generator: {'deadline' if hung else 'supervision (agent silent)'}, replacement began "
          f"{detected:.1f} s after SIGSTOP, step 2 took {steps[2]['seconds']:.1f} s")
    trained = [s for r in steps.values() for s in r["seeds"]]
    assert sorted(trained) == list(range(2 * 4)), trained  # every seed once: none lost, none trained twice
    ref = last_per_step(base)
    for step in (1, 2):
        assert steps[step]["seeds"] == ref[step]["seeds"]
        assert steps[step]["metrics"] == ref[step]["metrics"], f"step {step} differs after the hang"
    assert set(hit["generator_digests"]) == {hit["trainer_digest"]}


@pytest.mark.slow
@SLOW
def test_generator_sigkill_loses_no_rollout_group(runs):
    base, hit = runs
    assert hit["restarts"].count("generator") == 1
    killed = hit["killed"]["generator"]
    assert killed in hit["pids_before"]["generator"] and killed not in hit["pids_after"]["generator"]
    assert hit["processes_json"] == {"controller": hit["processes_json"]["controller"], **hit["pids_after"]}
    survivor = next(p for p in hit["pids_before"]["generator"] if p != killed)
    assert hit["pids_after"]["generator"] == [survivor, survivor]  # respawn = "live": on the surviving process
    steps = last_per_step(hit)
    assert sorted(steps) == [1, 2, 3, 4]
    # noticed within the supervision poll (1 s here), not after Monarch's ≈2 min "orphaned" stop, which is what
    # a generator sharing a proc mesh with others costs (measured 121 s of this step)
    assert steps[2]["seconds"] < 60, f"step 2 took {steps[2]['seconds']:.0f} s to get past the dead generator"
    trained = [s for r in steps.values() for s in r["seeds"]]
    requested = [i for i in range(4 * 4)]  # job seed 0: prompt i is problem seed i
    assert sorted(trained) == requested and len(set(trained)) == len(trained)
    assert set(hit["generator_digests"]) == {hit["trainer_digest"]}


@pytest.mark.slow
@SLOW
def test_trainer_sigkill_resumes_bitwise(runs):
    base, hit = runs
    assert base["restarts"] == [] and hit["restarts"].count("trainer") == 1
    assert base["threads"] == hit["threads"] == [1, 1, 1]  # [mesh] trainer_threads / generator_threads, respawns too
    assert hit["killed"]["trainer"] == hit["pids_before"]["trainer"][0] != hit["pids_after"]["trainer"][0]
    # checkpoints every 2 steps: killed after step 3, the trainer restarted from step 2 and trained step 3 again
    assert [r["step"] for r in hit["records"]] == [1, 2, 3, 3, 4]
    assert [r["iteration"] for r in hit["records"]] == [1, 2, 3, 3, 4]
    ref, got = last_per_step(base), last_per_step(hit)
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4]
    for step in ref:
        assert got[step]["seeds"] == ref[step]["seeds"]
        assert got[step]["metrics"] == ref[step]["metrics"], f"step {step} differs after the restart"
    assert hit["records"][2]["metrics"] == hit["records"][3]["metrics"]  # step 3 before the kill and after it
    assert hit["trainer_digest"] == base["trainer_digest"]
    assert set(hit["generator_digests"]) == {base["trainer_digest"]}


@pytest.mark.slow
@SLOW
def test_async_trainer_sigkill_trains_every_group_once_within_staleness(tmp_path, tiny_assets):
    """Async mode (max_staleness 1, two generators) across a trainer SIGKILL after step 3, checkpoints every 2
    steps. Not bitwise (which groups fill a step depends on the two generators' arrival order, with or without a
    restart), so what holds is asserted: the restart begins within seconds and rolls back to step 2 with the
    saved buffer and in-flight requests; step 3 is trained again and the run ends at step 4; no prompt seed is
    trained in two kept steps; every group of the discarded step-3 attempt is trained again, counted as
    dropped stale or still buffered (or asked for) when the run ends; every trained group is within max_staleness of the trainer."""
    hit = drill(tmp_path, tiny_assets, "async", "--kill-trainer-at", "3", "--mode", "async", "--max-staleness", "1")
    assert hit["restarts"] == ["trainer"], hit["restart_errors"]
    assert [r["step"] for r in hit["records"]] == [1, 2, 3, 3, 4]
    noticed = hit["kill_to_trainer_restart_s"][0]
    assert noticed < 15, f"the dead trainer was noticed {noticed:.1f} s after its SIGKILL"
    kept = last_per_step(hit)
    trained = [seed for r in kept.values() for seed in r["seeds"]]
    assert len(trained) == len(set(trained)), f"a prompt seed trained in two kept steps: {sorted(trained)}"
    assert all(0 <= lag <= 1 for r in kept.values() for lag in r["staleness"])
    # the rolled-back attempt's groups not trained again, nor still buffered or asked for when the run ended
    missing = set(hit["records"][2]["seeds"]) - set(trained) - set(hit["unused_at_end"])
    dropped = sum(r["dropped_stale"] for r in kept.values())
    assert len(missing) <= dropped, f"groups of the rolled-back step lost: {sorted(missing)} ({dropped} dropped stale)"
    print(f"async trainer drill: restart began {noticed:.1f} s after the SIGKILL and took "
          f"{hit['trainer_restart_build_s'][0]:.1f} s; {len(trained)} groups trained once, {dropped} dropped stale, "
          f"{len(set(hit['records'][2]['seeds']) & set(trained))} of the rolled-back step's 4 trained again")


@pytest.mark.slow
@SLOW
def test_dead_rank_of_a_two_rank_trainer_is_noticed_in_seconds(tmp_path, tiny_assets):
    """FSDP over 2 gloo ranks, rank 1 SIGKILLed after step 3: rank 0's collective fails first (gloo: connection
    closed, an ordinary error), the controller's liveness probe finds the dead rank, the trainer mesh restarts from
    the step-2 checkpoint and step 3 is trained again bitwise."""
    hit = drill(tmp_path, tiny_assets, "rank1", "--trainer-procs", "2", "--kill-trainer-at", "3",
                "--kill-trainer-rank", "1")
    assert hit["restarts"] == ["trainer"], hit["restart_errors"]
    (noticed,) = hit["kill_to_trainer_restart_s"]
    (rebuilt,) = hit["trainer_restart_build_s"]
    print(f"2-rank trainer: restart began {noticed:.1f} s after the SIGKILL of rank 1, new mesh set up in {rebuilt:.1f} s")
    assert noticed < 15, f"the dead rank was noticed {noticed:.1f} s after its SIGKILL"
    killed = hit["killed"]["trainer"]
    assert killed == hit["pids_before"]["trainer"][1] and killed not in hit["pids_after"]["trainer"]
    assert [r["step"] for r in hit["records"]] == [1, 2, 3, 3, 4]
    assert hit["records"][2]["seeds"] == hit["records"][3]["seeds"]
    assert hit["records"][2]["metrics"] == hit["records"][3]["metrics"]  # from the step-2 checkpoint, bitwise
    assert set(hit["generator_digests"]) == {hit["trainer_digest"]}


def unresolved_intents(journal: Path) -> int:
    """Teacher calls in flight: intents in the replay cache journal with no result yet."""
    if not journal.exists():
        return 0
    intents, results = set(), set()
    for line in journal.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        (intents if rec.get("kind") == "intent" else results).add(rec.get("attempt"))
    return len(intents - results)


def kill_between_teacher_calls(proc: subprocess.Popen, run: Path, after_rows: int, victim) -> tuple[int | None, int]:
    """Once `after_rows` steps are logged, SIGKILL `victim(replay pid)` at a moment the replay process (the only
    teacher client, frozen while checking) has no teacher call in flight. Returns (rows logged then, killed pid)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        rows = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
        if len(rows) >= after_rows:
            replay_pid = json.loads((run / "processes.json").read_text())["replay"][0]
            os.kill(replay_pid, signal.SIGSTOP)
            if unresolved_intents(run / "replay" / "cache.jsonl") == 0:
                pid = victim(replay_pid)
                os.kill(pid, signal.SIGKILL)
                return len(rows), pid
            os.kill(replay_pid, signal.SIGCONT)
        time.sleep(0.05)
    return None, 0


def teacher_cmd(tmp_path: Path, steps: int, log: Path) -> tuple[list[str], Path]:
    """The train command of the short demo recipe with the local teacher server logging its requests to `log`."""
    recipe = tmp_path / "demo.toml"
    recipe.write_text(RECIPE.format(repo=REPO, out=tmp_path / "runs"))  # the train command test's short demo run
    cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", str(recipe), f"--trainer.steps={steps}",
           "--checkpoint.every_steps=1", f"--replay.local_server.request_log={log}",
           "--replay.concurrency=1"]  # one state at a time: each step asks the teachers, no pairs pile up
    return cmd, tmp_path / "runs" / "demo_cpu"


@pytest.mark.slow
@SLOW
def test_replay_sigkill_respawns_restores_and_repeats_no_teacher_call(tmp_path, tiny_assets):
    """The replay actor's process is SIGKILLed between teacher calls after step 2; the controller replaces it on a
    fresh process, restores its queue and ready pairs from the last controller state, and the run ends at step 4
    with no teacher request sent twice, no preference pair trained twice or lost, and processes.json naming the
    new replay process."""
    steps = 4
    log = tmp_path / "teacher_requests.jsonl"
    cmd, run = teacher_cmd(tmp_path, steps, log)
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(tiny_assets.root.parents[1]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        killed_at, killed = kill_between_teacher_calls(proc, run, 2, lambda replay_pid: replay_pid)
        kill_t = time.monotonic()  # CLOCK_MONOTONIC: the same clock as the controller's Restart.started
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert killed_at is not None and killed_at < steps
    summary = json.loads(out.strip().splitlines()[-1])
    assert [r["role"] for r in summary["restarts"]] == ["replay"] and summary["final_step"] == steps
    noticed, rebuilt = summary["restarts"][0]["started"] - kill_t, summary["restarts"][0]["seconds"]
    # noticed at the controller's next call to the replay actor (once per step) plus the supervision poll
    assert noticed < 60, f"the dead replay actor was noticed {noticed:.1f} s after its SIGKILL"
    replay_pid = json.loads((run / "processes.json").read_text())["replay"][0]
    assert replay_pid != killed  # rewritten after the restart
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in logged}) == list(range(1, steps + 1))
    assert any(r["step"] > killed_at and r["preference/pairs"] > 0 for r in logged)  # the new actor makes pairs
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    repeated = {k: n for k, n in Counter(r["key"] for r in requests).items() if n > 1}
    assert repeated == {}, f"teacher requests sent twice after the replay restart: {repeated}"
    # pairs: none trained twice, none lost — every pair the replay actors made (the restored counter continues the
    # dead actor's) was trained in a logged step, is still ready at the end, or was refuted by the environment
    trained = [key for r in logged for key in r["pair_keys"]]
    twice = {k: n for k, n in Counter(trained).items() if n > 1}
    assert twice == {}, f"preference pairs trained twice across the replay restart: {twice}"
    status = summary["replay"]
    assert trained and len(trained) + status["pairs_ready"] + status["pairs_refuted"] == status["pairs_made"], (
        f"{status['pairs_made']} pairs made, {len(trained)} trained + {status['pairs_ready']} ready + "
        f"{status['pairs_refuted']} refuted: pairs lost")
    print(f"replay drill: killed after {killed_at} logged steps, replacement began {noticed:.1f} s later and took "
          f"{rebuilt:.1f} s; {len(requests)} teacher requests, none repeated; {len(trained)} pairs trained once each, "
          f"{status['pairs_ready']} ready, {status['pairs_made']} made")


@pytest.mark.slow
@SLOW
def test_controller_sigkill_then_resume_loses_no_step_and_repeats_no_teacher_call(tmp_path, tiny_assets):
    steps, kill_after = 4, 2
    log = tmp_path / "teacher_requests.jsonl"
    cmd, run = teacher_cmd(tmp_path, steps, log)
    env = child_env(tiny_assets.root.parents[1])
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        killed_at, _ = kill_between_teacher_calls(proc, run, kill_after, lambda replay_pid: proc.pid)
        assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read().decode()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_at is not None and killed_at < steps
    left = Path("/dev/shm") / f"composer-mesh-{run.name}-{proc.pid}"  # the killed controller could not remove it
    assert left.is_dir()
    before = [json.loads(line) for line in log.read_text().splitlines()]
    assert before, "no teacher call before the kill"

    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["start_step"] == killed_at and summary["final_step"] == steps  # resumed at the last logged step
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(logged)) == list(range(1, steps + 1))  # contiguous, ends at the configured count
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(requests) > len(before), "the resumed run asked the teachers nothing"
    repeated = {k: n for k, n in Counter(r["key"] for r in requests).items() if n > 1}
    assert repeated == {}, f"teacher requests sent twice: {repeated}"
    assert not left.exists()  # removed by the next run of the job


def test_request_ledger_requeues_and_dedupes():
    from composer_mesh.mesh.requests import RequestLedger, StaleWorker

    ledger = RequestLedger(seed=2)
    first = ledger.take(3)
    assert [(r.group_id, r.seed) for r in first] == [(0, 2_000_006), (1, 2_000_007), (2, 2_000_008)]
    ledger.lose(first[1:])  # their generator died
    again = ledger.take(3)
    assert [r.group_id for r in again] == [1, 2, 3] and again[:2] == first[1:]  # same ids, same seeds, first
    group = lambda r: RolloutGroup(r.group_id, r.seed, [])  # noqa: E731
    assert [g.group_id for g in ledger.accept([group(first[0]), group(again[0]), group(first[0])])] == [0, 1]
    assert ledger.accept([group(again[0])]) == []  # a late answer for a group already accepted
    assert ledger.position()[0] == 4 and [r.group_id for r in ledger.position()[1]] == [2, 3]
    old = ledger.epoch
    ledger.restore(10, [EpisodeRequest(7, 70)])
    restored = ledger.take(2)
    assert [r.group_id for r in restored] == [7, 10]
    # an async worker of the rolled-back attempt answers late: it may not swallow a restored request's group
    # (the new worker's answer would then be dropped as a duplicate and the group never trained), nor take or lose
    for late in (lambda: ledger.accept([group(restored[0])], old), lambda: ledger.take(1, old),
                 lambda: ledger.lose(restored, old)):
        with pytest.raises(StaleWorker):
            late()
    assert [g.group_id for g in ledger.accept([group(r) for r in restored], ledger.epoch)] == [7, 10]


def test_controller_state_file_is_replaced_atomically(tmp_path):
    from composer_mesh.mesh.supervision import ControllerState, load_state, save_state, state_path

    state = ControllerState(3, 4, 9, [EpisodeRequest(8, 8)], [RolloutGroup(7, 7, [])], {"queue": [1]})
    save_state(tmp_path, state)
    assert load_state(tmp_path, 3) == state and load_state(tmp_path, 2) is None
    save_state(tmp_path, ControllerState(3, 5, 11))
    assert load_state(tmp_path, 3).iteration == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [state_path(tmp_path, 3).name]  # no temp file left
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "COMPLETE").touch()
    save_state(tmp_path / "controller", ControllerState(5, 6, 13), keep_from=4)
    save_state(tmp_path / "controller", ControllerState(2, 2, 4))
    save_state(tmp_path / "controller", ControllerState(6, 7, 14), keep_from=4)
    kept = sorted(p.name for p in (tmp_path / "controller").iterdir())
    assert kept == ["controller-00000005.pkl", "controller-00000006.pkl"]  # older than the oldest checkpoint: gone
    state_path(tmp_path, 1).write_bytes(b"not a pickle of a state")
    with pytest.raises(pickle.UnpicklingError):
        load_state(tmp_path, 1)


def test_deadline_grows_with_the_request_and_the_measured_speed():
    from composer_mesh.mesh.supervision import ActorHung, Deadline, is_actor_failure

    d = Deadline(floor_s=20.0, s_per_token=0.05)
    assert d.seconds(100, 0.0) == 20.0  # short call: the floor
    assert d.seconds(1000, 0.0) == pytest.approx(50.0)  # the configured bound
    assert d.seconds(1000, 0.1) == pytest.approx(400.0)  # 4x the slowest measured, when that is slower
    hung = RuntimeError("step failed")
    hung.__cause__ = ActorHung("generator 1 did not answer")
    assert is_actor_failure(hung) and not is_actor_failure(TimeoutError("a slow HTTP call"))
