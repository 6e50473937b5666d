"""SWE-bench rows from fixing commits: FAIL_TO_PASS and PASS_TO_PASS found by running the tests, each row graded
before it is kept.

`RowMaker.make(fix)` runs the test modules of a fix's test part (`envs.swe_commits`) twice in the sandbox, on
the base commit with the test part applied, without and with the source part: pytest as a SWE grade runs it
(`SweTask.run_pytest`), its report read and cross-checked as a grade reads it (`envs.swe_verdict`).
FAIL_TO_PASS are the tests that pass with the fix and did not without it (a failure, or a module that did not
import), PASS_TO_PASS those that passed both times; a test that fails with the fix refuses the commit. The row
is then read back by `envs.swe.load_instances`, as a recipe reads it, and graded as training grades it
(`SweTask.grade_patch`): the gold patch must earn 1 and no patch 0.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from composer_mesh.configs.sections.env import SweConfig
from composer_mesh.envs.backend import SandboxBackend
from composer_mesh.envs.swe import SweTask, load_instances, patched_files, write_files
from composer_mesh.envs.swe_commits import FixCommit
from composer_mesh.envs.swe_verdict import Canaries, node_outcomes, read_report

# pytest's default test module names (python_files): the modules of a test part that are run
_TEST_MODULE = re.compile(r"(?:^|/)(?:test_[^/]*|[^/]*_test)\.py$")


def modules_to_run(task: SweTask) -> list[str]:
    """The test modules (test_*.py, *_test.py) the task's test part adds or changes; ValueError when it has none."""
    modules = [rel for rel, data in patched_files(task.test_patch, task.snapshot()).items()
               if data is not None and _TEST_MODULE.search(rel)]
    if not modules:
        raise ValueError("its test part holds no test module to run (test_*.py or *_test.py)")
    return modules


def run_tests(task: SweTask, backend: SandboxBackend, patch: str, modules: Sequence[str]) -> dict[str, str]:
    """Node id -> worst outcome (PASSED, FAILED, ERROR, XPASS, XFAIL; a module that did not import under its path)
    of pytest over `modules` on the base commit with the test part and `patch` applied; ValueError when pytest
    left no report to trust (a limit hit, no final counts, lines and counts that disagree)."""
    snapshot = task.snapshot()
    with task.workspace(backend) as ws:
        write_files(ws.path, patched_files(task.test_patch, snapshot) | patched_files(patch, snapshot))
        ws.adopt()
        result = task.run_pytest(backend, ws, ["--continue-on-collection-errors", *modules])
    outcomes = node_outcomes(result.stdout)
    report = read_report(result.stdout, result.exit_code, list(outcomes), Canaries(()))
    problems = [*result.violations, *report.forged] + ([] if report.summary_found else ["no final counts"])
    if problems:
        tail = " | ".join((result.stdout + result.stderr).strip().splitlines()[-3:])[:300]
        raise ValueError(f"pytest left no report to trust ({'; '.join(problems)}; exit {result.exit_code}): {tail}")
    return report.outcomes


def fail_and_pass(before: Mapping[str, str], after: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(FAIL_TO_PASS, PASS_TO_PASS) from the outcomes without and with the fix (tests skipped or expected to fail
    with it are in neither); ValueError naming the tests that fail with the fix, or when none fails without it."""
    broken = [node for node, outcome in after.items() if outcome in ("FAILED", "ERROR")]
    if broken:
        raise ValueError(f"{len(broken)} test(s) fail with the fix applied: {', '.join(broken[:5])}"
                         + (", ..." if len(broken) > 5 else ""))
    passed = [node for node, outcome in after.items() if outcome == "PASSED"]
    fail_to_pass = [node for node in passed if before.get(node) != "PASSED"]
    if not fail_to_pass:
        raise ValueError(f"none of its {len(passed)} test(s) fails without the fix: nothing for FAIL_TO_PASS")
    return fail_to_pass, [node for node in passed if before.get(node) == "PASSED"]


def instance_row(task: SweTask, created_at: str, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]
                 ) -> dict[str, str]:
    """The SWE-bench row of `task` with its tests (lists as JSON text, as SWE-bench stores them)."""
    return {
        "instance_id": task.name, "repo": task.repo, "base_commit": task.base_commit, "patch": task.patch,
        "test_patch": task.test_patch, "problem_statement": task.problem_statement,
        "FAIL_TO_PASS": json.dumps(list(fail_to_pass)), "PASS_TO_PASS": json.dumps(list(pass_to_pass)),
        "created_at": created_at,
    }


@dataclass(frozen=True)
class RowMaker:
    """Rows of the fixing commits of the git repository `repo`, tested and graded on `backend` (the local sandbox);
    the rows name the repository by its folder's name, so a recipe's `env.swe.repos_dir` is its parent.
    Snapshots of base commits go to `store` (a private folder the caller removes)."""

    repo: Path
    backend: SandboxBackend
    store: Path

    def make(self, fix: FixCommit) -> dict[str, str]:
        """`fix`'s row (the commit message its problem statement), tested and validated; ValueError saying why
        there is none."""
        task = SweTask(
            name=f"{self.repo.name}-{fix.commit[:12]}", repo=self.repo.name, repo_path=self.repo, base_commit=fix.base,
            problem_statement=fix.message, patch=fix.patch, test_patch=fix.test_patch, fail_to_pass=(),
            pass_to_pass=(), image="", backend="local", store=self.store,
        )
        modules = modules_to_run(task)
        after = run_tests(task, self.backend, fix.patch, modules)
        before = run_tests(task, self.backend, "", modules)
        row = instance_row(task, fix.created_at, *fail_and_pass(before, after))
        self.validate(row)
        return row

    def validate(self, row: dict[str, str]) -> None:
        """`row` read as a recipe reads it and graded as training grades it: ValueError unless its gold patch earns 1
        and no patch 0."""
        with tempfile.TemporaryDirectory(prefix="swe-row-") as tmp:
            path = Path(tmp) / "row.jsonl"
            path.write_text(json.dumps(row) + "\n")
            config = SweConfig(instances=str(path), repos_dir=str(self.repo.parent), runtime="local")
            (task,) = load_instances(config, self.store)
        gold, empty = task.grade_patch(self.backend, task.patch), task.grade_patch(self.backend, "")
        if (gold.reward, empty.reward) != (1.0, 0.0):
            raise ValueError(f"validation failed: the gold patch earns {gold.reward:g} ({gold.reason}), "
                             f"no patch {empty.reward:g} ({empty.reason})")
