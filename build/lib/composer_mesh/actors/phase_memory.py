"""Peak memory of this process per phase (load, first sync, step, checkpoint, export, generate).

Linux keeps a process's peak resident set (`VmHWM`) and lets the process
reset it to the current size (`5` into `/proc/self/clear_refs`), so each
phase's own peak is exact, not a sampler's guess: the phase resets it on
entry and reads it on exit. Resident memory counts the shared-memory pages a
process touched (the weight-sync slots it wrote or read) and its mapped
libraries; `private` subtracts both as they stand at the end of the phase.
Actors keep one `PhaseMemory` and return `report()` from a `memory_phases`
endpoint; the run writes them to summary.json (`memory`) and
`benchmarks/memory_scale.py` prints them. Without /proc the phases record nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_PROC = Path("/proc/self")


def _status() -> dict[str, int]:
    """The memory lines of /proc/self/status, in bytes."""
    out = {}
    for line in (_PROC / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


class PhaseMemory:
    """Per phase name: the largest peak resident set seen (bytes), and the private part of it.

    Phases nest (a checkpoint inside a step): entering an inner phase first
    keeps the enclosing phase's peak so far, and the enclosing phase resumes
    from a fresh reset when the inner one ends, so each gets its own peak.
    """

    def __init__(self) -> None:
        self.peaks: dict[str, dict[str, int]] = {}
        # per open phase: the /proc status at its highest peak so far
        self._open: list[dict[str, int]] = []
        self.enabled = (_PROC / "clear_refs").exists()

    def _reset(self) -> None:
        try:
            (_PROC / "clear_refs").write_text("5")
        except OSError:
            self.enabled = False

    def begin(self) -> None:
        """Start a phase: the peak resident set is reset to the current one."""
        if not self.enabled:
            return
        if self._open:
            self._open[-1] = max(self._open[-1], _status(), key=lambda s: s["VmHWM"])
        self._open.append({"VmHWM": 0})
        self._reset()

    def end(self, name: str) -> None:
        """End the innermost phase as `name`: keep its peak if it is the largest of that name so far."""
        if not self.enabled or not self._open:
            return
        s = max(self._open.pop(), _status(), key=lambda s: s["VmHWM"])
        peak = {"peak_rss": s["VmHWM"], "private": max(0, s["VmHWM"] - s["RssFile"] - s["RssShmem"]),
                "shmem": s["RssShmem"]}
        old = self.peaks.get(name)
        if old is None or peak["peak_rss"] > old["peak_rss"]:
            self.peaks[name] = peak
        if self._open:
            self._reset()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end(name)

    def first_or(self, first: str, later: str) -> str:
        """`first` until a phase of that name has been recorded, then `later` (a first sync, then syncs)."""
        return later if first in self.peaks else first

    def report(self) -> dict[str, dict[str, int]]:
        return {name: dict(peak) for name, peak in self.peaks.items()}


# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# bytes; set by mesh.placement from [mesh] malloc_mmap_threshold_mib
MMAP_THRESHOLD_ENV = "COMPOSER_MESH_MMAP_THRESHOLD"
MMAP_THRESHOLD_BYTES = 4 << 20


def bound_malloc_retention(threshold: int | None = None) -> bool:
    """Serve every allocation of `threshold` bytes or more with its own mapping, returned on free.

    glibc raises its mmap threshold each time a mapped block is freed (up to
    32 MiB), after which tensors below it come from the heap and their pages
    stay with the process once freed. Fixing the threshold (which turns the
    adjustment off) and the trim threshold gives them back; why 4 MiB and
    what it saves: docs/cluster.md. Called once in each actor process with the
    threshold the run set (`[mesh] malloc_mmap_threshold_mib`, through the
    environment the actors inherit; 0 leaves glibc alone); False where it
    does nothing or glibc is not the allocator.
    """
    if threshold is None:
        threshold = int(os.environ.get(MMAP_THRESHOLD_ENV, MMAP_THRESHOLD_BYTES))
    if threshold <= 0:
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, threshold))
