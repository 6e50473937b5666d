"""The grader's own errors are never a verdict (issue #55): they never reach a test, never escape `grade_workspace`.

A test that expects an exception (`pytest.raises(TypeError)`, `pytest.raises(Exception)`, `except BaseException`)
must not be satisfied by the judge's own failure to pass its argument across the split or by its handle table
running out: either is the violation `grader_error` and reward 0, whatever the test catches. The submission's own
exception still reaches the test. A workspace tree too deep to walk is `deep_tree`; any exception of grading on
the host is a grade of 0 (`grader_error`), never raised.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from composer_mesh.configs.sections.env import CodingConfig
from composer_mesh.envs.grading import grade_workspace
from composer_mesh.envs.micro import make_task
from composer_mesh.envs.pool import SandboxPool
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.sandbox import Sandbox

from test_envs_pool_poison import DEEP_TREE  # the sibling module: one deep tree made by sandboxed code

TARGET = "shapes.py"
REFERENCE = '''\
def total(items):
    if not isinstance(items, list):
        raise TypeError("total takes a list")
    return sum(items)


def checked(value):
    if value < 0:
        raise ValueError("negative")
    return value


def area_sum(boxes):
    return sum(b.area() for b in boxes)


def apply(fn, items):
    return [fn(x) for x in items]
'''
STUB = "".join(f"def {name}(*args, **kwargs):\n    raise NotImplementedError\n\n\n" for name in
               ("total", "checked", "area_sum", "apply"))
# how a test expects the exception of `total(<a generator>)`: each must fail when the judge, not the answer, raised
CATCHES = {
    "pytest_raises_type_error": "with pytest.raises(TypeError):\n    total(x for x in [1, 2])\n",
    "pytest_raises_exception": "with pytest.raises(Exception):\n    total(x for x in [1, 2])\n",
    "except_base_exception": (
        "try:\n    total(x for x in [1, 2])\nexcept BaseException:\n    return\nraise AssertionError('no error')\n"
    ),
}
# the control: a tuple crosses, and the answer's own TypeError for it reaches the test
CROSSES = "with pytest.raises(TypeError):\n    total((1, 2))\n"
TESTS = '''\
import pytest

from shapes import apply, area_sum, checked, total


class Box:
    def __init__(self, side):
        self.side = side

    def area(self):
        return self.side * self.side


def test_total():
    assert total([1, 2]) == 3


def test_total_refuses_a_generator():
{catch}

def test_checked_raises_its_own_error():
    with pytest.raises(ValueError):
        checked(-1)


def test_area_sum():
    assert area_sum([Box(1), Box(2)]) == 5


def test_apply_refuses_none():
    with pytest.raises(TypeError):
        apply(lambda x: x, None)
'''
# right but for `total`, which returns instead of raising TypeError for a generator
TOTAL_NEVER_RAISES = REFERENCE.replace('        raise TypeError("total takes a list")\n', "        pass\n")
# a right `area_sum` that also reads a bound method of the test's object past the judge's handle table (10,000
# handles), and an `apply` that never raises: the full table once made the judge raise the TypeError
# `pytest.raises(TypeError)` expects from the answer
EXHAUSTS_HANDLES = REFERENCE.replace("    return sum(b.area() for b in boxes)\n", """\
    for _ in range(10_001):
        try:
            boxes[0].area
        except Exception:
            pass
    return sum(b.area() for b in boxes)
""").replace("    return [fn(x) for x in items]\n", "    return []\n")


@pytest.fixture(scope="module", params=["cold", "pool"])
def backend(request, sandbox, tmp_path_factory):
    """A sandbox without a grade cache (every grade judged), cold or a pool of warm workers."""
    config = dataclasses.replace(sandbox.config, root_dir=str(tmp_path_factory.mktemp("errors-root")), grade_cache=0)
    if request.param == "cold":
        yield Sandbox(config)
        return
    with SandboxPool(dataclasses.replace(config, pool_size=2)) as pool:
        yield pool


def _pristine(root: Path, catch: str) -> Path:
    """The repository: the reference module and its tests, `catch` as the body of the generator test."""
    (root / "tests").mkdir(parents=True)
    (root / TARGET).write_text(REFERENCE)
    (root / "tests" / "test_shapes.py").write_text(TESTS.format(catch=textwrap.indent(catch, "    ")))
    return root


def _grade(backend, pristine: Path, answer: str, tests: list[str], plain: bool = False, targets=None):
    """Grade `answer` as the target file of a workspace that started from the stub."""
    expected = [f"tests/test_shapes.py::{t}" for t in tests]
    with backend.workspace(copy_from=pristine) as ws:
        (ws.path / TARGET).write_text(STUB)
        start = manifest(ws.path)
        (ws.path / TARGET).write_text(answer)
        return grade_workspace(backend, pristine, start, ws, expected, targets=targets or {TARGET: STUB}, plain=plain)


@pytest.mark.parametrize("plain", [False, True], ids=["pytest", "plain_runner"])
@pytest.mark.parametrize("catch", sorted(CATCHES))
def test_an_argument_that_cannot_cross_never_satisfies_a_test(catch, plain, backend, tmp_path):
    """A generator cannot cross to the submission's process: the judge's failure is `grader_error`, not the
    TypeError (or any exception) the test expects, so neither a wrong answer nor the right one is paid."""
    pristine = _pristine(tmp_path / "repo", CATCHES[catch])
    tests = ["test_total", "test_total_refuses_a_generator"]
    for answer in (TOTAL_NEVER_RAISES, REFERENCE):
        grade = _grade(backend, pristine, answer, tests, plain)
        assert (grade.reward, grade.reason) == (0.0, "grader_error"), grade
        assert grade.infra and any("cannot cross" in detail for _, detail in grade.violations), grade


@pytest.mark.parametrize("plain", [False, True], ids=["pytest", "plain_runner"])
def test_an_exhausted_handle_table_never_satisfies_a_test(plain, backend, tmp_path):
    pristine = _pristine(tmp_path / "repo", CROSSES)
    grade = _grade(backend, pristine, EXHAUSTS_HANDLES, ["test_area_sum", "test_apply_refuses_none"], plain)
    assert (grade.reward, grade.reason) == (0.0, "grader_error"), grade
    assert any("handles" in detail for _, detail in grade.violations), grade


@pytest.mark.parametrize("plain", [False, True], ids=["pytest", "plain_runner"])
def test_the_submissions_own_exception_still_reaches_the_test(plain, backend, tmp_path):
    """Controls: the answer's own TypeError (for a tuple, which crosses) and ValueError satisfy the tests that
    demand them, and an answer that raises neither fails just those tests."""
    pristine = _pristine(tmp_path / "repo", CROSSES)
    tests = ["test_total", "test_total_refuses_a_generator", "test_checked_raises_its_own_error", "test_area_sum",
             "test_apply_refuses_none"]
    right = _grade(backend, pristine, REFERENCE, tests, plain)
    assert (right.reward, right.reason, right.violations, right.infra) == (1.0, "passed", (), False), right
    never_raises = TOTAL_NEVER_RAISES.replace('        raise ValueError("negative")\n', "        pass\n")
    wrong = _grade(backend, pristine, never_raises, tests, plain)
    assert (wrong.reward, wrong.reason, wrong.infra) == (0.0, "tests_failed (3/5 passed)", False), wrong


def test_a_workspace_tree_too_deep_to_walk_is_a_violation_not_an_exception(sandbox):
    """A tree past the recursion limit and PATH_MAX, made by a sandboxed program in the agent's workspace, is
    `deep_tree` (with and without a grade cache), never a RecursionError out of the grader."""
    task = make_task(CodingConfig(), "train", 4)
    for grades in (sandbox.config.grade_cache, 0):
        backend = Sandbox(dataclasses.replace(sandbox.config, grade_cache=grades))
        with task.workspace(backend) as ws:
            start = manifest(ws.path)
            for rel, text in task.reference_files().items():
                (ws.path / rel).write_text(text)
            (ws.path / "deep.py").write_text(DEEP_TREE.replace('(top, "/tmp", "/dev/shm")', "(top,)"))
            made = backend.run([backend.python(), "deep.py"], ws)
            assert made.ok and "deep" in made.stdout, made
            grade = task.grade(backend, ws, start)
        assert (grade.reward, grade.reason, grade.infra) == (0.0, "deep_tree", False), grade


def test_an_exception_of_grading_on_the_host_is_a_grade_judged_again(sandbox, tmp_path):
    """A target the judge cannot forward makes grading raise on the host: a grade of 0 marked `infra`, not an
    exception, and the cache keeps none of it (the next identical grade is judged again)."""
    caching = Sandbox(sandbox.config)
    pristine = _pristine(tmp_path / "repo", CROSSES)
    for misses in (1, 2):
        grade = _grade(caching, pristine, REFERENCE, ["test_total"], targets={"not-a-module.py": STUB})
        assert (grade.reward, grade.reason, grade.infra) == (0.0, "grader_error", True), grade
        assert "ValueError" in grade.violations[0][1] and (caching.grades.hits, caching.grades.misses) == (0, misses)
