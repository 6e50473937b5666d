"""An actor SIGKILLed in each phase of a run (setup, first weight sync, first weight load, a step) — the kernel's
OOM killer sends the same signal: the run recovers where the drills define how, or exits 1 with one line naming
the actor, the phase and the signal (or, when Monarch's poll query was in flight at the death, that the process
stopped answering: Monarch then reaps it unreported, reproduced below); either within 30 s of the kill, and no
shared-memory weight folder is left.

The kills are real: `actors.chaos.kill_point` SIGKILLs the actor's own process as it enters the phase named in
COMPOSER_MESH_KILL_AT, and the marker file it creates first dates the kill. The one-line report itself
(`mesh.errors.describe_death`) is checked on Monarch's own error type for each way a process can end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_mesh.actors.chaos import ENV, MARKS_ENV, kill_point

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--trainer.steps=2", "--trainer.prompts_per_step=2", "--trainer.eval_every=0", "--generator.max_new_tokens=8",
         "--checkpoint.every_steps=2"]
SHM = Path("/dev/shm")
DEATH_LINE = "killed by signal 9 (SIGKILL; the kernel's OOM killer sends it too)"
# Monarch's other report of the same death: its poll's state query was in flight when the process died, timed out,
# and the exit status was reaped without being reported (reproduced by test_a_death_during_the_poll_s_query_...)
UNANSWERED_LINE = "its process stopped answering Monarch's supervision (taken as dead)"
UNANSWERED_QUERY = "timeout waiting for message from proc mesh agent"  # Monarch's own words for that report


def train_with_kill(tmp_path: Path, tiny_assets, kill_at: str, *overrides: str) -> tuple[int, str, dict, float, float]:
    """(exit code, stderr, summary or {}, seconds from the kill to the end, seconds from the kill to the first
    restart or nan)."""
    marks, name = tmp_path / "marks", f"phase-{tmp_path.name}"[:60]
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1",
               COMPOSER_MESH_CACHE=str(tiny_assets.root.parents[1]), **{ENV: kill_at, MARKS_ENV: str(marks)})
    cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", str(REPO / "configs/demo_cpu.toml"),
           f"--job.output_dir={tmp_path / 'runs'}", f"--job.name={name}", *SMALL, *overrides]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()
    role, phase = kill_at.split(":")
    mark = marks / f"{role}-{phase}"
    assert mark.is_file(), f"{kill_at} never fired: {out.stderr[-2000:]}"
    killed = mark.stat().st_mtime
    summary = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    restarts = summary.get("restarts", [])
    assert not list(SHM.glob(f"composer-mesh-{name}-*")), "the run left its shared-memory weight folder"
    return out.returncode, out.stderr, summary, ended - killed, (restarts[0]["at"] - killed if restarts else float("nan"))


def last_error(stderr: str) -> str:
    return [ln for ln in stderr.splitlines() if ln.startswith("error: ")][-1]


def assert_died(stderr: str, head: str) -> None:
    """The run's last line is `error: <head>: <how>`, how being the signal or, when Monarch's poll lost the race
    described at UNANSWERED_LINE, the unanswered query."""
    line = last_error(stderr)
    assert line in (f"error: {head}: {DEATH_LINE}", f"error: {head}: {UNANSWERED_LINE}"), line
    print(f"reported: {line}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_killed_in_setup_fails_with_one_line(tmp_path, tiny_assets):
    rc, err, _, to_end, _ = train_with_kill(tmp_path, tiny_assets, "trainer:setup")
    print(f"trainer SIGKILLed in setup: exit {rc} {to_end:.1f} s after the kill")
    assert rc == 1
    assert_died(err, "trainer actor died during setup (trainer.setup)")
    assert to_end < 30, f"the run ended {to_end:.1f} s after the kill"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_killed_in_first_sync_recovers(tmp_path, tiny_assets):
    rc, err, summary, _, to_restart = train_with_kill(tmp_path, tiny_assets, "trainer:first_sync")
    print(f"trainer SIGKILLed in the first weight sync: restart began {to_restart:.1f} s after the kill")
    assert rc == 0, err[-3000:]
    assert [r["role"] for r in summary["restarts"]] == ["trainer"] and summary["final_step"] == 2
    error = summary["restarts"][0]["error"]
    # either of Monarch's two reports of the same death (see UNANSWERED_LINE); CI saw the second
    assert "publish_shards" in error and ("Killed(sig=9)" in error or UNANSWERED_QUERY in error), error
    assert to_restart < 30, f"the restart began {to_restart:.1f} s after the kill"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_generator_killed_in_first_load_recovers_and_without_restarts_fails_with_one_line(tmp_path, tiny_assets):
    rc, err, summary, _, to_restart = train_with_kill(tmp_path / "a", tiny_assets, "generator:first_load")
    print(f"generator SIGKILLed in its first weight load: replacement began {to_restart:.1f} s after the kill")
    assert rc == 0, err[-3000:]
    assert [r["role"] for r in summary["restarts"]] == ["generator"] and summary["final_step"] == 2
    assert to_restart < 30, f"the replacement began {to_restart:.1f} s after the kill"

    rc, err, _, to_end, _ = train_with_kill(tmp_path / "b", tiny_assets, "generator:first_load",
                                            "--mesh.max_restarts=0")
    print(f"... with max_restarts 0: exit {rc} {to_end:.1f} s after the kill")
    assert rc == 1
    assert_died(err, "generator actor died during the first weight sync (generator.load_segment)")
    assert to_end < 30, f"the run ended {to_end:.1f} s after the kill"


def test_describe_death_names_role_phase_and_how_the_process_ended():
    from composer_mesh.actors.monarch_compat import SupervisionError
    from composer_mesh.mesh.errors import describe, phase

    def died(text: str, *phases: str) -> str:
        exc = SupervisionError(text)
        try:
            try:
                with contextlib.ExitStack() as stack:
                    for name in reversed(phases):  # the first named is the innermost
                        stack.enter_context(phase(name))
                    raise exc
            except SupervisionError as inner:
                raise RuntimeError("a generator worker failed") from inner  # the async controller's wrapping
        except RuntimeError as outer:
            return describe(outer)

    head = "Endpoint call {}() failed, The actor <root>.<actors.{}Actor x{{'gpus': 0/1}}> and all its descendants"
    assert died(head.format("trainer.train_step_shard", "trainer.Trainer") + " have failed:\n  the process this "
                "actor was running on failed: Killed(sig=9)", "a train step", "the run") == (
        f"trainer actor died during a train step (trainer.train_step_shard): {DEATH_LINE}")
    assert died(head.format("generator.generate", "generator.Generator") + ":\n  failed: Killed(sig=6)",
                "generation") == "generator actor died during generation (generator.generate): killed by signal 6 (SIGABRT)"
    assert died(head.format("replay.info", "teacher_replay.TeacherReplay") + ":\n  failed: Exited(3)") == (
        "teacher_replay actor died (replay.info): its process exited with code 3")
    agent = ("Endpoint call trainer.setup() failed, The actor anon-0<x>@anon-0<x>.ipc://@y,proc_agent and all its "
             "descendants have failed:\n  timeout waiting for message from proc mesh agent while querying for "
             "\"trainer-1\". The process likely crashed")
    assert died(agent, "setup") == ("trainer actor died during setup (trainer.setup): its process stopped answering "
                                    "Monarch's supervision (taken as dead)")
    assert describe(ValueError("[trainer] steps: must be >= 1")) == "ValueError: [trainer] steps: must be >= 1"


RACE = """
import json, os, signal, sys, time
sys.path.insert(0, {repo!r})
from composer_mesh.mesh.errors import describe_death, phase
from composer_mesh.mesh.prespawn import configure_supervision
from composer_mesh.mesh.supervision import install_fault_hook
configure_supervision(1.0, 5.0)
install_fault_hook([])
from monarch.actor import Actor, endpoint, this_host

class Sleeper(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self) -> None:
        time.sleep(60)

procs = this_host().spawn_procs(per_host={{"gpus": 1}})
actor = procs.spawn("sleeper", Sleeper)
pid = actor.pid.call_one().get()
pending = actor.sleep.call_one()
os.kill(pid, signal.SIGSTOP)  # the next supervision poll's state query goes unanswered ...
time.sleep(1.5)
os.kill(pid, signal.SIGKILL)  # ... and the process dies while the query waits
killed = time.monotonic()
try:
    with phase("a sleep"):
        pending.get(timeout=60)
except Exception as exc:
    print(json.dumps({{"line": describe_death(exc), "after_s": time.monotonic() - killed,
                       "gone": not os.path.exists(f"/proc/{{pid}}")}}))
"""


def test_a_death_during_the_poll_s_query_is_reported_as_unanswered_within_state_query_s():
    """Monarch 0.7's race, reproduced: a process that dies while the supervision poll's state query to it is in flight
    is reported when the query times out (`[mesh] state_query_s`), and its exit status is reaped unreported — the
    one line then says the process stopped answering instead of naming the signal."""
    out = subprocess.run([sys.executable, "-c", RACE.format(repo=str(REPO))], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"a death during the poll's query: reported {got['after_s']:.1f} s after the kill: {got['line']}")
    assert got["line"] == f"sleeper actor died during a sleep (sleeper.sleep): {UNANSWERED_LINE}", got
    assert got["gone"], "the killed process is still there"
    assert got["after_s"] < 5.0 + 2 * 1.0 + 2.0, f"reported {got['after_s']:.1f} s after the kill"


def test_kill_point_fires_once_per_run(tmp_path):
    code = ("from composer_mesh.actors.chaos import kill_point; "
            "kill_point('trainer', 'other'); kill_point('trainer', 'setup'); print('survived')")
    env = dict(os.environ, **{ENV: "generator:setup, trainer:setup", MARKS_ENV: str(tmp_path)})
    run = lambda: subprocess.run([sys.executable, "-c", code], env=env,  # noqa: E731
                                 capture_output=True, text=True, timeout=60)
    first, second = run(), run()
    assert first.returncode == -signal.SIGKILL and first.stdout == ""
    assert second.returncode == 0 and second.stdout.strip() == "survived"  # the replacement gets past the phase
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer-setup"]
    os.environ.pop(ENV, None)
    kill_point("trainer", "setup")  # unset: nothing happens
