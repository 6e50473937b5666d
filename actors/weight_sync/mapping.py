"""Shared-memory access for segment writers and readers: slot locks, per-process mappings, single-thread copies.

Slots are reused and every process keeps its mapping of a slot (and a
generator its shadow model bound to it): after the first syncs no page is
faulted, zeroed or re-bound again, so a sync is two memory copies at memory
speed.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import IO, ContextManager, Iterator

import torch

from composer_mesh.titan_ext.platform import torch_threads


@contextmanager
def locked(path: Path) -> Iterator[IO[str]]:
    """`path` opened for update under an exclusive flock (a slot's claim and party count)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        yield f


class SlotMapping:
    """A whole segment file mapped once (shared; read-only for readers) and a uint8 tensor over it.

    Mapped through its own open of the file: Python's mmap keeps a dup of the descriptor it was given, and a
    dup of a descriptor that holds the slot's flock would keep that lock alive as long as the mapping.
    """

    def __init__(self, path: Path, writable: bool) -> None:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.key = (st.st_dev, st.st_ino, st.st_size)
            self.mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        # read-only pages (torch warns about them): a stray write faults loudly instead of going stale
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            # [file bytes]
            self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)


_MAPPINGS: dict[tuple[str, bool], SlotMapping] = {}


def map_slot(path: Path, fd: int, writable: bool) -> SlotMapping:
    """This process's mapping of the slot file open (and locked) at `fd`, reused while the file and its size
    are unchanged, so its pages are faulted once per process, not once per version. Mappings of files that
    were removed (a deleted root) are dropped, freeing their memory once no tensor views them."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size)
    cached = _MAPPINGS.get((str(path), writable))
    if cached is not None and cached.key == key:
        return cached
    for (other, w), m in list(_MAPPINGS.items()):
        try:
            gone = os.stat(other).st_ino != m.key[1]
        except FileNotFoundError:
            gone = True
        if gone:
            del _MAPPINGS[(other, w)]
    mapping = SlotMapping(path, writable)
    if mapping.key != key:
        raise RuntimeError(f"{path} was replaced while being mapped")
    _MAPPINGS[(str(path), writable)] = mapping
    return mapping


def one_thread() -> ContextManager[None]:
    """Run torch ops in one thread: the copies here are memory-bound and several processes of a host copy at
    once; with a thread team per op, every one of the many small copies waits for a core another process holds."""
    return torch_threads(1)


class SlotHold:
    """An open slot file whose flock this object holds: `release()` (or leaving a `with` block) closes the
    descriptor, which lets go of the lock; a writer released before `done()` never seals its version."""

    fd = -1

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SlotHold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()

