"""SWE-style coding tasks: a repository at a commit, an issue, hidden tests, an image.

Rows come from a local JSONL in the SWE-Gym / SWE-bench shape (instance_id,
repo, base_commit, problem_statement, patch, test_patch, FAIL_TO_PASS,
PASS_TO_PASS, image as `docker_image` / `image_name` / `image`) or the R2E-Gym
shape (repo_name, commit_hash, docker_image, expected_output_json); the
repository is a local directory or git repository under `[env.swe] repos_dir`,
checked out at base_commit with `git archive` (no history reaches the agent).
The agent never sees test_patch: a grade copies the agent's tree, puts the
pristine version of every file test_patch touches back, applies test_patch,
and runs FAIL_TO_PASS + PASS_TO_PASS (pytest node ids) in the task's backend.
Reward 1 only when every one of them passes and no test file was edited.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from composer_mesh.configs.sections.env import SweConfig
from composer_mesh.envs.backend import SandboxBackend
from composer_mesh.envs.coding import failed_tests
from composer_mesh.envs.container import ContainerBackend
from composer_mesh.envs.grading import Grade
from composer_mesh.envs.safeguards import change_violations, diff_tree, is_bytecode, manifest
from composer_mesh.envs.sandbox import SandboxResult, Workspace
from composer_mesh.envs.swe_verdict import REPORT_CHARS, Canaries, plant, read_report

_PYTEST = ("-m", "pytest", REPORT_CHARS, "--tb=short", "-q", "-p", "no:cacheprovider", "-o", "addopts=")
_DIFF_PATHS = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_REPORT_CHARS = 200_000
_IMAGE_KEYS = ("image", "image_name", "docker_image")


@dataclass(frozen=True)
class SweTask:
    """One instance; `backend` is "container" (its image) or "local" (the bubblewrap sandbox)."""

    name: str
    repo: str
    repo_path: Path
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    image: str
    backend: str
    store: Path = field(repr=False)
    plugin_autoload: bool = False
    source: str = "swe"

    @property
    def template(self) -> str:
        """Held-out split key: the instance id."""
        return self.name

    @property
    def tests(self) -> tuple[str, ...]:
        """Every node id that must pass for reward 1."""
        return tuple(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))

    def prompt(self, tools: bool = True) -> str:
        """The issue text, with what to deliver (tool calls, or one diff for a single turn)."""
        head = f"Repository `{self.repo}` (the working directory). Resolve this issue; do not edit existing tests.\n\n"
        if tools:
            return head + self.problem_statement + "\n\nUse the tools; answer without a tool call when done."
        return head + self.problem_statement + "\n\nReply with a unified diff (a/ and b/ paths) in one ```diff block."

    def snapshot(self) -> Path:
        """The repository at base_commit, extracted once into the private store (no .git)."""
        dest = self.store / re.sub(r"[^A-Za-z0-9_.-]", "_", self.name)
        if not dest.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix="snap-", dir=self.store))
            if self.base_commit:
                archive = subprocess.run(
                    ["git", "-C", str(self.repo_path), "archive", "--format=tar", self.base_commit],
                    capture_output=True, check=True,
                )
                subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
            else:
                shutil.copytree(self.repo_path, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git"))
            try:
                os.replace(tmp, dest)
            except OSError:
                # another process extracted it first
                shutil.rmtree(tmp)
        return dest

    def workspace(self, backend: SandboxBackend) -> Workspace:
        """The agent's starting tree: the repository at base_commit (tests of test_patch not applied)."""
        ws = _concrete(backend, self).workspace(copy_from=self.snapshot(), skip=is_bytecode)
        if isinstance(backend, TaskBackends):
            backend.remember(ws, self)
        return ws

    def reference_files(self) -> dict[str, str]:
        """Changed files of the gold patch, full new text (deleted files left out)."""
        return {rel: data.decode() for rel, data in patched_files(self.patch, self.snapshot()).items() if data is not None}

    def failing_cases(self, grade: Grade) -> str:
        """The source of the hidden tests `grade` failed (each failing node id's test function, from the test
        files as test_patch leaves them), for the teacher's context only."""
        tests = {rel: data.decode(errors="replace") for rel, data in patched_files(self.test_patch, self.snapshot()).items()
                 if data is not None}
        out = []
        for node in failed_tests(grade, self.tests):
            path, *names = node.split("[", 1)[0].split("::")
            text = tests.get(path)
            if text is None and (self.snapshot() / path).is_file():
                text = (self.snapshot() / path).read_text(errors="replace")
            found = _test_source(text or "", names)
            if found:
                out.append(found)
        return "\n\n".join(out)

    def grade_patch(self, backend: SandboxBackend, patch: str) -> Grade:
        """Grade a unified diff applied to a fresh starting workspace (a single-turn answer, the gold patch)."""
        with self.workspace(backend) as ws:
            start = manifest(ws.path)
            try:
                write_files(ws.path, patched_files(patch, self.snapshot()))
            except ValueError as exc:
                return Grade(0.0, "patch_does_not_apply", 0, len(self.tests), (("patch_does_not_apply", str(exc)),))
            ws.adopt()
            return self.grade(backend, ws, start, ())

    def run_pytest(self, backend: SandboxBackend, ws: Workspace, args: Sequence[str]) -> SandboxResult:
        """pytest over `args` (node ids, test files, options) in `ws` on `backend`, as a grade runs it: its short
        summary of every outcome (`envs.swe_verdict.read_report` reads it), plugins autoloaded only when the task
        allows them."""
        env = {} if self.plugin_autoload else {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        return backend.run([backend.python(), *_PYTEST, *args], ws, env=env, tail_chars=_REPORT_CHARS)

    def grade(
        self, backend: SandboxBackend, ws: Workspace, start_manifest: dict[str, str],
        violations: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (), canaries: bool = True,
    ) -> Grade:
        """Run the hidden tests against a copy of `ws` with test_patch applied; 1 only for a clean full pass.

        Added test files are allowed (only the named node ids run); edited or
        deleted tests, test configuration and new conftest files are violations
        (as are the tool loop's `violations`): those earn 0 without a test run.
        The run also holds negative-control canaries (`envs.swe_verdict`): one
        reported passed, or a report whose outcome lines, final counts and exit
        status disagree, is `forged_report`. `canaries=False` only measures what
        they cost (benchmarks/sandbox.py).
        """
        began = time.perf_counter()
        backend = _concrete(backend, self)
        diff = diff_tree(start_manifest, manifest(ws.path))
        found = list(violations) + [v for v in change_violations(diff) if v[0] != "added_tests"]
        total = len(self.tests)
        if found:
            # reward 0 whatever the tests say: spare the run
            return Grade(0.0, found[0][0], 0, total, tuple(dict.fromkeys(found)), "", round(time.perf_counter() - began, 6))
        hidden = patched_files(self.test_patch, self.snapshot())
        rng = random.Random(secrets.randbits(64))
        with backend.workspace(copy_from=ws.path, skip=lambda rel: rel in hidden or is_bytecode(rel)) as judge:
            write_files(judge.path, hidden)
            planted = plant(judge.path, self.fail_to_pass or self.tests, rng) if canaries else Canaries(())
            judge.adopt()
            result = self.run_pytest(backend, judge, planted.mixed_with(self.tests, rng))
        report = read_report(result.stdout, result.exit_code, self.tests, planted)
        found += [(v, "tests") for v in result.violations]
        found += [("forged_report", why) for why in report.forged]
        if not found and not (report.outcomes and report.summary_found):
            found.append(("tests_not_run", f"exit {result.exit_code}: {(result.stderr or result.stdout)[-300:]}"))
        passed = sum(report.outcomes.get(t) == "PASSED" for t in self.tests)
        if found:
            reason = found[0][0]
        elif passed < total:
            reason = f"tests_failed ({passed}/{total} passed)"
        else:
            reason = "passed"
        return Grade(
            1.0 if reason == "passed" else 0.0, reason, passed, total, tuple(dict.fromkeys(found)),
            result.stdout[-4000:] + result.stderr[-2000:], round(time.perf_counter() - began, 6),
        )


class TaskBackends:
    """A `SandboxBackend` that runs each workspace where its task says: the local sandbox, or its image.

    The tool loop holds one backend for every source of a union; a SWE task's
    workspace is made, and its commands run, in a container of the task's
    image (one `ContainerBackend` per image). `python()` names the local
    interpreter; `run` swaps it for the image's one in a container workspace.
    Every other task (micro, repos) sees the local sandbox whole: its
    attributes (`config`, `root`) and `run`'s local-only keywords pass through.
    """

    def __init__(self, local: SandboxBackend, config: SweConfig) -> None:
        self.local = local
        self.swe_config = config
        self._images: dict[str, ContainerBackend] = {}
        self._by_path: dict[Path, SandboxBackend] = {}
        self._lock = threading.Lock()

    def for_task(self, task: Any) -> SandboxBackend:
        """The backend `task.backend` names (a container backend per image, made on first use)."""
        if getattr(task, "backend", "local") != "container":
            return self.local
        with self._lock:
            if task.image not in self._images:
                self._images[task.image] = ContainerBackend(self.swe_config, task.image)
            return self._images[task.image]

    def remember(self, ws: Workspace, task: Any) -> None:
        """Route `ws`'s commands to `task`'s backend (entries of removed workspaces are dropped)."""
        backend = self.for_task(task)
        with self._lock:
            self._by_path = {p: b for p, b in self._by_path.items() if p.exists()}
            self._by_path[ws.path] = backend

    def workspace(
        self, copy_from: str | os.PathLike | None = None, skip: Callable[[str], bool] | None = None
    ) -> Workspace:
        return self.local.workspace(copy_from, skip)

    def run(
        self, argv: Sequence[str], ws: Workspace, *, stdin: bytes = b"", timeout_s: float | None = None,
        env: Mapping[str, str] | None = None, tail_chars: int | None = None, **local_only: Any,
    ) -> SandboxResult:
        """Run on `ws`'s backend; `local_only` (`expose`, `pass_fds`, ...) reach the local sandbox only."""
        backend = self._by_path.get(ws.path, self.local)
        if backend is not self.local:
            if local_only:
                raise ValueError(f"{sorted(local_only)}: the local sandbox's keywords, not a container's")
            if argv and argv[0] == self.local.python():
                argv = [backend.python(), *argv[1:]]
        return backend.run(argv, ws, stdin=stdin, timeout_s=timeout_s, env=env, tail_chars=tail_chars, **local_only)

    def python(self) -> str:
        return self.local.python()

    def __getattr__(self, name: str) -> Any:
        # the local sandbox's own attributes (config, root, tag) for the graders of local tasks
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)


def _test_source(text: str, names: Sequence[str]) -> str:
    """The source of the test `names` (a function, or a class then a method) of a test file's `text`; '' when it
    is not there or the file does not parse."""
    try:
        body = ast.parse(text).body
    except (SyntaxError, ValueError, RecursionError):
        return ""
    node = None
    for name in names:
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == name), None)
        if node is None:
            return ""
        body = node.body
    return (ast.get_source_segment(text, node) or "") if node is not None else ""


def _concrete(backend: SandboxBackend, task: SweTask) -> SandboxBackend:
    return backend.for_task(task) if isinstance(backend, TaskBackends) else backend


def patch_paths(patch: str) -> list[str]:
    """Relative paths a unified git diff touches (old and new names)."""
    return list(dict.fromkeys(p for pair in _DIFF_PATHS.findall(patch) for p in pair))


def patched_files(patch: str, base: Path) -> dict[str, bytes | None]:
    """rel -> new content (None: deleted) of every file `patch` touches, applied to the files of `base`.

    git applies the patch in a fresh private directory holding only the touched
    files' pristine copies (never in an agent's tree); ValueError when it does not apply.
    """
    if not patch.strip():
        return {}
    paths = patch_paths(patch)
    if not paths:
        raise ValueError("not a git diff (no 'diff --git a/... b/...' header)")
    with tempfile.TemporaryDirectory(prefix="cm-patch-") as tmp:
        root = Path(tmp) / "tree"
        root.mkdir()
        for rel in paths:
            if (base / rel).is_file():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(base / rel, root / rel)
        env = os.environ | {"GIT_CEILING_DIRECTORIES": tmp}
        done = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=root, input=patch.encode(),
                              capture_output=True, env=env)
        if done.returncode != 0:
            raise ValueError(done.stderr.decode(errors="replace").strip() or "git apply failed")
        return {rel: (root / rel).read_bytes() if (root / rel).is_file() else None for rel in paths}


def write_files(root: Path, files: dict[str, bytes | None]) -> None:
    """Write (or delete, for None) each relative path under `root`."""
    for rel, data in files.items():
        path = root / rel
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def load_instances(config: SweConfig, store: Path) -> list[SweTask]:
    """`SweTask`s from `env.swe.instances`; errors name the key, or the line and field of a bad row."""
    if not config.instances:
        raise ValueError("env.swe.instances is empty: set it to a local JSONL of SWE-style rows")
    path = Path(config.instances)
    if not path.is_file():
        raise ValueError(f"env.swe.instances = {config.instances!r}: no such file")
    if not config.repos_dir or not Path(config.repos_dir).is_dir():
        raise ValueError(f"env.swe.repos_dir = {config.repos_dir!r}: not a directory (it holds the repositories)")
    store.mkdir(mode=0o700, parents=True, exist_ok=True)
    tasks: dict[str, SweTask] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not a JSON object ({exc.msg})") from None
            task = _task(raw, where, config, store)
            if task.name in tasks:
                raise ValueError(f"{where}: instance_id {task.name!r} repeats an earlier row")
            tasks[task.name] = task
            if config.max_instances and len(tasks) == config.max_instances:
                break
    return list(tasks.values())


def _task(raw: Any, where: str, config: SweConfig, store: Path) -> SweTask:
    """One row, SWE-Gym or R2E-Gym shape, checked (the repository and base commit must exist)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a JSON object")
    get = _getter(raw, where)
    repo = get("repo", "repo_name")
    commit = raw.get("base_commit") if "base_commit" in raw else (f"{get('commit_hash')}^" if "commit_hash" in raw else "")
    name = raw.get("instance_id") or f"{repo.replace('/', '__')}-{raw.get('commit_hash', '')}"
    f2p = _tests(raw, "FAIL_TO_PASS", where)
    p2p = _tests(raw, "PASS_TO_PASS", where)
    if not f2p and "expected_output_json" in raw:
        expected = _json_field(raw, "expected_output_json", where)
        f2p = tuple(t for t, status in expected.items() if str(status).upper() == "PASSED")
    if not f2p + p2p:
        raise ValueError(f"{where}: no tests to run (FAIL_TO_PASS, PASS_TO_PASS or expected_output_json)")
    image = next((raw[k] for k in _IMAGE_KEYS if raw.get(k)), config.image)
    if config.runtime != "local" and not image:
        raise ValueError(f"{where}: no image (row fields {', '.join(_IMAGE_KEYS)}) and env.swe.image is empty")
    repo_path = _repository(Path(config.repos_dir), repo, where)
    if commit:
        check = subprocess.run(["git", "-C", str(repo_path), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        if check.returncode != 0:
            raise ValueError(f"{where}: base_commit {commit!r} is not a commit of {repo_path}")
    return SweTask(
        name=str(name), repo=repo, repo_path=repo_path, base_commit=commit, problem_statement=get("problem_statement"),
        patch=str(raw.get("patch") or ""), test_patch=str(raw.get("test_patch") or ""), fail_to_pass=f2p,
        pass_to_pass=p2p, image=str(image), backend="local" if config.runtime == "local" else "container", store=store,
        plugin_autoload=config.plugin_autoload,
    )


def _getter(raw: dict, where: str) -> Callable[..., str]:
    def get(*keys: str) -> str:
        for key in keys:
            if isinstance(raw.get(key), str) and raw[key]:
                return raw[key]
        raise ValueError(f"{where}: missing field {' or '.join(repr(k) for k in keys)} (a non-empty string)")

    return get


def _json_field(raw: dict, key: str, where: str) -> Any:
    """A field that datasets store either as JSON text or as the value itself."""
    value = raw[key]
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: field {key!r} is a string but not JSON") from None
    return value


def _tests(raw: dict, key: str, where: str) -> tuple[str, ...]:
    if key not in raw:
        return ()
    value = _json_field(raw, key, where)
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"{where}: field {key!r} must be a list of pytest node ids")
    return tuple(value)


def _repository(repos_dir: Path, repo: str, where: str) -> Path:
    """`repos_dir`/owner__name, /name or /owner/name, whichever exists."""
    candidates = [repos_dir / repo.replace("/", "__"), repos_dir / repo.split("/")[-1], repos_dir / repo]
    for path in candidates:
        if path.is_dir():
            return path
    raise ValueError(f"{where}: repository {repo!r} not found under env.swe.repos_dir ({', '.join(map(str, candidates))})")
