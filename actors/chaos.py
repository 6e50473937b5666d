"""Fault injection for drills: an actor SIGKILLs its own process as it enters a named phase.

`COMPOSER_MESH_KILL_AT="role:phase[,role:phase...]"` in the controller's environment (actor processes
inherit it) makes the first process of `role` that reaches `phase` kill itself with SIGKILL, the signal the
kernel's OOM killer sends. Each entry fires once per run: the process creates
`$COMPOSER_MESH_KILL_MARKS/<role>-<phase>` before dying, so its replacement gets past the phase. Unset (the
default), `kill_point` is a dictionary lookup. Phases: trainer `setup`, `first_sync`, `step`; generator
`setup`, `first_load`, `generate`.

`COMPOSER_MESH_FAIL_AT` names phases the same way where a failure is an exception, not a death: `fail_point`
raises `InjectedFault` there, once per run (same marks). Phases: trainer `delta_encode` (the background delta
encoding, `actors.weight_sync.encoder`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "COMPOSER_MESH_KILL_AT"
FAIL_ENV = "COMPOSER_MESH_FAIL_AT"
MARKS_ENV = "COMPOSER_MESH_KILL_MARKS"


class InjectedFault(RuntimeError):
    """The failure `fail_point` raises."""


def _fires(env: str, role: str, phase: str) -> bool:
    """`role:phase` is named in `env` and has not fired yet (it is marked fired now)."""
    wanted = os.environ.get(env)
    if not wanted or f"{role}:{phase}" not in {w.strip() for w in wanted.split(",")}:
        return False
    marks = Path(os.environ.get(MARKS_ENV) or "/tmp/composer-mesh-kill-marks")
    marks.mkdir(parents=True, exist_ok=True)
    try:
        (marks / f"{role}-{phase}").touch(exist_ok=False)
    except FileExistsError:
        return False  # fired already: this is the replacement
    return True


def kill_point(role: str, phase: str) -> None:
    """SIGKILL this process when `role:phase` is named in COMPOSER_MESH_KILL_AT and has not fired yet."""
    if _fires(ENV, role, phase):
        os.kill(os.getpid(), signal.SIGKILL)


def fail_point(role: str, phase: str) -> None:
    """Raise `InjectedFault` when `role:phase` is named in COMPOSER_MESH_FAIL_AT and has not fired yet."""
    if _fires(FAIL_ENV, role, phase):
        raise InjectedFault(f"injected fault at {role}:{phase} ({FAIL_ENV})")
