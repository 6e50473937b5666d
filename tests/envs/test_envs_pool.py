"""The warm sandbox pool: reuse resets a slot, a hostile job cannot reach the next one, threads share it,
a dead worker is replaced, and grading through it pays what a cold grade pays."""

from __future__ import annotations

import dataclasses
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from composer_mesh.configs.sections.env import CodingConfig
from composer_mesh.envs.backend import SandboxBackend
from composer_mesh.envs.micro import make_task
from composer_mesh.envs.pool import SandboxPool
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.sandbox import Sandbox, processes_of, processes_with

from test_envs_micro_hostile import PATCH_WORKER, candidate  # the sibling module: one payload for both

MARKER = "composer-pool-marker-7c1"


@pytest.fixture(scope="module")
def pool(sandbox, tmp_path_factory):
    """One warm slot (so every use reuses it), under the test sandbox's limits."""
    config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path_factory.mktemp("pool-root")), pool_size=1)
    with SandboxPool(config) as p:
        yield p


def _python(pool: SandboxPool, ws, code: str, **kw):
    (ws.path / "job.py").write_text(code)
    ws.adopt()
    return pool.run([pool.python(), "job.py"], ws, **kw)


def _use(pool: SandboxPool, code: str, **kw):
    """One lease of the (single) slot: run `code` there, give the slot back; (result, uid)."""
    with pool.scratch_workspace() as ws:
        assert getattr(ws, "worker", None) is not None  # a warm slot, not a cold fallback
        return _python(pool, ws, code, **kw), ws.uid


def _wait_for_workers(pool: SandboxPool, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.stats()["free"] < n:
        assert time.monotonic() < deadline, pool.stats()
        time.sleep(0.05)


def _wait_until_stopped(pid: int, timeout_s: float = 30.0) -> None:
    """A signal is delivered asynchronously: wait until `pid` shows as stopped."""
    deadline = time.monotonic() + timeout_s
    while "\nState:\tT" not in open(f"/proc/{pid}/status").read():
        assert time.monotonic() < deadline
        time.sleep(0.01)


LEAVE_BEHIND = f"""
import os, subprocess
open("left.txt", "w").write("x")
open("/tmp/left.txt", "w").write("x")
open("/dev/shm/left.txt", "w").write("x")
os.makedirs("/tmp/locked/deeper")
os.chmod("/tmp/locked", 0)
subprocess.Popen(["/usr/bin/sleep", "300", "{MARKER}"], start_new_session=True)
print("left", os.getuid())
"""

LOOK = """
import os
print(repr((sorted(os.listdir(".")), sorted(os.listdir("/tmp")), sorted(os.listdir("/dev/shm")))))
"""


def test_reuse_resets_files_and_processes(pool):
    before = pool.stats()
    first, uid1 = _use(pool, LEAVE_BEHIND)
    assert first.ok and "left" in first.stdout, first
    assert processes_with(MARKER) == []  # the job's cgroup was killed with the job
    second, uid2 = _use(pool, LOOK)
    assert uid1 == uid2  # the same warm slot, reused
    ws_files, tmp_files, shm_files = eval(second.stdout)  # noqa: S307 (our own program's repr output)
    assert ws_files == ["job.py"]
    assert "left.txt" not in tmp_files and "locked" not in tmp_files and shm_files == []
    after = pool.stats()
    assert after["resets"] - before["resets"] == 2 and after["replaced"] == before["replaced"]
    assert after["warm_runs"] - before["warm_runs"] == 2


def test_a_slot_with_read_only_mounts_under_tmp_is_reset_and_reused_not_replaced(sandbox, tmp_path):
    """A checkout or interpreter under /tmp is mounted inside the sandbox's own /tmp (bwrap makes root's
    directories on the way): the reset keeps them and still wipes what the job left beside them."""
    # beside the workspaces' own tree under /tmp, not inside it (whose directories the reset keeps anyway)
    with tempfile.TemporaryDirectory(prefix="checkout-", dir="/tmp") as checkout:
        exposed = Path(checkout) / "main"
        exposed.mkdir()
        (exposed / "data.txt").write_text("x")
        config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path / "root"), pool_size=1,
                                     expose_paths=(str(exposed),))
        with SandboxPool(config) as pool:
            first, uid1 = _use(pool, LEAVE_BEHIND)
            assert first.ok and "left" in first.stdout, first
            second, uid2 = _use(pool, LOOK + f"print(open({str(exposed / 'data.txt')!r}).read())\n")
            assert uid1 == uid2 and pool.stats()["replaced"] == 0, pool.stats()
            assert "left.txt" not in second.stdout and "locked" not in second.stdout, second
            # the mount is still there for the next job
            assert second.ok and second.stdout.rstrip().endswith("x"), second


def test_the_job_runs_with_the_cold_limits_and_its_own_cgroup(pool):
    with pool.scratch_workspace() as ws:
        bomb = _python(pool, ws, f"import os  # {MARKER}\nwhile True:\n    os.fork()\n", timeout_s=10)
        assert bomb.exit_code != 0 and "process_limit" in bomb.violations, bomb
        assert processes_with(MARKER) == [] and processes_of(ws.uid) == [ws.worker.zygote]
        slow = _python(pool, ws, "import time\ntime.sleep(60)\n", timeout_s=1.0)
        assert slow.timed_out and "timeout" in slow.violations
        hog = _python(pool, ws, "x = bytearray(10 * 1024**3)\n")
        assert hog.exit_code == 1 and "memory_limit" in hog.violations
        ok = _python(pool, ws, "print('still serving')\n")
        assert ok.ok and ok.stdout.strip() == "still serving"


HOSTILE_TO_THE_ZYGOTE = """
import errno, os, signal
zygote = os.getppid()
found = []
for path in (f"/proc/{zygote}/mem", f"/proc/{zygote}/environ", f"/proc/{zygote}/fd/0"):
    try:
        open(path, "rb").read(1)
        found.append("read " + path)
    except OSError:
        pass
try:
    os.readlink(f"/proc/{zygote}/cwd")
    found.append("cwd")
except OSError:
    pass
# lazy: only this hostile program needs ctypes
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
if libc.shmget(0, 4096, 0o1666) != -1 or ctypes.get_errno() != errno.EPERM:
    found.append("sysv shm")
if libc.msgget(0, 0o1666) != -1:
    found.append("sysv msg")
print("FOUND", found)
os.kill(zygote, signal.SIGSTOP)
"""


def test_a_hostile_job_cannot_reach_the_worker_or_the_next_job(pool):
    before = pool.stats()
    result, _ = _use(pool, HOSTILE_TO_THE_ZYGOTE)
    assert "FOUND []" in result.stdout, result
    # the stopped worker never reported: the job is lost (bounded by its timeout), the worker replaced
    assert not result.ok
    _wait_for_workers(pool, 1)
    assert pool.stats()["replaced"] - before["replaced"] == 1
    second, _ = _use(pool, LOOK)
    assert second.ok and eval(second.stdout)[0] == ["job.py"], second  # noqa: S307


def test_a_dead_worker_is_replaced(pool):
    before = pool.stats()
    killed, _ = _use(pool, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(5)\n")
    # the job is lost to its worker: no verdict about it (`worker_lost` first, not a CPU limit)
    assert not killed.ok and killed.exit_code == -signal.SIGKILL and killed.violations[0] == "worker_lost", killed
    _wait_for_workers(pool, 1)
    with pool.scratch_workspace() as ws:
        # killed from the host while idle: the check before the next use notices it
        os.kill(ws.worker.zygote, signal.SIGKILL)
        lost = _python(pool, ws, "print('never')\n")
        assert not lost.ok and "never" not in lost.stdout and lost.violations[0] == "worker_lost", lost
    _wait_for_workers(pool, 1)
    with pool.scratch_workspace() as ws:
        # the next job's process (forked ahead) killed from the host: never set up, so the job never ran
        (spare,) = ws.worker.placed.pids()
        os.kill(spare, signal.SIGKILL)
        unstarted = _python(pool, ws, "print('never')\n")
        assert not unstarted.ok and "never" not in unstarted.stdout and unstarted.violations[0] == "worker_lost"
    _wait_for_workers(pool, 1)
    with pool.scratch_workspace() as ws:
        # stopped from the host between uses: the reset check refuses the slot
        os.kill(ws.worker.zygote, signal.SIGSTOP)
        _wait_until_stopped(ws.worker.zygote)
    _wait_for_workers(pool, 1)
    again, _ = _use(pool, "print('fresh')\n")
    assert again.ok and again.stdout.strip() == "fresh"
    after = pool.stats()
    assert after["replaced"] - before["replaced"] == 4 and after["reset_failures"] - before["reset_failures"] == 1


def test_graders_share_the_pool_from_threads(sandbox, tmp_path):
    config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path), pool_size=2, pool_wait_s=30.0)
    coding = CodingConfig()
    results: dict[tuple[int, bool], float] = {}
    errors: list[BaseException] = []

    def grade(seed: int, correct: bool) -> None:
        try:
            task = make_task(coding, "train", seed)
            with task.workspace(pool) as ws:
                start = manifest(ws.path)
                if correct:
                    for rel, text in task.reference_files().items():
                        (ws.path / rel).write_text(text)
                results[seed, correct] = task.grade(pool, ws, start).reward
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with SandboxPool(config) as pool:
        threads = [threading.Thread(target=grade, args=(s, s % 2 == 0)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # returned slots are reset in the background: both come back
        _wait_for_workers(pool, 2)
        stats = pool.stats()
    assert errors == []
    assert results == {(s, s % 2 == 0): (1.0 if s % 2 == 0 else 0.0) for s in range(6)}
    assert stats["cold_fallbacks"] == 0 and stats["warm_runs"] == 12 and stats["free"] == 2, stats


def test_a_pooled_grade_equals_a_cold_grade(sandbox, tmp_path):
    task = make_task(CodingConfig(), "train", 3)
    # a wall limit a loaded box cannot reach for a correct answer: the comparison is of verdicts
    config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path), wall_timeout_s=60.0)
    sandbox = Sandbox(config)
    with SandboxPool(dataclasses.replace(config, pool_size=2)) as pool:
        assert isinstance(pool, SandboxBackend)
        for backend in (sandbox, pool):
            for correct in (True, False):
                with task.workspace(backend) as ws:
                    start = manifest(ws.path)
                    if correct:
                        for rel, text in task.reference_files().items():
                            (ws.path / rel).write_text(text)
                    grade = task.grade(backend, ws, start)
                assert (grade.reward, grade.passed) == ((1.0, grade.total) if correct else (0.0, 0)), (backend, grade)
        assert pool.stats()["warm_runs"] == 4


class _RecordingPool(SandboxPool):
    """A pool that notes which grader script ran in which slot (uid), in order."""

    def __init__(self, config) -> None:
        self.runs: list[tuple[str, int]] = []
        super().__init__(config)

    def run(self, argv, ws, **kw):
        self.runs.append((os.path.basename(argv[5]) if len(argv) > 5 else argv[0], ws.uid))
        return super().run(argv, ws, **kw)


def test_a_candidate_that_patches_its_worker_cannot_reach_later_grades(sandbox, tmp_path):
    """A callee that swaps its worker's preloaded runner for a forger and its wire decoding for always-equal
    changed only its own fork: the judges that later run in that slot still fail the wrong answer."""
    task = make_task(CodingConfig(), "train", 11)
    config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path), pool_size=2, wall_timeout_s=60.0)

    def grade(pool: SandboxPool, sources: dict[str, str]):
        with task.workspace(pool) as ws:
            start = manifest(ws.path)
            for rel, text in sources.items():
                (ws.path / rel).write_text(text)
            return task.grade(pool, ws, start)

    with _RecordingPool(config) as pool:
        hostile = grade(pool, {task.target: candidate(task, PATCH_WORKER)})
        assert hostile.reward == 0.0 and "patched=2" in hostile.output, hostile  # it did patch its own copy
        (patched_slot,) = {uid for script, uid in pool.runs if script == "_callee.py"}
        pool.runs.clear()
        later = [grade(pool, {}) for _ in range(3)]
        assert [g.reward for g in later] == [0.0] * 3 and all(g.reason.startswith("tests_failed") for g in later), later
        # the patched slot served as a judge since
        assert ("_grade_runner.py", patched_slot) in pool.runs, pool.runs
        assert grade(pool, task.reference_files()).reward == 1.0
