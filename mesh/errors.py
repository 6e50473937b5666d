"""One line for a failed run: which actor, what failed and where, without the remote traceback.

A failure inside an actor reaches the controller as a Monarch `ActorError`
(possibly wrapping another) whose cause was stringified with its traceback;
`describe` names the role from the innermost project frame of that traceback
and keeps the cause's first line (the key/file our errors name).
"""

from __future__ import annotations

import re
from pathlib import Path

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_ROLES = {"generator": "generator", "episodes": "generator", "hf_engine": "generator", "vllm_engine": "generator",
          "trainer": "trainer", "teacher_replay": "teacher_replay", "diloco": "trainer"}
_REPO = Path(__file__).resolve().parents[1]


def describe(error: BaseException) -> str:
    """`<role> actor: <Type>: <first line> (at <file>:<line>)` for actor failures, else `<Type>: <first line>`."""
    remote = False
    frames_text = ""
    while hasattr(error, "exception") and isinstance(getattr(error, "exception"), BaseException):
        remote = True
        frames_text = getattr(error, "exception_formatted", "") or frames_text
        error = error.exception  # type: ignore[attr-defined]
    lines = str(error).strip().splitlines()
    head = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if not remote:
        return head
    role, where = "an", ""
    for path, line, _ in _FRAME.findall(frames_text):
        file = Path(path)
        if _REPO in file.parents:
            where = f" (at {file.relative_to(_REPO)}:{line})"
            role = _ROLES.get(file.stem, role)
    return f"{role} actor: {head}{where}" if role != "an" else f"an actor: {head}{where}"
