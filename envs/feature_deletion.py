"""Feature-deletion tasks: delete function bodies from a repository with a passing suite.

`generate_tasks(repo, config, sandbox)` snapshots any local Python repository
into a private task store, runs its suite (it must pass), then tries candidate
functions in a seeded order: each candidate's body is replaced by a stub and
the suite is run again; the test files that now fail become the task's hidden
tests (removed from the agent's workspace, restored at grading), and a
candidate that breaks no test is dropped. Every returned task is verified:
pristine passes, deleted fails, and its original code earns 1 through the
split judge with the target module forwarded (a task whose tests need more
across that boundary than plain data, callables, the repository's objects and
the target module's instances is refused with the reason).
"""

from __future__ import annotations

import ast
import logging
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import ClassVar, Sequence

from composer_mesh.configs.records import ErrorKind, ErrorSite
from composer_mesh.configs.sections.env import FeatureDeletionConfig
from composer_mesh.envs.base import Environment, Observation
from composer_mesh.envs.coding import render_reference
from composer_mesh.envs.grading import Grade, grade_workspace, module_name, provided_modules, run_suite
from composer_mesh.envs.safeguards import is_bytecode, is_test_path, manifest
from composer_mesh.envs.sandbox import Sandbox, Workspace, copy_tree

_STUB = 'raise NotImplementedError("deleted feature: rebuild {name}")'
_log = logging.getLogger(__name__)
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class RepoTask:
    """One verified task.

    pristine: the private snapshot of the repository (the sandbox uid cannot read it);
    target: file (relative) whose functions were deleted; symbols: their qualified names;
    stubbed_source: the target file as the agent first sees it; hidden_tests: test
    files kept out of the workspace; expected_tests: node ids that must pass.
    Every grade forwards `target`, and only it, to the agent's code (`envs.grading`).
    A coding task (`envs.coding.CodingTask`) whose held-out key is its name.
    """

    source: ClassVar[str] = "repos"
    backend: ClassVar[str] = "local"

    name: str
    pristine: Path
    target: str
    symbols: tuple[str, ...]
    stubbed_source: str
    hidden_tests: tuple[str, ...]
    expected_tests: tuple[str, ...]

    def prompt(self, tools: bool = True) -> str:
        """Terse instruction: with tools (the multi-turn loop) or with the file inline (single turn)."""
        names = ", ".join(f"`{s}`" for s in self.symbols)
        head = f"Repository `{self.pristine.name}`: the body of {names} in `{self.target}` was deleted. "
        if tools:
            return head + "Rebuild it so the hidden tests pass. Use the tools; answer without a tool call when done."
        return (
            head + f"Reply with the complete new `{self.target}` in one ```python block.\n\n"
            f"```python\n{self.stubbed_source}```"
        )

    @property
    def template(self) -> str:
        return self.name

    def original_source(self) -> str:
        return (self.pristine / self.target).read_text()

    def reference_files(self) -> dict[str, str]:
        return {self.target: self.original_source()}

    def grade(
        self, sandbox: Sandbox, ws: Workspace, start_manifest: dict[str, str], violations: Sequence[tuple[str, str]] = ()
    ) -> Grade:
        """Grade the agent's workspace `ws` (reward 1 only when every expected test passes cleanly)."""
        return grade_workspace(
            sandbox, self.pristine, start_manifest, ws, self.expected_tests,
            targets={self.target: self.stubbed_source}, episode_violations=violations,
        )

    def grade_source(self, sandbox: Sandbox, source: str) -> Grade:
        """Grade `source` as the new target file in an otherwise untouched starting workspace."""
        with self.workspace(sandbox) as ws:
            start = manifest(ws.path)
            (ws.path / self.target).write_text(source)
            return self.grade(sandbox, ws, start)

    def workspace(self, sandbox: Sandbox) -> Workspace:
        """The agent's starting workspace: pristine minus hidden tests and bytecode, target stubbed."""
        hidden = set(self.hidden_tests)
        ws = sandbox.workspace(copy_from=self.pristine, skip=lambda rel: rel in hidden or is_bytecode(rel))
        (ws.path / self.target).write_text(self.stubbed_source)
        ws.adopt()
        return ws


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) for module-level functions and methods of module-level classes."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            out += [(f"{node.name}.{f.name}", f) for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return out


def _has_docstring(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    first = fn.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def _body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    return fn.body[1:] if _has_docstring(fn) else fn.body


def _statements(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return sum(isinstance(n, ast.stmt) for stmt in _body(fn) for n in ast.walk(stmt))


def stub_functions(source: str, names: set[str]) -> str:
    """`source` with the bodies of the named functions replaced by a stub (docstrings kept)."""
    lines = source.splitlines(keepends=True)
    fns = [(q, fn) for q, fn in _functions(ast.parse(source)) if q in names]
    for qual, fn in sorted(fns, key=lambda item: -item[1].lineno):  # bottom-up keeps line numbers valid
        body = _body(fn)
        indent = " " * body[0].col_offset
        stub = f"{indent}{_STUB.format(name=qual)}\n"
        lines[body[0].lineno - 1 : body[-1].end_lineno] = [stub]
    return "".join(lines)


def _candidates(repo: Path, config: FeatureDeletionConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(file, function group) candidates in seeded order; groups hold related functions of one file."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for path in sorted(repo.rglob("*.py")):
        rel = str(path.relative_to(repo))
        if is_test_path(rel) or is_bytecode(rel) or any(part.startswith(".") for part in PurePosixPath(rel).parts):
            continue
        try:
            fns = _functions(ast.parse(path.read_text()))
        except SyntaxError:
            continue
        eligible = {
            q: fn for q, fn in fns
            if _statements(fn) >= config.min_body_statements and _body(fn) and _body(fn)[0].lineno > fn.lineno
        }
        for qual, fn in eligible.items():
            callees = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            group = [qual] + sorted(q for q in eligible if q != qual and q in callees)
            found.append((rel, tuple(group[: config.functions_per_task])))
    random.Random(config.seed).shuffle(found)
    want = config.functions_per_task
    return [c for c in found if len(c[1]) == want] + [c for c in found if len(c[1]) != want]


class TaskStore:
    """A root-only directory holding pristine snapshots; remove it with `cleanup()`."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="tasks-", dir=sandbox.root))
        os.chmod(self.root, 0o700)

    def snapshot(self, repo: Path) -> Path:
        """A private copy named like the repository (in its own directory: names may repeat)."""
        dst = Path(tempfile.mkdtemp(dir=self.root)) / repo.resolve().name
        copy_tree(repo, dst, skip=lambda rel: is_bytecode(rel) or rel.startswith(".git/"))
        return dst

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def generate_tasks(
    repo: str | os.PathLike,
    config: FeatureDeletionConfig,
    sandbox: Sandbox,
    store: TaskStore,
    refused: list[tuple[str, str]] | None = None,
) -> list[RepoTask]:
    """Verified tasks from the repository at `repo` (a ValueError if its suite does not pass).

    refused: gets (task name, reason) for each candidate whose deletion the suite
    notices but that cannot be graded (also logged).
    """
    pristine = store.snapshot(Path(repo))
    with sandbox.workspace(copy_from=pristine) as ws:
        baseline = run_suite(sandbox, ws)
    if not baseline.complete or not baseline.tests or baseline.failed() or baseline.collect_errors:
        raise ValueError(
            f"{repo}: the pristine test suite must pass; failed: {baseline.failed()[:5]} "
            f"collection errors: {list(baseline.collect_errors)[:5]}\n{baseline.output[-1500:]}"
        )
    expected = tuple(sorted(baseline.tests))
    tasks: list[RepoTask] = []
    for rel, group in _candidates(pristine, config):
        if len(tasks) >= config.max_tasks:
            break
        stubbed = stub_functions((pristine / rel).read_text(), set(group))
        with sandbox.workspace(copy_from=pristine) as ws:
            (ws.path / rel).write_text(stubbed)
            ws.adopt()
            run = run_suite(sandbox, ws)
        failing_files = sorted({t.split("::")[0] for t in run.failed()} | set(run.collect_errors))
        if not run.complete or not failing_files:
            continue  # the suite does not notice this deletion: not a gradable task
        name = f"{pristine.name}:{rel}:{'+'.join(group)}"
        task = RepoTask(name, pristine, rel, group, stubbed, tuple(failing_files), expected)
        reason = _ungradable(sandbox, task)
        if reason:
            _log.warning("refusing task %s: %s", name, reason)
            if refused is not None:
                refused.append((name, reason))
            continue
        tasks.append(task)
    return tasks


def _ungradable(sandbox: Sandbox, task: RepoTask) -> str:
    """'' when the task's original code earns 1 with its target forwarded to a callee, else why not."""
    name = module_name(task.target)
    if name is None:
        return f"{task.target} is not a module the judge can forward (a package's __init__ or not an identifier path)"
    if name.split(".")[0] in provided_modules():
        return f"{name} has the name of a module the judge's interpreter provides (stdlib or site-packages)"
    grade = task.grade_source(sandbox, task.original_source())
    if grade.reward == 1.0:
        return ""
    tail = grade.output.strip().splitlines()[-3:]
    return f"its original code earns 0 through the split judge ({grade.reason}): {' | '.join(tail)[:300]}"


class FeatureDeletionEnv(Environment):
    """Single-turn feature deletion: the reply carries the whole target file; it is graded as written.

    The multi-turn variant with tools over the same tasks is `envs.tool_loop.ToolLoopEnv`.
    """

    def __init__(self, tasks: list[RepoTask], sandbox: Sandbox) -> None:
        super().__init__()
        if not tasks:
            raise ValueError("FeatureDeletionEnv needs at least one task")
        self.tasks, self.sandbox = tasks, sandbox
        self.task: RepoTask | None = None

    def _start(self, seed: int | None) -> Observation:
        self.task = self.tasks[(seed if seed is not None else random.randrange(len(self.tasks))) % len(self.tasks)]
        return Observation([{"role": "user", "content": self.task.prompt(tools=False)}], info={"task": self.task.name})

    def _answer(self, action: dict, turn: int) -> Observation:
        assert self.task is not None
        blocks = _CODE_BLOCK.findall(str(action.get("content") or ""))
        # teacher-only: the original file (`reference` hints); the reply never sees it
        info: dict = {"task": self.task.name, "reference": render_reference(self.task.reference_files())}
        if not blocks:
            site = ErrorSite(turn, ErrorKind.SYNTAX, "no ```python block with the new file in the reply")
            return Observation([], reward=0.0, done=True, error_sites=[site], info=info | {"reason": "no_code"})
        grade = self.task.grade_source(self.sandbox, blocks[-1])
        info |= {
            "reason": grade.reason, "violations": list(grade.violations), "passed": grade.passed, "total": grade.total,
            "grade_s": grade.grade_s,
        }
        sites = []
        if grade.reward < 1.0:
            kind = (
                ErrorKind.TIMEOUT if grade.reason in ("timeout", "cpu_time_limit")
                else ErrorKind.TEST_FAILURE if grade.reason.startswith("tests_failed") else ErrorKind.OTHER
            )
            sites = [ErrorSite(turn, kind, f"{grade.reason}\n{grade.output[-400:]}".strip(),
                               feedback=f"{grade.reason}\n{grade.output[-4000:]}".strip())]
        return Observation([], reward=grade.reward, done=True, error_sites=sites, info=info)
