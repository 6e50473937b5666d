"""Grades by content (`envs.grade_cache`, `[env.sandbox] grade_cache`): a repeated submission is judged once,
its cached grade equals a fresh judge's, and anything the grade reads changes the key."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest

from composer_mesh.configs.sections.env import CodingConfig
from composer_mesh.envs.grade_cache import GradeCache
from composer_mesh.envs.micro import HIDDEN_TESTS, VISIBLE_TESTS, make_task
from composer_mesh.envs.micro_ops import KINDS
from composer_mesh.envs.pool import SandboxPool
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.sandbox import Sandbox

from test_envs_pool import _wait_for_workers

EASY = CodingConfig()
HARD = CodingConfig(functions_per_task=2, statements_per_body=2, kinds=KINDS, ops_per_kind=0, distractor_files=1)


def test_cache_keeps_the_last_capacity_results_and_never_a_failure():
    cache = GradeCache(2)
    made: list[str] = []

    def make(key):
        made.append(key)
        return key.upper()

    assert cache.get_or_make("a", lambda: make("a")) == ("A", False)
    assert cache.get_or_make("b", lambda: make("b")) == ("B", False)
    assert cache.get_or_make("a", lambda: make("a")) == ("A", True)  # "a" is now the most recent
    assert cache.get_or_make("c", lambda: make("c")) == ("C", False)  # evicts "b"
    assert cache.get_or_make("a", lambda: make("a")) == ("A", True)
    assert cache.get_or_make("b", lambda: make("b")) == ("B", False)
    assert made == ["a", "b", "c", "b"] and (cache.hits, cache.misses) == (2, 4)

    def boom():
        raise RuntimeError("judge died")

    with pytest.raises(RuntimeError, match="judge died"):
        cache.get_or_make("d", boom)
    assert cache.get_or_make("d", lambda: "D") == ("D", False)
    with pytest.raises(ValueError, match="at least 1"):
        GradeCache(0)


def test_concurrent_callers_of_one_key_wait_for_one_judge():
    """A group's episodes submitting the same edit in the same turn: one judge, every caller its grade."""
    cache = GradeCache(8)
    release, calls = threading.Event(), []

    def judge():
        calls.append(1)
        assert release.wait(10)
        return "graded"

    out: list[tuple] = []
    threads = [threading.Thread(target=lambda: out.append(cache.get_or_make("k", judge))) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while cache.hits + cache.misses < 4 and time.monotonic() < deadline:  # all four have asked
        time.sleep(0.01)
    assert cache.hits + cache.misses == 4
    release.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and sorted(out) == [("graded", False)] + [("graded", True)] * 3


@pytest.mark.parametrize("failure", ["not_kept", "raised"])
def test_callers_waiting_on_a_key_never_get_a_result_that_was_not_kept(failure):
    """The first judge of a key fails (an infrastructure failure, not kept; or it raises) while three callers wait
    for it: they do not get its result, one of them judges again and the others get that verdict."""
    cache = GradeCache(8)
    release, calls = threading.Event(), []

    def judge():
        calls.append(1)
        assert release.wait(10)
        if len(calls) == 1 and failure == "raised":
            raise RuntimeError("the sandbox broke")
        return "infra" if len(calls) == 1 else "verdict"

    out: list[tuple] = []

    # a judge that raises needs no `keep`: its failure is never kept nor handed on
    keep = {"keep": lambda result: result != "infra"} if failure == "not_kept" else {}

    def ask():
        try:
            out.append(cache.get_or_make("k", judge, **keep))
        except RuntimeError as exc:
            out.append((str(exc), False))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while cache.hits + cache.misses < 4 and time.monotonic() < deadline:  # all four have asked
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(10)
    first = ("infra", False) if failure == "not_kept" else ("the sandbox broke", False)
    assert len(calls) == 2 and sorted(out) == sorted([first, ("verdict", False), ("verdict", True), ("verdict", True)])
    assert cache.get_or_make("k", judge) == ("verdict", True) and len(calls) == 2
    assert (cache.hits, cache.misses) == (3, 2)


def _grade(task, sandbox, sources: dict[str, str], *, dirs=(), violations=()):
    with task.workspace(sandbox) as ws:
        start = manifest(ws.path)
        for rel, text in sources.items():
            (ws.path / rel).write_text(text)
        for rel in dirs:
            (ws.path / rel).mkdir()
        return task.grade(sandbox, ws, start, violations)


def _verdict(grade):
    return grade.reward, grade.reason, grade.passed, grade.total, grade.violations


def _submissions(task) -> list[dict[str, str]]:
    """Right, untouched, wrong, half right, tests edited, and a hostile one (it rewrites the judge's tests)."""
    target, ref = task.target, task.reference[task.target]
    wrong = ref.replace(" + ", " - ").replace(" * ", " + ").replace(" - ", " * ")
    return [
        {target: ref},
        {},
        {target: wrong},
        {target: ref.split("\n\n\n")[0] + "\n\n\n" + "\n\n\n".join(task.stubbed_source.split("\n\n\n")[1:])},
        {**task.reference, VISIBLE_TESTS: task.files[VISIBLE_TESTS] + "\n# edited\n"},
        {target: ref + f"\nopen({HIDDEN_TESTS!r}, 'w').write('')\n"},
    ]


@pytest.mark.parametrize("config", [EASY, HARD], ids=["easy", "hard"])
def test_a_cached_grade_is_the_fresh_judges_grade(sandbox, config):
    """Each submission graded twice by a caching sandbox: the second is a hit, and both equal what a sandbox
    without a cache judges (reward, reason, passed, total, violations)."""
    fresh = Sandbox(dataclasses.replace(sandbox.config, grade_cache=0))
    caching = Sandbox(sandbox.config)
    assert fresh.grades is None and caching.grades is not None
    task = make_task(config, "train", 3)
    for i, sources in enumerate(_submissions(task)):
        judged = _grade(task, fresh, sources)
        first, again = _grade(task, caching, sources), _grade(task, caching, sources)
        assert _verdict(first) == _verdict(again) == _verdict(judged), (i, judged, first, again)
        # a hit's cost is its own lookup: positive (a sub-millisecond time is not rounded to 0) and below the judge's
        assert 0 < again.grade_s < first.grade_s, (i, first.grade_s, again.grade_s)
        assert (caching.grades.hits, caching.grades.misses) == (i + 1, i + 1)
    assert {_verdict(_grade(task, caching, s))[0] for s in _submissions(task)} > {0.0}


def test_the_key_covers_what_the_grade_reads(sandbox):
    """A new empty directory, a new non-source file, episode violations, the sandbox's limits: each a miss."""
    caching = Sandbox(sandbox.config)
    task = make_task(EASY, "train", 1)
    ref = {task.target: task.reference[task.target]}
    base = _grade(task, caching, ref)
    assert base.reward == 1.0 and caching.grades.misses == 1
    assert _grade(task, caching, ref).reward == 1.0 and caching.grades.hits == 1
    _grade(task, caching, ref, dirs=["empty"])
    _grade(task, caching, {**ref, "notes.txt": "x"})
    violated = _grade(task, caching, ref, violations=[("tool_error", "shell: not allowed")])
    assert violated.reward == 0.0 and violated.reason == "tool_error"
    assert (caching.grades.hits, caching.grades.misses) == (1, 4)
    slower = Sandbox(dataclasses.replace(sandbox.config, wall_timeout_s=sandbox.config.wall_timeout_s + 1))
    slower.grades = caching.grades  # the same cache under other limits
    assert _grade(task, slower, ref).reward == 1.0 and caching.grades.misses == 5


def test_a_broken_worker_is_no_verdict_and_the_same_answer_is_judged_again(sandbox, tmp_path):
    """Both warm workers killed from the host while idle: the correct answer's grade is lost (0, `worker_lost`,
    `infra`); once the pool replaced them, the identical answer is judged again and earns 1, then is a hit."""
    config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path), pool_size=2, wall_timeout_s=60.0)
    task = make_task(EASY, "train", 2)
    with SandboxPool(config) as pool:
        _wait_for_workers(pool, 2)
        for worker in list(pool._free):  # what an OOM kill or an operator does to a worker between grades
            os.kill(worker.zygote, signal.SIGKILL)
        lost = _grade(task, pool, task.reference_files())
        _wait_for_workers(pool, 2)
        healed = _grade(task, pool, task.reference_files())
        again = _grade(task, pool, task.reference_files())
    assert (healed.reward, healed.reason) == (1.0, "passed") and not healed.infra, (healed, lost)
    assert (lost.reward, lost.reason, lost.infra) == (0.0, "worker_lost", True), lost
    assert again.reward == 1.0 and (pool.grades.hits, pool.grades.misses) == (1, 2)


def test_no_sandbox_to_judge_in_is_no_verdict_and_the_same_answer_is_judged_again(sandbox):
    """Every private uid taken (by other graders' locks): the grade is 0, `sandbox_unavailable`, `infra`, not an
    exception; once the uids are free the identical answer is judged again and earns 1."""
    base = sandbox.config.uid_base + sandbox.config.uid_count + 7_000  # a range of its own: 3 uids
    caching = Sandbox(dataclasses.replace(sandbox.config, uid_base=base, uid_count=3))
    task = make_task(EASY, "train", 8)
    with task.workspace(caching) as ws:  # the agent's workspace holds one of the three
        start = manifest(ws.path)
        for rel, text in task.reference_files().items():
            (ws.path / rel).write_text(text)
        taken = [caching.uid_locks / f"uid-{uid}" for uid in range(base, base + 3) if uid != ws.uid]
        for lock in taken:
            lock.touch(exist_ok=False)
        try:
            unavailable = task.grade(caching, ws, start)
        finally:
            for lock in taken:
                lock.unlink()
        judged = task.grade(caching, ws, start)
    assert (unavailable.reward, unavailable.reason, unavailable.infra) == (0.0, "sandbox_unavailable", True)
    assert (judged.reward, judged.reason) == (1.0, "passed") and caching.grades.misses == 2, judged
