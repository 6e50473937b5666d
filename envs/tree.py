"""Directory trees a policy wrote: walked within bounds, removed at any depth, never by recursion.

An agent, or a program it runs, can make a tree deeper than Python's recursion
limit and longer than PATH_MAX: Python 3.11's `os.walk` and `shutil.rmtree`
recurse (RecursionError), and path-based calls fail past PATH_MAX. `walk`
visits a tree with an explicit stack and refuses one deeper than `MAX_DEPTH`
levels or holding a relative path longer than `MAX_PATH_CHARS` (`TreeTooDeep`,
a ValueError the graders report as the violation `deep_tree`; no repository a
task starts from comes near either bound). `remove_tree` removes a tree of any
depth holding one directory open at a time, every call relative to a file
descriptor, never following a symlink. `resolve` is `os.path.realpath`
without recursion, following at most `MAX_LINKS` symlinks as the kernel does
(Python 3.11's recurses once per link of a chain).
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque
from pathlib import Path
from typing import Iterator

MAX_DEPTH = 64
MAX_PATH_CHARS = 2048
MAX_LINKS = 40  # the symlinks Linux follows in one lookup before ELOOP (MAXSYMLINKS)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TreeTooDeep(ValueError):
    """A tree deeper than `MAX_DEPTH` or with a path longer than `MAX_PATH_CHARS` (a policy's making)."""


def walk(root: str | os.PathLike, max_depth: int = MAX_DEPTH) -> Iterator[tuple[str, list[str], list[str]]]:
    """`os.walk(root)` top down without recursion: (dirpath, dirnames, filenames), symlinked directories listed
    with the files and never entered; pruning `dirnames` in place prunes the walk. Raises `TreeTooDeep` before
    entering a directory past `max_depth` levels or a name past `MAX_PATH_CHARS`; unreadable directories are
    skipped, as `os.walk` skips them."""
    top = os.fspath(root)
    stack = [(top, 0)]
    while stack:
        dirpath, depth = stack.pop()
        try:
            entries = list(os.scandir(dirpath))
        except OSError:
            continue
        dirs, files = [], []
        for entry in entries:
            if len(entry.path) - len(top) > MAX_PATH_CHARS:
                raise TreeTooDeep(f"a path under the workspace is over {MAX_PATH_CHARS} characters")
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            (dirs if is_dir else files).append(entry.name)
        yield dirpath, dirs, files
        if dirs and depth + 1 > max_depth:
            raise TreeTooDeep(f"directories nested over {max_depth} levels deep")
        stack += [(os.path.join(dirpath, d), depth + 1) for d in reversed(dirs)]


def resolve(path: str | os.PathLike) -> str:
    """`os.path.realpath(path)` (absolute, every symlink resolved, a missing tail kept as it is), following at most
    `MAX_LINKS` links in all and never recursing; a chain longer than that or a loop raises `OSError(ELOOP)`, as
    the kernel's own lookup would."""
    pending = deque(os.path.abspath(os.fspath(path)).split("/"))
    out, links = "/", 0
    while pending:
        name = pending.popleft()
        if name in ("", "."):
            continue
        if name == "..":
            out = os.path.dirname(out)
            continue
        step = os.path.join(out, name)
        try:
            target = os.readlink(step)
        except OSError:  # not a link, or not there: kept as it is
            out = step
            continue
        links += 1
        if links > MAX_LINKS:
            raise OSError(errno.ELOOP, f"more than {MAX_LINKS} symbolic links", os.fspath(path))
        if target.startswith("/"):
            out = "/"
        pending.extendleft(reversed(target.split("/")))
    return out


def remove_tree(path: str | os.PathLike) -> None:
    """Remove `path` (a directory and all under it, or a file or link) at any depth; what cannot be removed
    stays, as with `shutil.rmtree(ignore_errors=True)`. Never recurses, never follows a link, reads each
    directory once."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        _ignore(os.unlink, path)
        return
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    # per directory entered, top first: its (dev, inode), the subdirectories left to visit, its name in its parent
    stack: list[tuple[tuple[int, int], list[str], str]] = []
    try:
        stack.append((_id(st), _clear(fd), ""))
        while True:
            _, pending, name = stack[-1]
            if pending:
                sub = pending.pop()
                try:
                    child = os.open(sub, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue  # gone, or not a directory any more: left as it is
                os.close(fd)
                fd = child
                stack.append((_id(os.fstat(fd)), _clear(fd), sub))
                continue
            if len(stack) == 1:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            stack.pop()
            if _id(os.fstat(fd)) != stack[-1][0]:
                return  # the tree moved while we walked it: stop rather than remove anything elsewhere
            _ignore(os.rmdir, name, dir_fd=fd)
    except OSError:
        return
    finally:
        os.close(fd)
    _ignore(os.rmdir, path)


def clear_dir(path: str | os.PathLike, keep: frozenset[Path] | set[Path] = frozenset()) -> None:
    """Remove everything inside `path` but the entries named in `keep` (`path` itself stays: a mount point)."""
    for entry in os.scandir(path):
        if Path(entry.path) not in keep:
            remove_tree(entry.path)


def _clear(fd: int) -> list[str]:
    """Unlink every non-directory in the directory `fd`; the names of its subdirectories."""
    dirs = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                dirs.append(entry.name)
            else:
                _ignore(os.unlink, entry.name, dir_fd=fd)
    return dirs


def _id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _ignore(fn, *args, **kwargs) -> bool:
    """Call `fn`; False when it raised OSError."""
    try:
        fn(*args, **kwargs)
    except OSError:
        return False
    return True
