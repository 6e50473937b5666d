"""Supervision and recovery: notice dead actors, replace them, and checkpoint the controller's own state.

How Monarch reports a dead actor process to the controller (docs/supervision.md):
a pending or later endpoint call on the dead actor raises `SupervisionError`
(a `RuntimeError`) from `.get()` once the mesh controller's supervision poll
sees the process gone; the other ranks of the mesh keep serving through their
slices. The same failure also reaches the client's root actor as a `MeshFailure`,
whose default `monarch.actor.unhandled_fault_hook` exits the controller:
`install_fault_hook` replaces it with one that records the event, so the
controller decides at the call site what to restart.

A hung actor (alive, not answering: SIGSTOP, a wedged kernel) raises nothing;
the controller bounds each `generate` call by a `Deadline` derived from the
request and raises `ActorHung` past it, which counts as an actor failure: the
supervisor kills the hung process (`retire_generator`) before replacing it.

`Supervisor` holds the restart budget (`[mesh] max_restarts` per role) and the
functions that make replacements (`mesh.placement.Placement`).
`ControllerState` is what the controller needs to continue from a trainer
checkpoint: written atomically beside the checkpoints once per step, before
the step's `train_step`, under the policy version that step produces.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import monarch.actor

from composer_mesh.actors.monarch_compat import SupervisionError
from composer_mesh.actors.rollout import EpisodeRequest, RolloutGroup
from composer_mesh.configs.sections.checkpoint import CheckpointConfig
from composer_mesh.titan_ext.checkpoint import Checkpointer

ROLES = ("generator", "trainer", "replay")


class ActorHung(TimeoutError):
    """An actor's call outlived its deadline: taken as dead (its process is killed, then it is replaced)."""


@dataclass(frozen=True)
class Deadline:
    """How long a `generate` call of `tokens` sampled tokens may take before its generator counts as hung:
    max(floor_s, tokens × max(s_per_token, slack × the slowest seconds per token measured in this run)).

    The floor covers fixed costs (first-call warm-up, a weight load queued before the call); the per-token
    term lets long requests run (docs/supervision.md, "Hung generators")."""

    floor_s: float
    s_per_token: float
    slack: float = 4.0

    def seconds(self, tokens: int, measured_s_per_token: float) -> float:
        return max(self.floor_s, tokens * max(self.s_per_token, self.slack * measured_s_per_token))


# Monarch's report of a process that did not answer the supervision poll within `[mesh] state_query_s`.
# Dead or frozen: a frozen one still holds its memory, so it is killed before its replacement.
UNANSWERED = "timeout waiting for message from proc mesh agent"


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and what it wraps (`raise ... from`), outermost first."""
    while exc is not None:
        yield exc
        exc = exc.__cause__


def is_unanswered(exc: BaseException) -> bool:
    """True when `exc` (or what it wraps) is Monarch's report of a process that stopped answering."""
    return any(UNANSWERED in str(e) for e in causes(exc))


def is_actor_failure(exc: BaseException) -> bool:
    """True when `exc` (or what it wraps) says an actor or its process died or hung, not that its code raised."""
    return any(isinstance(e, (SupervisionError, ActorHung)) for e in causes(exc))


def install_fault_hook(events: list[str]) -> None:
    """Record unhandled mesh failures in `events` instead of exiting the controller (Monarch's default)."""
    def record(failure: Any) -> None:
        events.append(str(failure))

    monarch.actor.unhandled_fault_hook = record


def is_alive(call: Any, timeout_s: float = 30.0, retry_s: float = 2.0) -> bool:
    """Probe one actor (or mesh) with a cheap endpoint call (a `.call_one`/`.call` of an endpoint).

    A dead actor's call fails with `SupervisionError` once Monarch has noticed the death; a call sent before that
    can wait far longer (docs/supervision.md), so the probe is re-sent every `retry_s`: a fresh call after the
    supervision poll fails at once. One that no probe answers within `timeout_s` is taken as alive (busy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call().get(timeout=max(0.01, min(retry_s, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                return True
            continue
        except Exception as exc:
            if is_actor_failure(exc):
                return False
            raise
        return True


@dataclass
class Restart:
    """One replacement the supervisor made."""

    role: str
    index: int
    error: str
    # seconds spent building the replacement
    seconds: float
    # time.monotonic() when the replacement began (a drill's detection time)
    started: float = 0.0
    # time.time() then, compared with a kill's time by drills in another process
    at: float = 0.0


@dataclass
class Supervisor:
    """Restart budget per role and the functions that build replacements.

    respawn_generator(i) → a new generator actor (weights not yet loaded);
    restart_trainer() → a new, set-up trainer mesh resumed from its newest checkpoint
    (None: the run has no checkpoints, a trainer failure ends it);
    respawn_replay() → a new teacher-replay actor (state not yet restored);
    retire_generator(i) → kill generator i's process, called before its replacement when it hung.
    """

    max_restarts: int
    respawn_generator: Callable[[int], Any]
    restart_trainer: Callable[[], Any] | None = None
    respawn_replay: Callable[[], Any] | None = None
    retire_generator: Callable[[int], None] | None = None
    restarts: list[Restart] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _charge(self, role: str, exc: BaseException) -> None:
        used = Counter(r.role for r in self.restarts)[role]
        if used >= self.max_restarts:
            raise RuntimeError(f"{role} failed after {used} restarts (mesh.max_restarts = {self.max_restarts})") \
                from exc

    def replace(self, role: str, index: int, exc: BaseException) -> Any:
        """A replacement for dead `role` actor `index`; raises when the budget is spent or the role has no restart."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        make = {"generator": functools.partial(self.respawn_generator, index), "trainer": self.restart_trainer,
                "replay": self.respawn_replay}[role]
        if make is None:
            raise RuntimeError(f"the {role} died and cannot be restarted in this run") from exc
        with self.lock:
            self._charge(role, exc)
            start, started, at = time.perf_counter(), time.monotonic(), time.time()
            if role == "generator" and (isinstance(exc, ActorHung) or is_unanswered(exc)) \
                    and self.retire_generator is not None:
                # a hung process would hold its memory (and its late answers)
                self.retire_generator(index)
            actor = make()
            error = f"{type(exc).__name__}: {exc}"[:300]
            self.restarts.append(Restart(role, index, error, time.perf_counter() - start, started, at))
        return actor


# ---- the controller's own state ------------------------------------------------------------------

_STATE = re.compile(r"^controller-(\d{8})\.pkl$")


@dataclass
class ControllerState:
    """Everything the controller holds between steps, as of trainer policy version `version`.

    iteration: controller steps done (a step whose groups all had equal rewards trains nothing
    and leaves the version unchanged); prompt_cursor: the next fresh prompt index;
    pending: requests taken from the cursor whose groups were not yet returned (re-issued on
    resume, by group id and seed); buffer: groups generated but not yet trained (async);
    replay: the teacher-replay actor's `snapshot()` (queued states, ready pairs, counters) —
    its response cache and budget ledger are on disk already (replay/cache.py); hints: the
    controller's hint maker's `state_dict()` (`mesh.hinting`: the adaptive reference shares).
    """

    version: int
    iteration: int
    prompt_cursor: int
    pending: list[EpisodeRequest] = field(default_factory=list)
    buffer: list[RolloutGroup] = field(default_factory=list)
    replay: Any = None
    hints: Any = None


def state_path(directory: str | Path, version: int) -> Path:
    return Path(directory) / f"controller-{version:08d}.pkl"


def save_state(directory: str | Path, state: ControllerState, keep_from: int | None = None) -> Path:
    """Write `state` atomically (temp file, fsync, rename); drop states older than version `keep_from`."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    final = state_path(folder, state.version)
    tmp = final.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if keep_from is not None:
        for p in folder.iterdir():
            m = _STATE.match(p.name)
            if m and int(m.group(1)) < keep_from:
                p.unlink(missing_ok=True)
    return final


def load_state(directory: str | Path, version: int) -> ControllerState | None:
    """The state saved for `version`, or None when there is none."""
    path = state_path(directory, version)
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        state = pickle.load(f)
    if not isinstance(state, ControllerState) or state.version != version:
        raise ValueError(f"{path} is not a controller state for version {version}")
    return state


def oldest_checkpoint(folder: str | Path) -> int | None:
    """The oldest complete trainer checkpoint step in `folder`, None when there is none."""
    steps = Checkpointer(CheckpointConfig(), folder).complete_steps()
    return steps[0] if steps else None
