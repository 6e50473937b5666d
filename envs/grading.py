"""Grade an agent's repository workspace: rebuild it from pristine, run the suite, pay only clean passes.

Grading never runs in the agent's workspace, and never runs the agent's code
in the judge's interpreter. The judge's sandbox gets the pristine repository
(tests, conftest files, test configuration, hidden tests) minus the task's
target modules, which forward every call to the agent's sources in a second
sandbox (`run_split`). The changes themselves are checked first
(`envs.safeguards`, `shadowing`). Reward 1 needs: no violation, a complete
report, and every expected test passed. A grade never raises: a failure of the
grader's own machinery is a grade of 0 marked `infra` (no verdict about the
submission: the grade cache never keeps it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pkgutil
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from composer_mesh.envs.grade_cache import content_key
from composer_mesh.envs.safeguards import (
    change_violations, diff_tree, is_bytecode, is_test_side, manifest, scan_source,
)
from composer_mesh.envs.sandbox import Sandbox, SandboxResult, SandboxUnavailable, Workspace
from composer_mesh.envs.tree import TreeTooDeep, walk

_log = logging.getLogger(__name__)
_RUNNER = Path(__file__).resolve().with_name("_grade_runner.py")
_CALLEE = Path(__file__).resolve().with_name("_callee.py")
_WIRE = Path(__file__).resolve().with_name("_wire.py")
PYTEST_ARGS = ("-q", "-p", "no:cacheprovider", "--no-header", "--tb=short", "-o", "addopts=")
_REPORT_BYTES = 1 << 20
_MODULE_SUFFIXES = (".py", ".so", ".pyd")
# Reasons that are no verdict about the submission: the grader's own machinery failed. `grader_error`: an error of
# the judge's side (an argument that cannot cross, a bound of the wire) or an exception of grading on the host;
# `sandbox_unavailable`: no sandbox to judge in; `worker_lost`: a pool worker died, stopped or could not set a job
# up (`envs.pool`); `callee_lost`: the callee's sandbox failed on the host; `runner_exited_early`: the judge, which
# runs no submission code, ended without its summary and without a named violation.
INFRA_REASONS = frozenset({"grader_error", "sandbox_unavailable", "worker_lost", "callee_lost", "runner_exited_early"})


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
        return self.result.stdout

    def failed(self) -> list[str]:
        return sorted(t for t, outcome in self.tests.items() if outcome != "passed")


def run_suite(
    sandbox: Sandbox,
    ws: Workspace,
    submission: Sequence[str] = (),
    pytest_args: Sequence[str] = PYTEST_ARGS,
    callee: dict | None = None,
    plain: Sequence[str] | None = None,
) -> SuiteRun:
    """Run the suite in `ws`; `submission` lists the agent-written files the audit hook watches.

    plain: run only these test files, without pytest (the runner's `run_plain`; split judge only).

    The runner reports on a file of the host's scratch dir (not stdout, which the
    program shares with everything it starts). The host reads at most
    `_REPORT_BYTES`; more, a line that does not parse, or a line of the wrong
    shape is a violation, never an exception.
    """
    nonce = secrets.token_hex(16)
    callee_fds = (callee["in_fd"], callee["out_fd"]) if callee else ()
    channel_path = ws.scratch / "report"
    channel = os.open(channel_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    request = {
        "nonce": nonce, "repo": str(ws.path), "submission": list(submission), "pytest_args": list(pytest_args),
        "channel_fd": channel, "callee": callee, "plain": None if plain is None else list(plain),
    }
    argv = [sandbox.python(), "-E", "-s", "-P", "-B", str(_RUNNER)]
    try:
        result = sandbox.run(
            argv, ws, stdin=json.dumps(request).encode(), env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
            expose=(str(_RUNNER), str(_WIRE)), pass_fds=(channel, *callee_fds), hand_over=callee_fds,
        )
    finally:
        os.close(channel)
    tests, events, violations = {}, read_channel(channel_path, nonce), [(v, "", "sandbox") for v in result.violations]
    complete, collect_errors = False, ()
    for event in events:
        if "malformed" in event:
            violations.append(("malformed_report", "", event["malformed"]))
        elif "violation" in event:
            violations.append((event["violation"], event["where"], event["detail"]))
        elif complete:  # only the runner's own last act writes a summary; a second one is forged
            violations.append(("forged_report", "", "two summaries"))
        else:
            complete, tests, collect_errors = True, event["tests"], tuple(event["collect_errors"])
    return SuiteRun(tests, complete, tuple(dict.fromkeys(violations)), collect_errors, result)


def read_channel(path: Path, nonce: str) -> list[dict]:
    """The runner's events, validated; anything else becomes a {"malformed": why} event (never raises)."""
    with open(path, "rb") as f:
        data = f.read(_REPORT_BYTES + 1)
    if len(data) > _REPORT_BYTES:
        return [{"malformed": f"report channel over {_REPORT_BYTES} bytes"}]
    events: list[dict] = []
    prefix = f"@@grade {nonce} "
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line:
            continue
        if not line.startswith(prefix):
            events.append({"malformed": f"line {n}: not an authenticated event"})
            continue
        try:
            event = json.loads(line[len(prefix):])
        except ValueError:
            event = None
        events.append(event if _well_formed(event) else {"malformed": f"line {n}: not a valid event"})
    return events


def _well_formed(event: object) -> bool:
    """The exact shapes the runner writes: a violation of three strings, or the final summary."""
    if not isinstance(event, dict):
        return False
    if set(event) == {"violation", "detail", "where"}:
        return all(type(v) is str for v in event.values())
    if set(event) == {"done", "exit", "tests", "collect_errors"}:
        tests, errors = event["tests"], event["collect_errors"]
        return (
            event["done"] is True and type(event["exit"]) is int and type(tests) is dict
            and all(type(k) is str and v in ("passed", "failed", "skipped") for k, v in tests.items())
            and type(errors) is list and all(type(e) is str for e in errors)
        )
    return False


def run_split(
    sandbox: Sandbox, judge_ws: Workspace, callee_ws: Workspace, modules: Sequence[str], plain: Sequence[str] | None = None
) -> SuiteRun:
    """Run the pristine suite in `judge_ws` with `modules` forwarded to the submission in `callee_ws`.

    Two sandboxes joined only by two pipes: the judge (pytest, tests, expected
    values, the report channel) never runs submission code; the callee imports
    the submission and answers calls with plain data (`_wire.py`).
    """
    to_callee_r, to_callee_w = os.pipe()
    to_judge_r, to_judge_w = os.pipe()
    timeout = sandbox.config.wall_timeout_s
    outcome: list[SandboxResult | Exception] = []
    argv = [sandbox.python(), "-E", "-s", "-P", "-B", str(_CALLEE), str(to_callee_r), str(to_judge_w), str(callee_ws.path)]

    def callee() -> None:
        try:
            outcome.append(sandbox.run(
                argv, callee_ws, timeout_s=timeout + 2, expose=(str(_CALLEE), str(_WIRE)),
                pass_fds=(to_callee_r, to_judge_w), hand_over=(to_callee_r, to_judge_w),
            ))
        except Exception as exc:  # the host failed to run it: no verdict (`callee_lost`)
            outcome.append(exc)

    thread = threading.Thread(target=callee)
    thread.start()
    request = {"modules": list(modules), "in_fd": to_judge_r, "out_fd": to_callee_w, "wire": str(_WIRE),
               "timeout_s": timeout}
    try:
        run = run_suite(sandbox, judge_ws, (), callee=request, plain=plain)
    finally:
        # the judge's end of the pipes is closed either way: the callee sees end-of-stream and ends
        thread.join()
    (result,) = outcome
    if isinstance(result, Exception):
        callee_violations = (("callee_lost", "callee", f"{type(result).__name__}: {result}"[:300]),)
    else:
        callee_violations = tuple((v, "callee", "sandbox") for v in result.violations)
    # The callee's limits first: they are why the judge saw no (valid) answers.
    return SuiteRun(run.tests, run.complete, callee_violations + run.violations, run.collect_errors, run.result)


def module_name(rel: str) -> str | None:
    """Dotted module name of a source file the judge can forward ('pkg/mod.py' -> 'pkg.mod'), else None."""
    parts = rel[:-3].split("/") if rel.endswith(".py") else None
    if not parts or parts[-1] == "__init__" or not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


@dataclass(frozen=True)
class Grade:
    """reward in {0, 1}; reason: "passed" or the first reason it is 0; violations: all (reason, detail).

    grade_s: wall seconds the whole grade took (what the answer cost to judge).
    """

    reward: float
    reason: str
    passed: int
    total: int
    violations: tuple[tuple[str, str], ...] = ()
    output: str = field(default="", repr=False)
    grade_s: float = 0.0

    @property
    def infra(self) -> bool:
        """No verdict about the submission: the grader's own machinery failed (`INFRA_REASONS`). Still reward 0; a
        grade cache never keeps it, so the same submission is judged again. A submission can cause one (it may
        kill its own pool worker), never turn one into a reward."""
        return self.reason in INFRA_REASONS or any(reason in INFRA_REASONS for reason, _ in self.violations)


def grade_workspace(
    sandbox: Sandbox,
    pristine: Path,
    start: dict[str, str],
    agent_ws: Workspace,
    expected_tests: Sequence[str],
    *,
    targets: Mapping[str, str],
    episode_violations: Sequence[tuple[str, str]] = (),
    plain: bool = False,
) -> Grade:
    """Grade `agent_ws` against the pristine repo; `start` is the manifest the agent began from.

    The judge runs the pristine tree (tests, test configuration, every module
    but the task's targets) with each target file replaced by its stub
    (`targets`: relative path -> the source the agent started from), and
    forwards the targets' functions, and only them, to the agent's sources in
    their own sandbox (`run_split`). A new file whose module
    name the test runner, its plugins, the standard library or site-packages
    provide is `shadows_module`. A grade slower than `slow_answer_s` is
    `slow_answer`. `plain`: the judge runs only the expected tests' files, without
    pytest (generated tests that are plain functions: `envs.micro`). A sandbox with a grade cache
    (`[env.sandbox] grade_cache`) judges a key once: the key hashes everything the grade reads (the
    pristine tree, the agent's files and directories, the start manifest, the expected tests, the
    stubs, the episode's violations, `plain` and the sandbox's limits), and a hit's `grade_s` is the
    lookup's own time.

    Never raises: a workspace tree deeper than `envs.tree.MAX_DEPTH` (or with a path over its bound) is the
    violation `deep_tree`; `SandboxUnavailable` is `sandbox_unavailable`, any other exception `grader_error`;
    those two and the other `INFRA_REASONS` make a grade `infra`, which the cache never keeps.
    """
    began = time.perf_counter()
    try:
        return _grade_by_content(sandbox, pristine, start, agent_ws, expected_tests, targets, episode_violations,
                                 plain, began)
    except TreeTooDeep as exc:
        return _failed("deep_tree", str(exc), len(expected_tests), began)
    except SandboxUnavailable as exc:
        return _failed("sandbox_unavailable", str(exc), len(expected_tests), began)
    except Exception as exc:
        _log.exception("grading failed on the host (reward 0, judged again next time)")
        return _failed("grader_error", f"{type(exc).__name__}: {exc}", len(expected_tests), began)


def _grade_by_content(
    sandbox: Sandbox, pristine: Path, start: dict[str, str], agent_ws: Workspace, expected_tests: Sequence[str],
    targets: Mapping[str, str], episode_violations: Sequence[tuple[str, str]], plain: bool, began: float,
) -> Grade:
    """`grade_workspace` through the sandbox's grade cache when it has one (an infra grade is never kept)."""
    # first: a tree too deep to walk is refused before anything else reads it
    directories = _directories(agent_ws.path)
    agent = manifest(agent_ws.path)
    original = _pristine_manifest(pristine)

    def judge() -> Grade:
        return _judge_workspace(sandbox, pristine, original, start, agent_ws, agent, expected_tests, targets,
                                episode_violations, plain, began)

    grades = getattr(sandbox, "grades", None)
    if grades is None:
        return judge()
    key = content_key(original, agent, directories, start, list(expected_tests), dict(targets),
                      [list(v) for v in episode_violations], plain, sandbox.config)
    grade, cached = grades.get_or_make(key, judge, keep=lambda g: not g.infra)
    return dataclasses.replace(grade, grade_s=round(time.perf_counter() - began, 6)) if cached else grade


def _failed(reason: str, detail: str, total: int, began: float) -> Grade:
    """A grade of 0 for a failure before or outside the judge's verdict."""
    return Grade(0.0, reason, 0, total, ((reason, detail[:500]),), "", round(time.perf_counter() - began, 6))


def _directories(root: Path) -> list[str]:
    """Every directory under `root` (symlinked ones left out, as copies leave them out): empty ones too.
    TreeTooDeep past `envs.tree`'s bounds."""
    out = []
    for dirpath, dirs, _ in walk(root):
        out += sorted(os.path.relpath(os.path.join(dirpath, d), root) for d in dirs)
    return out


def _judge_workspace(
    sandbox: Sandbox, pristine: Path, original: dict[str, str], start: dict[str, str], agent_ws: Workspace,
    agent: dict[str, str], expected_tests: Sequence[str], targets: Mapping[str, str],
    episode_violations: Sequence[tuple[str, str]], plain: bool, began: float,
) -> Grade:
    """`grade_workspace`'s judging, given the agent's and the pristine tree's manifests."""
    violations = list(episode_violations) + change_violations(diff_tree(start, agent))
    sources = [rel for rel in agent if _is_source(rel)]
    changed = [rel for rel in sources if original.get(rel) != agent[rel]]
    violations += [("shadows_module", rel) for rel in shadowing(sources, original)]
    for rel in changed:
        if rel.endswith(".py"):
            new_text = (agent_ws.path / rel).read_text(errors="replace")
            old_text = (pristine / rel).read_text(errors="replace") if rel in original else None
            violations += [(reason, f"{rel}: {what}") for reason, what in scan_source(new_text, old_text)]
    files = sorted({t.split("::", 1)[0] for t in expected_tests}) if plain else None
    run = _grade_split(sandbox, pristine, agent_ws, targets, files)
    violations += [(reason, f"{where}: {detail}" if where else detail) for reason, where, detail in run.violations]
    grade_s = time.perf_counter() - began
    cap = sandbox.config.slow_answer_s
    if cap and grade_s > cap:
        violations.append(("slow_answer", f"grading took {grade_s:.1f} s (cap {cap:g} s)"))
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
    return Grade(reward, reason, passed, total, tuple(dict.fromkeys(violations)), run.output, round(grade_s, 6))


@functools.lru_cache(maxsize=256)
def _pristine_manifest(pristine: Path) -> dict[str, str]:
    """A task store snapshot never changes: hash it once per process."""
    return manifest(pristine)


def _grade_split(
    sandbox: Sandbox, pristine: Path, agent_ws: Workspace, targets: Mapping[str, str], plain: Sequence[str] | None
) -> SuiteRun:
    """The judge gets the pristine tree with the targets stubbed; the callee gets the agent's sources."""
    modules = {rel: module_name(rel) for rel in targets}
    if not all(modules.values()):
        raise ValueError(f"targets {list(targets)} are not all modules the judge can forward")
    with (
        sandbox.scratch_workspace(copy_from=pristine, skip=is_bytecode) as judge_ws,
        sandbox.scratch_workspace(copy_from=agent_ws.path, skip=lambda rel: not _is_source(rel)) as callee_ws,
    ):
        for rel, base in targets.items():
            (judge_ws.path / rel).write_text(base)
        _seal(judge_ws)
        return run_split(sandbox, judge_ws, callee_ws, sorted(modules.values()), plain)


def shadowing(sources: Sequence[str], original: dict[str, str]) -> list[str]:
    """New source files whose top-level module name something the sandboxed interpreter imports already owns."""

    def top(rel: str) -> str:
        head, sep, _ = rel.partition("/")
        return head if sep else head.split(".")[0]

    # the repository's own packages and modules (not `pytest.ini` and the like)
    own = {top(rel) for rel in original if rel.endswith(_MODULE_SUFFIXES)}
    return sorted(
        rel for rel in sources
        if rel not in original and ("/" in rel or rel.endswith(_MODULE_SUFFIXES))
        and top(rel) not in own and top(rel) in provided_modules()
    )


@functools.cache
def provided_modules() -> frozenset[str]:
    """Top-level module names of the standard library, the interpreter's site-packages (pytest and its
    plugins among them) and the grader's own scripts: what a file in the repository must not shadow."""
    prefixes = {p for q in (sys.prefix, sys.base_prefix) for p in (q, os.path.realpath(q))}
    paths = [p for p in sys.path if p and os.path.isdir(p) and any(p.startswith(q + "/") for q in prefixes)]
    names = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | {m.name for m in pkgutil.iter_modules(paths)}
    return frozenset(names | {p.stem for p in (_RUNNER, _CALLEE, _WIRE)} | {"_composer_wire"})


def _seal(ws: Workspace) -> None:
    """Make the whole tree root's and read-only to the sandbox uid (its writable space is then /tmp)."""
    for dirpath, _, files in walk(ws.path):
        os.lchown(dirpath, 0, 0)
        os.chmod(dirpath, 0o755)
        for name in files:
            path = os.path.join(dirpath, name)
            os.lchown(path, 0, 0)
            if not os.path.islink(path):
                os.chmod(path, 0o644)


def _is_source(rel: str) -> bool:
    """Files grading takes from the agent's workspace."""
    return not (is_test_side(rel) or is_bytecode(rel))
