"""Grades by content: an identical submission of the same task is judged once per process.

A grade is a function of what it reads: the judge's tree, the agent's files,
the stubs, the expected tests, the episode's violations and the sandbox's
limits (`envs.grading.grade_workspace` hashes all of them into the key). A
group's episodes often submit the same edit, in the same turn or a later one
(about half of the coding recipe's grades, docs/envs.md), so `GradeCache`
keeps the last `capacity` grades and makes a caller whose key is being judged
right now wait for that grade instead of judging it again. Only verdicts are
kept: a result its caller's `keep` refuses (a grade of the grader's own failure,
`Grade.infra`) or a failure of the judge is neither stored nor handed to the
callers waiting on that key, who judge again. Standard library only: the
sandbox backends own one.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def content_key(*parts: Any) -> str:
    """sha256 of `parts` (JSON: dicts by sorted key, anything else JSON lacks by its repr)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


class GradeCache:
    """The last `capacity` results by key, least recently used out first; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a grade cache holds at least 1 grade, got capacity {capacity}")
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._done: OrderedDict[str, Any] = OrderedDict()
        self._running: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def get_or_make(
        self, key: str, make: Callable[[], T], keep: Callable[[T], bool] = lambda result: True
    ) -> tuple[T, bool]:
        """(result, True) for a key made before, or made meanwhile by another thread and kept; else (make(), False),
        stored when `keep(result)`. A result not kept, or a `make` that raised, reaches no other caller: each
        waiting on the key asks again (one of them makes it, the others wait for that one)."""
        while True:
            with self._lock:
                if key in self._done:
                    self._done.move_to_end(key)
                    self.hits += 1
                    return self._done[key], True
                running = self._running.get(key)
                if running is None:
                    self.misses += 1
                    mine = self._running[key] = concurrent.futures.Future()
                    break
                self.hits += 1
            kept, result = running.result()
            if kept:
                return result, True
            with self._lock:  # not a verdict: this caller's hit is taken back and it asks again
                self.hits -= 1
        try:
            result = make()
            kept = keep(result)
        except BaseException:
            self._finish(key, mine, False, None)
            raise
        self._finish(key, mine, kept, result)
        return result, False

    def _finish(self, key: str, mine: concurrent.futures.Future, kept: bool, result: Any) -> None:
        """Store a kept result (least recently used out first) and hand (kept, result) to the callers waiting."""
        with self._lock:
            del self._running[key]
            if kept:
                self._done[key] = result
                if len(self._done) > self.capacity:
                    self._done.popitem(last=False)
        mine.set_result((kept, result))
