"""The coding-task protocol and task sources: what the tool loop grades, and how a seed picks a task.

A coding task (feature-deletion `RepoTask`, generated `MicroTask`, SWE
`SweTask`) makes the agent's workspace on a sandbox backend, says what to do,
and grades the final workspace. A *source* maps a seed to a task: a fixed
list (verified repository tasks) or a generator (micro tasks); `UnionPool`
interleaves sources so `[env.coding] sources` can mix them.
"""

from __future__ import annotations

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
