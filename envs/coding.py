"""The coding-task protocol and task sources: what the tool loop grades, and how a seed picks a task.

A coding task (feature-deletion `RepoTask`, generated `MicroTask`, SWE
`SweTask`) makes the agent's workspace on a sandbox backend, says what to do,
and grades the final workspace. A *source* maps a seed to a task: a fixed
list (verified repository tasks) or a generator (micro tasks); `UnionPool`
interleaves sources so `[env.coding] sources` can mix them.
"""

from __future__ import annotations

import difflib
import re
from typing import Protocol, Sequence, runtime_checkable

from composer_mesh.envs.backend import SandboxBackend
from composer_mesh.envs.grading import Grade
from composer_mesh.envs.sandbox import Workspace


@runtime_checkable
class CodingTask(Protocol):
    """name: unique; template: the held-out split key; backend: "local" or "container"."""

    name: str
    template: str
    backend: str

    def prompt(self, tools: bool = True) -> str: ...

    def workspace(self, backend: SandboxBackend) -> Workspace: ...

    def grade(
        self, backend: SandboxBackend, ws: Workspace, start_manifest: dict[str, str],
        violations: Sequence[tuple[str, str]] = (),
    ) -> Grade: ...

    def reference_files(self) -> dict[str, str]: ...


class TaskPool(Protocol):
    """A task source of one split: `pick(seed)` is deterministic."""

    def pick(self, seed: int) -> CodingTask: ...


class ListPool:
    """A fixed list of tasks, cycled by seed."""

    def __init__(self, tasks: Sequence[CodingTask]) -> None:
        if not tasks:
            raise ValueError("a task list needs at least one task")
        self.tasks = list(tasks)

    def pick(self, seed: int) -> CodingTask:
        return self.tasks[seed % len(self.tasks)]


class UnionPool:
    """Several sources interleaved: seed s draws from source s % n with seed s // n."""

    def __init__(self, pools: Sequence[TaskPool]) -> None:
        if not pools:
            raise ValueError("a union of task sources needs at least one source")
        self.pools = list(pools)

    def pick(self, seed: int) -> CodingTask:
        n = len(self.pools)
        return self.pools[seed % n].pick(seed // n)


# cap on a rendered reference: it rides with every failed rollout to the controller
REFERENCE_CHARS = 16_000


def render_reference(files: dict[str, str], limit: int = REFERENCE_CHARS) -> str:
    """A task's reference files as text for the teacher's context: `--- path` then the full text, per file,
    in path order, cut at `limit` characters."""
    text = "\n".join(f"--- {path}\n{body.rstrip()}" for path, body in sorted(files.items()))
    return text[:limit]


def source_of(task: CodingTask) -> str:
    """The source a task came from ("micro", "repos", "swe"; "" when the task does not say)."""
    return str(getattr(task, "source", ""))


def reference_change(start: dict[str, str], reference: dict[str, str]) -> str:
    """The lines `reference` writes that `start` lacks (what a diff from start to reference adds or replaces with),
    with their indentation: a `--- path` line per changed file, in path order, then those lines (all of a file
    `start` does not have). What the hint channel's change notes show (`replay.hints.change_note`)."""
    out = []
    for path, text in sorted(reference.items()):
        new = text.splitlines()
        matcher = difflib.SequenceMatcher(None, start.get(path, "").splitlines(), new, autojunk=False)
        written = [line for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert")
                   for line in new[j1:j2]]
        if written:
            out += [f"--- {path}", *written]
    return "\n".join(out)


_FAILED = re.compile(r"^FAILED (\S+::\S+)", re.MULTILINE)
_ERROR = re.compile(r"^ERROR (\S+)", re.MULTILINE)


def failed_tests(grade: Grade, expected: Sequence[str]) -> list[str]:
    """The node ids of `expected` that `grade` failed, in order: those its output names FAILED, and every one of
    a file it names ERROR; all of them when it passed fewer than all and its output names none (no test ran).
    For the teacher's context only: the output is the test runner's, which the agent's code can write to."""
    named = set(_FAILED.findall(grade.output))
    broken = set(_ERROR.findall(grade.output))
    failed = [t for t in expected if t in named or t.split("::", 1)[0] in broken]
    if not failed and grade.passed < grade.total:
        return list(expected)
    return failed
