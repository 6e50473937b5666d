"""The sandbox backend interface: where an episode's programs run.

A backend makes one private workspace per episode, runs commands in it and
names the interpreter those commands use. The tool loop and the graders talk
only to this interface, so a task can run in the local bubblewrap sandbox
(`envs.sandbox.Sandbox`, pooled by `envs.pool`) or in a container built from
the task's own image (`envs.container`), as SWE-style instances need.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

from composer_mesh.envs.sandbox import SandboxResult, Workspace


@runtime_checkable
class SandboxBackend(Protocol):
    """Workspaces and contained commands; `run` never raises for what the program does."""

    def workspace(
        self, copy_from: str | os.PathLike | None = None, skip: Callable[[str], bool] | None = None
    ) -> Workspace:
        """A fresh private workspace, optionally a copy of a tree (`skip(rel)` leaves a path out)."""
        ...

    def run(
        self,
        argv: Sequence[str],
        ws: Workspace,
        *,
        stdin: bytes = b"",
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        tail_chars: int | None = None,
    ) -> SandboxResult:
        """Run `argv` with `ws` as working directory under the backend's containment."""
        ...

    def python(self) -> str:
        """The interpreter path commands should use inside this backend."""
        ...
