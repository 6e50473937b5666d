"""Fault injection for drills: an actor SIGKILLs its own process as it enters a named phase.

`COMPOSER_MESH_KILL_AT="role:phase[,role:phase...]"` in the controller's environment (actor processes
inherit it) makes the first process of `role` that reaches `phase` kill itself with SIGKILL, the signal the
kernel's OOM killer sends. Each entry fires once per run: the process creates
`$COMPOSER_MESH_KILL_MARKS/<role>-<phase>` before dying, so its replacement gets past the phase. Unset (the
default), `kill_point` is a dictionary lookup. Phases: trainer `setup`, `first_sync`, `step`; generator
`setup`, `first_load`, `generate`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "COMPOSER_MESH_KILL_AT"
MARKS_ENV = "COMPOSER_MESH_KILL_MARKS"


def kill_point(role: str, phase: str) -> None:
    """SIGKILL this process when `role:phase` is named in COMPOSER_MESH_KILL_AT and has not fired yet."""
    wanted = os.environ.get(ENV)
    if not wanted or f"{role}:{phase}" not in {w.strip() for w in wanted.split(",")}:
        return
    marks = Path(os.environ.get(MARKS_ENV) or "/tmp/composer-mesh-kill-marks")
    marks.mkdir(parents=True, exist_ok=True)
    try:
        (marks / f"{role}-{phase}").touch(exist_ok=False)
    except FileExistsError:
        return  # fired already: this is the replacement
    os.kill(os.getpid(), signal.SIGKILL)
