"""Pool poisoning (issue #55): a job of a slot's uid changes what its zygote hands later jobs, or leaves a tree deeper
than the recursion limit; the slot is put back or replaced, the resetter thread survives, `close()` never raises.

Every attack here is real code run by the sandboxed job against its own zygote (`os.getppid()`): prlimit,
setpriority, sched_setscheduler, sched_setattr, sched_setaffinity, ioprio_set, mkdir + chdir."""

from __future__ import annotations

import dataclasses
import json
import platform

import pytest

from composer_mesh.configs.sections.env import CodingConfig
from composer_mesh.envs.micro import make_task
from composer_mesh.envs.pool import _SYSCALLS, SandboxPool
from composer_mesh.envs.safeguards import manifest

from test_envs_micro_hostile import candidate  # the sibling module: a candidate answering through a payload
from test_envs_pool import LOOK, _use, _wait_for_workers

_NR = _SYSCALLS[platform.machine()]
# Sandboxed: the inherited state of a process (0: the caller) as the job itself reads it, not as the pool does.
STATE = f"""
import ctypes, json, os
_libc = ctypes.CDLL(None, use_errno=True)
class _Attr(ctypes.Structure):  # struct sched_attr
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64), ("util_min", ctypes.c_uint32),
                ("util_max", ctypes.c_uint32)]
def state(pid):
    attr = _Attr()
    assert _libc.syscall({_NR["sched_getattr"]}, pid, ctypes.byref(attr), ctypes.sizeof(attr), 0) == 0
    return {{
        "limits": open(f"/proc/{{pid or 'self'}}/limits").read(),
        "sched": [getattr(attr, n) for n, _ in _Attr._fields_[1:]],
        "nice": os.getpriority(os.PRIO_PROCESS, pid),
        "affinity": sorted(os.sched_getaffinity(pid)),
        "ioprio": _libc.syscall({_NR["ioprio_get"]}, 1, pid),
    }}
"""
REPORT = STATE + "print(json.dumps(state(0)))\n"
# name -> the attack on the zygote `z` (a job of its uid may do all of this to it)
ATTACKS = {
    "rlimits": """
import resource
for number in range(len(open("/proc/self/limits").read().splitlines()) - 1):  # every resource the kernel has
    soft, hard = resource.prlimit(z, number)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 40
    elif hard > 1:
        hard -= 1
    soft = hard if soft == resource.RLIM_INFINITY else min(soft, hard)
    resource.prlimit(z, number, (soft, hard))
""",
    "nice": "os.setpriority(os.PRIO_PROCESS, z, 19)\n",
    "policy": "os.sched_setscheduler(z, os.SCHED_IDLE, os.sched_param(0))\n",
    "slice": f"""
attr = _Attr(ctypes.sizeof(_Attr), 0, 0, 0, 0, 3_000_000)
assert _libc.syscall({_NR["sched_setattr"]}, z, ctypes.byref(attr), 0) == 0, ctypes.get_errno()
""",
    "affinity": "os.sched_setaffinity(z, {min(os.sched_getaffinity(z))})\n",
    "ioprio": f"assert _libc.syscall({_NR['ioprio_set']}, 1, z, 3 << 13) == 0, ctypes.get_errno()\n",
}
# a job of the uid may lower its zygote's priority, not raise it again: the slice (set at nice 0) before nice and policy
ATTACKS["all"] = "".join(ATTACKS[n] for n in ("rlimits", "slice", "affinity", "ioprio", "nice", "policy"))


def _attack(code: str) -> str:
    """A job that attacks its zygote with `code` and prints the zygote's state before and after."""
    return STATE + "z = os.getppid()\nbefore = state(z)\n" + code + "print(json.dumps([before, state(z)]))\n"


@pytest.fixture(scope="module")
def pool(sandbox, tmp_path_factory):
    """One warm slot: every use reuses it (or its replacement); a use that finds no slot free runs cold."""
    config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path_factory.mktemp("poison-root")), pool_size=1)
    with SandboxPool(config) as p:
        yield p


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_job_cannot_change_what_later_jobs_inherit_from_the_zygote(name, pool):
    """The next job starts as the first did: its zygote's changed state was put back, or the slot replaced."""
    clean, _ = _use(pool, REPORT)
    assert clean.ok, clean
    before = pool.stats()
    attacked, _ = _use(pool, _attack(ATTACKS[name]))
    assert attacked.ok, attacked
    zygote_before, zygote_after = json.loads(attacked.stdout)
    # the attack took (an affinity of one CPU has nothing to narrow)
    assert zygote_after != zygote_before or len(zygote_before["affinity"]) == 1, zygote_after
    _wait_for_workers(pool, 1)
    later, _ = _use(pool, REPORT)
    assert later.ok, later  # a lowered hard limit no longer makes every later job fail its setrlimit
    assert json.loads(later.stdout) == json.loads(clean.stdout)
    after = pool.stats()
    assert after["restored"] + after["replaced"] > before["restored"] + before["replaced"], after
    assert after["cold_fallbacks"] == before["cold_fallbacks"], after


def test_a_poisoning_answer_cannot_fail_later_correct_answers(sandbox, tmp_path, monkeypatch):
    """A candidate whose callee lowers its zygote's hard limits, then grades of the correct answer in the same
    pool: each earns 1 (the poisoned slot serves as judge and callee after it)."""
    monkeypatch.setattr("composer_mesh.envs.grading.scan_source", lambda new, old: [])
    task = make_task(CodingConfig(), "train", 5)
    payload = STATE + "z = os.getppid()\n" + ATTACKS["rlimits"] + "def _answer(*a, **k):\n    return None\n"
    config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path), pool_size=2, grade_cache=0,
                                 wall_timeout_s=60.0)

    def grade(pool: SandboxPool, sources: dict[str, str]):
        with task.workspace(pool) as ws:
            start = manifest(ws.path)
            for rel, text in sources.items():
                (ws.path / rel).write_text(text)
            return task.grade(pool, ws, start)

    with SandboxPool(config) as pool:
        poisoned = grade(pool, {task.target: candidate(task, payload)})
        assert poisoned.reward == 0.0, poisoned
        later = [grade(pool, task.reference_files()) for _ in range(3)]
        assert [(g.reward, g.reason) for g in later] == [(1.0, "passed")] * 3, later
        assert pool.stats()["restored"] >= 1 and pool.stats()["cold_fallbacks"] == 0, pool.stats()


DEEP_TREE = """
import os
top = os.getcwd()
for root in (top, "/tmp", "/dev/shm"):
    os.chdir(root)
    for _ in range(1500):  # past the recursion limit, and past PATH_MAX (4 characters a level)
        os.mkdir("ddd")
        os.chdir("ddd")
print("deep", len(os.getcwd()))
"""


def test_a_tree_deeper_than_the_recursion_limit_is_wiped_and_the_slot_serves_on(pool):
    """A tree a recursive remover dies on (RecursionError) is removed; the resetter goes on, the slot stays warm."""
    before = pool.stats()
    deep, _ = _use(pool, DEEP_TREE)
    assert deep.ok and "deep" in deep.stdout, deep
    _wait_for_workers(pool, 1)
    for _ in range(2):  # served warm (`_use` asserts it) and clean, twice: the resetter lives on
        look, _ = _use(pool, LOOK)
        ws_files, tmp_files, shm_files = eval(look.stdout)  # noqa: S307 (our own program's repr output)
        assert ws_files == ["job.py"] and "ddd" not in tmp_files and shm_files == [], look
    after = pool.stats()
    assert after["cold_fallbacks"] == before["cold_fallbacks"] and after["replaced"] == before["replaced"], after


def test_close_never_raises_with_a_deep_tree_in_a_leased_slot(sandbox, tmp_path):
    config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path), pool_size=1)
    pool = SandboxPool(config)
    with pool.scratch_workspace() as ws:
        (ws.path / "job.py").write_text(DEEP_TREE)
        ws.adopt()
        deep = pool.run([pool.python(), "job.py"], ws)
        assert deep.ok, deep
        lock = ws.worker.lock
        pool.close()
    assert not pool.dir.exists() and not lock.exists()
    pool.close()  # again: nothing to do
