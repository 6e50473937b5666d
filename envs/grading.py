"""Grade an agent's repository workspace: rebuild it from pristine, run the suite, pay only clean passes.

Grading never runs in the agent's workspace. A fresh sandbox workspace gets
the agent's source files and the pristine tests, conftest files and test
configuration (hidden tests included); bytecode is left out.
The changes themselves are checked first (`envs.safeguards`); the suite runs
under `_grade_runner.py`, whose audit hook and integrity checks report
tampering at run time. Reward 1 needs: no violation, a complete report, and
every expected test passed.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from envs.safeguards import (
    change_violations, diff_tree, is_bytecode, is_test_config, is_test_path, manifest, scan_source,
)
from envs.sandbox import Sandbox, SandboxResult, Workspace

_RUNNER = Path(__file__).with_name("_grade_runner.py")
PYTEST_ARGS = ("-q", "-p", "no:cacheprovider", "--no-header", "--tb=short", "-o", "addopts=")
_REPORT_CHARS = 1 << 20


@dataclass(frozen=True)
class SuiteRun:
    """One pytest run under the grade runner.

    tests: node id -> "passed" | "failed" | "skipped"; complete: the runner's
    final summary arrived (nonce-checked); violations: (reason, file, detail)
    seen at run time, `file` the submission file responsible ("" when none is).
    """

    tests: dict[str, str]
    complete: bool
    violations: tuple[tuple[str, str, str], ...]
    collect_errors: tuple[str, ...]
    result: SandboxResult

    @property
    def output(self) -> str:
        """pytest's own output (the runner's report lines removed)."""
        return "\n".join(line for line in self.result.stdout.splitlines() if not line.startswith("@@grade "))

    def failed(self) -> list[str]:
        return sorted(t for t, outcome in self.tests.items() if outcome != "passed")


def run_suite(
    sandbox: Sandbox, ws: Workspace, submission: Sequence[str] = (), pytest_args: Sequence[str] = PYTEST_ARGS
) -> SuiteRun:
    """Run the suite in `ws`; `submission` lists the agent-written files the audit hook watches."""
    nonce = secrets.token_hex(16)
    request = {"nonce": nonce, "repo": str(ws.path), "submission": list(submission), "pytest_args": list(pytest_args)}
    argv = [sandbox.python(), "-E", "-s", "-P", "-B", str(_RUNNER)]
    result = sandbox.run(
        argv, ws, stdin=json.dumps(request).encode(), env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        tail_chars=_REPORT_CHARS,
    )
    tests: dict[str, str] = {}
    violations: list[tuple[str, str, str]] = [(v, "", "sandbox") for v in result.violations]
    complete, collect_errors = False, ()
    prefix = f"@@grade {nonce} "
    for line in result.stdout.splitlines():
        if not line.startswith(prefix):
            continue
        event = json.loads(line[len(prefix):])
        if "violation" in event:
            violations.append((event["violation"], event["where"], event["detail"]))
        elif event.get("done"):
            if complete:  # only the runner's own last act writes this; a second one is forged
                violations.append(("forged_report", "", "two summaries"))
                continue
            complete, tests, collect_errors = True, event["tests"], tuple(event["collect_errors"])
    return SuiteRun(tests, complete, tuple(dict.fromkeys(violations)), collect_errors, result)


@dataclass(frozen=True)
class Grade:
    """reward in {0, 1}; reason: "passed" or the first reason it is 0; violations: all (reason, detail)."""

    reward: float
    reason: str
    passed: int
    total: int
    violations: tuple[tuple[str, str], ...] = ()
    output: str = field(default="", repr=False)


def grade_workspace(
    sandbox: Sandbox,
    pristine: Path,
    start: dict[str, str],
    agent_ws: Workspace,
    expected_tests: Sequence[str],
    episode_violations: Sequence[tuple[str, str]] = (),
    runtime_allowed: Sequence[tuple[str, str]] = (),
) -> Grade:
    """Grade `agent_ws` against the pristine repo; `start` is the manifest the agent began from.

    The grading tree is the agent's source files (everything but tests, test
    configuration and bytecode) plus the pristine tests and test configuration.
    runtime_allowed: (file, reason) pairs the pristine suite itself showed at
    run time (`baseline_runtime`), not held against the agent.
    """
    agent = manifest(agent_ws.path)
    violations = list(episode_violations) + change_violations(diff_tree(start, agent))
    original = manifest(pristine)
    sources = [rel for rel in agent if _is_source(rel)]
    changed = [rel for rel in sources if original.get(rel) != agent[rel]]
    for rel in changed:
        if rel.endswith(".py"):
            new_text = (agent_ws.path / rel).read_text(errors="replace")
            old_text = (pristine / rel).read_text(errors="replace") if rel in original else None
            violations += [(reason, f"{rel}: {what}") for reason, what in scan_source(new_text, old_text)]
    with sandbox.workspace(copy_from=pristine, skip=lambda rel: not _is_test_side(rel)) as gws:
        for rel in sources:
            (gws.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (gws.path / rel).write_bytes((agent_ws.path / rel).read_bytes())
        gws.adopt()
        run = run_suite(sandbox, gws, changed)
    allowed = set(runtime_allowed)
    violations += [
        (reason, f"{where}: {detail}" if where else detail)
        for reason, where, detail in run.violations if (where, reason) not in allowed
    ]
    passed = sum(run.tests.get(t) == "passed" for t in expected_tests)
    total = len(expected_tests)
    if violations:
        reason = violations[0][0]
    elif not run.complete:
        reason = "runner_exited_early"
    elif passed < total:
        reason = f"tests_failed ({passed}/{total} passed)"
    else:
        reason = "passed"
    reward = 1.0 if reason == "passed" else 0.0
    return Grade(reward, reason, passed, total, tuple(dict.fromkeys(violations)), run.output)


def _is_test_side(rel: str) -> bool:
    """Files grading always takes from the pristine repository."""
    return (is_test_path(rel) or is_test_config(rel)) and not is_bytecode(rel)


def _is_source(rel: str) -> bool:
    """Files grading takes from the agent's workspace."""
    return not (is_test_path(rel) or is_test_config(rel) or is_bytecode(rel))


def baseline_runtime(run: SuiteRun) -> tuple[tuple[str, str], ...]:
    """(file, reason) pairs a pristine run showed with every source file watched."""
    return tuple(sorted({(where, reason) for reason, where, _ in run.violations if where}))


def source_files(root: Path) -> list[str]:
    """Relative paths of the Python source files grading takes from the agent."""
    return sorted(rel for rel in manifest(root) if rel.endswith(".py") and _is_source(rel))
