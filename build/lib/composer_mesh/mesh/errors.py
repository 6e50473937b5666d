"""One line for a failed run: which actor, what failed and where, without the remote traceback.

A failure inside an actor reaches the controller as a Monarch `ActorError`
(possibly wrapping another) whose cause was stringified with its traceback;
`describe` names the role from the innermost project frame of that traceback
and keeps the cause's first line (the key/file our errors name).

An actor whose process died (SIGKILL, the kernel's OOM killer, a crash)
reaches it as Monarch's `SupervisionError`; `describe` names the role, the
run's phase (`phase`, which the placement and the controller wrap their
calls in) and how the process ended (the signal or exit code Monarch saw).
"""

from __future__ import annotations

import contextlib
import re
import signal
from pathlib import Path
from typing import Iterator

from composer_mesh.actors.monarch_compat import SupervisionError
from composer_mesh.mesh.supervision import UNANSWERED, causes

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_ROLES = {"generator": "generator", "episodes": "generator", "hf_engine": "generator", "vllm_engine": "generator",
          "trainer": "trainer", "teacher_replay": "teacher_replay", "diloco": "trainer"}
_REPO = Path(__file__).resolve().parents[1]
_PHASE = "composer-mesh phase: "
_ACTOR_CLASS = re.compile(r"<actors\.\w+\.(\w+)Actor\b")
_CLASS_ROLES = {"Trainer": "trainer", "Generator": "generator", "TeacherReplay": "teacher_replay"}
_ENDPOINT = re.compile(r"Endpoint call ([\w.]+)\(\)")
_SIGNAL = re.compile(r"Killed\(sig=(\d+)\)")
_EXIT = re.compile(r"Exited\((-?\d+)\)")


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Name the run's phase (setup, first weight sync, generation, …) on an exception leaving the block; the
    innermost name wins. `describe` reports it when an actor died there."""
    try:
        yield
    except BaseException as exc:
        if not any(n.startswith(_PHASE) for n in getattr(exc, "__notes__", ())):
            exc.add_note(_PHASE + name)
        raise


def _how(text: str) -> str:
    if m := _SIGNAL.search(text):
        num = int(m.group(1))
        try:
            name = signal.Signals(num).name
        except ValueError:
            name = "an unknown signal"
        oom = "; the kernel's OOM killer sends it too" if num == signal.SIGKILL else ""
        return f"killed by signal {num} ({name}{oom})"
    if m := _EXIT.search(text):
        return f"its process exited with code {m.group(1)}"
    if UNANSWERED in text:
        return "its process stopped answering Monarch's supervision (taken as dead)"
    lines = [ln.strip() for ln in text.splitlines()[1:] if ln.strip()]
    return lines[0] if lines else "its process failed"


def describe_death(error: BaseException) -> str | None:
    """`<role> actor died during <phase> (<endpoint>): <how>` when `error` (or what it wraps) is Monarch's
    report of a dead actor process; None otherwise."""
    chain = list(causes(error))
    dead = next((e for e in chain if isinstance(e, SupervisionError)), None)
    if dead is None:
        return None
    text = str(dead)
    cls = _ACTOR_CLASS.search(text)
    endpoint = _ENDPOINT.search(text)
    role = _CLASS_ROLES.get(cls.group(1), cls.group(1)) if cls else (
        endpoint.group(1).split(".")[0] if endpoint else "an")
    phases = [n[len(_PHASE):] for e in chain for n in getattr(e, "__notes__", ()) if n.startswith(_PHASE)]
    where = f" during {phases[0]}" if phases else ""
    call = f" ({endpoint.group(1)})" if endpoint else ""
    return f"{role} actor died{where}{call}: {_how(text)}"


def describe(error: BaseException) -> str:
    """`<role> actor: <Type>: <first line> (at <file>:<line>)` for actor failures, `describe_death`'s line for a
    dead actor process, else `<Type>: <first line>`."""
    died = describe_death(error)
    if died is not None:
        return died
    remote = False
    frames_text = ""
    while hasattr(error, "exception") and isinstance(error.exception, BaseException):
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
