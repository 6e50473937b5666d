"""Pull status files on a host's folder: a running pull's pid and a failed pull's error.

A host's loads wait for its reader to seal a version; these files let them fail
at once when that pull failed or its process died, instead of waiting out
their timeout (`PinnedSegment.open`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from composer_mesh.actors.weight_sync.segment import host_dir, path_safe


def failure_path(root: str | os.PathLike, host: str, version: int, token: str) -> Path:
    """Where a failed pull of `version` (sync `token`) onto `host` leaves its error, for the loads waiting there."""
    return host_dir(root, host) / f"failed-v{version:08d}-{path_safe(token)}.txt"


def mark_failed(root: str | os.PathLike, host: str, version: int, token: str, exc: BaseException) -> None:
    """Record that `version` will never be sealed on `host`: `PinnedSegment.open` then raises at once instead of
    waiting out its `timeout_s`."""
    path = failure_path(root, host, version, token)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(f"{type(exc).__name__}: {exc}"[:500])
    os.replace(tmp, path)


def puller_path(root: str | os.PathLike, host: str, version: int, token: str) -> Path:
    """Where the process pulling `version` (sync `token`) onto `host` leaves its pid while it pulls."""
    return host_dir(root, host) / f"pulling-v{version:08d}-{path_safe(token)}.pid"


@contextmanager
def pulling(root: str | os.PathLike, host: str, version: int, token: str) -> Iterator[None]:
    """This process pulls `version` onto `host` for the block's duration. A pull that raises marks the version
    failed; one whose process dies (SIGKILL, the OOM killer) leaves its pid behind, and the loads waiting there
    see that process gone and fail at once (`PinnedSegment.open`) instead of waiting out their `timeout_s`."""
    marker = puller_path(root, host, version, token)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(os.getpid()))
    try:
        yield
    except BaseException as exc:
        # the host's loads wait for this version: tell them it is not coming
        mark_failed(root, host, version, token, exc)
        raise
    finally:
        marker.unlink(missing_ok=True)


def dead_puller(root: str | os.PathLike, host: str, version: int, token: str) -> int | None:
    """The pid of a process that was pulling `version` onto `host` and is gone, else None."""
    try:
        pid = int(puller_path(root, host, version, token).read_text())
    except (FileNotFoundError, ValueError):
        # no pull running, or its pid half-written
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except PermissionError:  # alive, someone else's
        pass
    return None

