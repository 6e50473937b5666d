"""A repository's fixing commits read as SWE-bench material: the base commit, the source part, the test part.

`resolve_commits` turns commit names and ranges (`main~3..main`: the commits of the range, oldest first,
merges left out) into commit ids; `read_fix` reads one: its (first) parent is the base commit the agent
starts from, its message the problem statement, and its change is split by file (`split_patch`) into the
source part (the row's `patch`, what the agent must write) and the test part (`test_patch`, what the
grader applies). A file is on the test side by the grader's own rule (`envs.safeguards.is_test_side`):
under a `tests/` or `test/` directory, named `test_*` or `*_test.py`, `conftest.py`, or test
configuration (pytest.ini, tox.ini, setup.cfg, pyproject.toml, ...). The grader never takes those from the
agent, so a gold patch that touched one would earn 0. Git is only read here; nothing runs.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from composer_mesh.envs.safeguards import TEST_SIDE_RULE, is_test_side
from composer_mesh.envs.swe import patch_paths

_FILE_DIFF = re.compile(r"^diff --git ", re.MULTILINE)


@dataclass(frozen=True)
class FixCommit:
    """One fixing commit: `base` its parent, `patch` / `test_patch` the source and test parts of its change."""

    commit: str
    base: str
    message: str
    created_at: str
    patch: str
    test_patch: str

    @property
    def subject(self) -> str:
        return self.message.splitlines()[0] if self.message else ""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def git_toplevel(repo: str | Path) -> Path:
    """`repo` resolved, when it is the top level of a git work tree; ValueError saying what it is otherwise."""
    path = Path(repo).resolve()
    if not path.is_dir():
        raise ValueError(f"{repo}: no such directory")
    top = _git(path, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise ValueError(f"{repo}: not a git repository")
    if Path(top.stdout.strip()).resolve() != path:
        raise ValueError(f"{repo}: not the top of a git repository (that is {top.stdout.strip()})")
    return path


def resolve_commits(repo: Path, specs: Sequence[str]) -> list[str]:
    """Full commit ids of `specs` (a commit name, or a range `A..B`: its commits oldest first, merges left out),
    in order, each once; ValueError naming an unknown commit or an empty range."""
    found: list[str] = []
    for spec in specs:
        if ".." in spec:
            listed = _git(repo, "rev-list", "--reverse", "--no-merges", spec, "--")
            if listed.returncode != 0:
                raise ValueError(f"unknown commit range {spec!r} in {repo}: {listed.stderr.strip().splitlines()[0]}")
            if not listed.stdout.split():
                raise ValueError(f"commit range {spec!r} in {repo} holds no commit (merges left out)")
            found += listed.stdout.split()
        else:
            one = _git(repo, "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
            if one.returncode != 0:
                raise ValueError(f"unknown commit {spec!r} in {repo}")
            found.append(one.stdout.strip())
    return list(dict.fromkeys(found))


def split_patch(diff: str) -> tuple[str, str]:
    """A git diff as (source part, test part), file by file (`is_test_side`); ValueError for a file whose
    `diff --git a/PATH b/PATH` header the grader cannot read (git quotes paths with spaces or odd characters)."""
    source, tests = [], []
    starts = [m.start() for m in _FILE_DIFF.finditer(diff)]
    for begin, end in zip(starts, [*starts[1:], len(diff)]):
        block = diff[begin:end]
        paths = patch_paths(block)
        if not paths:
            raise ValueError(f"cannot read the file names of {block.splitlines()[0]!r} (a path with spaces or quotes)")
        (tests if any(is_test_side(p) for p in paths) else source).append(block)
    return "".join(source), "".join(tests)


def read_fix(repo: Path, commit: str) -> FixCommit:
    """`commit` of `repo` as a fix; ValueError saying why it is none (a root commit, an empty message, a change
    without a source part or without a test part)."""
    parents = _git(repo, "rev-list", "--parents", "-n", "1", commit).stdout.split()[1:]
    if not parents:
        raise ValueError("it has no parent: no base commit to start from")
    base = parents[0]
    # plumbing: no user diff settings (prefixes, colour, external tools); renames as a deletion and an addition
    diff = _git(repo, "diff-tree", "-p", "--binary", "--no-renames", base, commit).stdout
    message = _git(repo, "log", "-1", "--format=%B", commit).stdout.strip()
    if not message:
        raise ValueError("its message (the row's problem statement) is empty")
    patch, test_patch = split_patch(diff)
    if not test_patch:
        raise ValueError(f"it changes no test file (the test part: {TEST_SIDE_RULE})")
    if not patch:
        raise ValueError("it changes only test files: no source part for the agent to write")
    created = _git(repo, "log", "-1", "--format=%cI", commit).stdout.strip()
    return FixCommit(commit, base, message, created, patch, test_patch)
