"""Grades by content: an identical submission of the same task is judged once per process.

A grade is a function of what it reads: the judge's tree, the agent's files,
the stubs, the expected tests, the episode's violations and the sandbox's
limits (`envs.grading.grade_workspace` hashes all of them into the key). A
group's episodes often submit the same edit, in the same turn or a later one
(about half of the coding recipe's grades, docs/envs.md), so `GradeCache`
keeps the last `capacity` grades and makes a caller whose key is being judged
right now wait for that grade instead of judging it again. Standard library
only: the sandbox backends own one.
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

    def get_or_make(self, key: str, make: Callable[[], T]) -> tuple[T, bool]:
        """(result, True) for a key made before or being made now by another thread (its failure is raised
        here too); else (make(), False), kept unless `make` raises."""
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                self.hits += 1
                return self._done[key], True
            running = self._running.get(key)
            if running is None:
                self.misses += 1
                mine = self._running[key] = concurrent.futures.Future()
            else:
                self.hits += 1
        if running is not None:
            return running.result(), True
        try:
            result = make()
        except BaseException as e:
            with self._lock:
                del self._running[key]
            mine.set_exception(e)
            raise
        with self._lock:
            del self._running[key]
            self._done[key] = result
            if len(self._done) > self.capacity:
                self._done.popitem(last=False)
        mine.set_result(result)
        return result, False
