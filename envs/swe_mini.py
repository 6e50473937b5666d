"""SWE-style mini instances: micro templates in the SWE-bench shape, graded by the SWE grader.

A micro task of a `shape = "swe"` variant (`[[env.coding.variants]]`, its
`failing_visible_test` forced on) becomes a small package repository in git:
`pkg/m.py` with every function implemented and one of them buggy, and
`tests/test_m.py` holding hidden-test-like cases of the correct functions
(which pass at the base commit). The instance has what a SWE-bench row has: an
issue stating a failing call with the value it returns and the one expected
(and, for the tiny models this project trains, the buggy module's text, so
`edit_file` can fix it without reading it first), the gold patch (the fixed
line), a test patch adding the buggy function's cases to `tests/test_m.py`,
FAIL_TO_PASS (those of them the bug fails) and PASS_TO_PASS node ids (the
rest). It is an `envs.swe.SweTask` on the local backend, so its grade is the
SWE grader's: the test patch applied to a judge copy, the hidden node ids run
with negative-control canaries (`envs.swe_verdict`), reward 1 only for a clean
full pass.

Instances are made on first use into a private store (root-only, removed at
exit) and split, as micro tasks are, by their template's hash.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from composer_mesh.configs.sections.env import CodingConfig
from composer_mesh.envs.demo import Split
from composer_mesh.envs.micro import (
    HIDDEN_TESTS, VISIBLE_TESTS, MicroTask, Signature, draw_template, make_task, write_tree,
)
from composer_mesh.envs.swe import SweTask

PACKAGE = "pkg"
TARGET = f"{PACKAGE}/m.py"
TESTS = "tests/test_m.py"


@dataclass(frozen=True)
class SweMiniTask(SweTask):
    """A SWE instance made from a micro task: `target` is the module holding the bug, `stubbed_source` its text
    at the base commit, `signatures` its functions (the buggy one's start is its buggy line), what the warm start
    and the local coding teachers edit."""

    target: str = TARGET
    stubbed_source: str = ""
    signatures: tuple[Signature, ...] = ()
    bug_function: str = ""

    def render(self, bodies: Mapping[str, Sequence[str]]) -> str:
        """The target module with the bodies of `bodies` (function name -> body lines), the others as they start."""
        return "\n\n".join(s.source(bodies.get(s.name, s.start)) for s in self.signatures)


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=composer-mesh", "-c", "user.email=mesh@localhost", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _tests(name: str, cases: Sequence[str]) -> str:
    """A test function per `assert` line of function `name`, named test_<name>_<i>."""
    return "".join(f"\n\ndef test_{name}_{i}():\n    {case}\n" for i, case in enumerate(cases))


def _fails(module: str, case: str) -> bool:
    """Whether `case` (our own `assert` line) fails against `module` (our own source)."""
    ns: dict[str, Any] = {}
    exec(compile(module, TARGET, "exec"), ns)
    try:
        exec(compile(case, "<case>", "exec"), ns)
    except AssertionError:
        return True
    return False


def issue_text(module: str, sig: Signature, case: str) -> str:
    """The issue: the failing call of `case` (`assert f(...) == want`), the value the buggy `module` returns and
    the one expected, then the module as it is."""
    call, want = case[len("assert "):].split(" == ", 1)
    ns: dict[str, Any] = {}
    exec(compile(module, TARGET, "exec"), ns)
    got = eval(compile(call, "<call>", "eval"), ns)
    return f"{sig.name} in {TARGET} is wrong: {call} returns {got!r}, expected {want}.\n\n{module}"


def build_instance(micro: MicroTask, root: Path, store: Path) -> SweMiniTask:
    """The SWE instance of `micro` (which has a buggy function): its repository made in git under `root`."""
    bug = next(s for s in micro.signatures if s.name == micro.bug_function)
    implemented = [dataclasses.replace(s, start=s.body) if s.name != bug.name else s for s in micro.signatures]
    base = "\n\n".join(s.source(s.start) for s in implemented)
    fixed = micro.reference[micro.target]
    hidden = micro.hidden[HIDDEN_TESTS]
    from_line = f"from {PACKAGE}.m import {', '.join(s.name for s in implemented)}\n"
    asserts = {s.name: [line.strip() for line in hidden.splitlines() if line.strip().startswith(f"assert {s.name}(")]
               for s in implemented}
    visible = micro.files[VISIBLE_TESTS]
    issue_case = next(line.strip() for line in visible.splitlines() if line.strip().startswith(f"assert {bug.name}("))
    base_tests = from_line + "".join(_tests(s.name, asserts[s.name]) for s in implemented if s.name != bug.name)
    bug_cases = [issue_case, *asserts[bug.name]]
    new_tests = base_tests + _tests(bug.name, bug_cases)
    repo = root / micro.name.replace(":", "_").replace("/", "_").replace(";", "_").replace("+", "_")
    write_tree(repo, {f"{PACKAGE}/__init__.py": "", TARGET: base, TESTS: base_tests})
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    write_tree(repo, {TARGET: fixed})
    patch = _git(repo, "diff")
    write_tree(repo, {TARGET: base, TESTS: new_tests})
    test_patch = _git(repo, "diff")
    _git(repo, "checkout", "-q", "--", ".")
    ids = [f"{TESTS}::test_{s.name}_{i}" for s in implemented if s.name != bug.name for i in range(len(asserts[s.name]))]
    bug_ids = [f"{TESTS}::test_{bug.name}_{i}" for i in range(len(bug_cases))]
    fail = tuple(t for t, c in zip(bug_ids, bug_cases) if _fails(base, c))
    return SweMiniTask(
        name=micro.name, repo=f"acme/{repo.name}", repo_path=repo, base_commit=commit,
        problem_statement=issue_text(base, bug, issue_case), patch=patch, test_patch=test_patch,
        fail_to_pass=fail, pass_to_pass=tuple(ids) + tuple(t for t in bug_ids if t not in fail), image="",
        backend="local", store=store, source=micro.source, stubbed_source=base, signatures=tuple(implemented),
        bug_function=bug.name,
    )


class SweMiniTasks:
    """The SWE mini instances of one split of variant `source` (its knobs `config`): `pick(seed)` makes the
    seed's instance into `store` on first use (a git repository and its snapshot) and keeps it."""

    def __init__(self, config: CodingConfig, split: Split, source: str, store: Path) -> None:
        self.config = dataclasses.replace(config, failing_visible_test=True)
        self.split, self.source, self.store = split, source, store
        self._made: dict[int, SweMiniTask] = {}
        self._lock = threading.Lock()
        draw_template(self.config, split, random.Random(0))  # fail at construction when the split is empty

    def pick(self, seed: int) -> SweMiniTask:
        with self._lock:
            if seed not in self._made:
                micro = make_task(self.config, self.split, seed, self.source)
                for sub in ("repos", "snapshots"):
                    (self.store / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
                self._made[seed] = build_instance(micro, self.store / "repos", self.store / "snapshots")
            return self._made[seed]
