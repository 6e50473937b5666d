"""Multi-turn tool loop over a coding task: read_file, write_file, edit_file, list_dir, run_tests, shell.

Each assistant message may call tools (OpenAI `tool_calls`); every call gets a
`tool` message back. A failed call also yields an `ErrorSite` whose kind the
tool knows (missing file, path outside the workspace, unknown tool or bad
arguments, an edit whose text is missing or not unique, failing tests, syntax
error, timeout, command not allowed), which the hint pipeline turns into
hints. A message without tool calls, or the turn limit, ends the episode: the
task grades the workspace (`task.grade`, any `envs.coding.CodingTask` on any
`SandboxBackend`). `[env.tool_loop] tools` offers a subset of the tools: their
JSON is rendered into the system prompt, and prompt length matters to a tiny
model.

File tools run on the host but only inside the workspace (paths are resolved,
symlinks included, and anything outside is refused); programs (`run_tests`,
`shell`) run in the sandbox as the workspace's uid. The shell is restricted:
one allowed program with arguments, no pipes, redirection or chaining.

What a reply may cost is bounded: `max_calls_per_message` calls run per
message, `max_edits_per_episode` edits are applied per episode, and with
`check_edits` the episode's grading time (the checks and the final grade)
stays within `grading_budget` x `[env.sandbox] wall_timeout_s`; a call past a
bound gets an error saying so and is not run (the final info's
`calls_refused`, by bound, and `grading_s`). No argument makes a tool raise: a
string holding a lone surrogate, a path with a NUL byte or past `envs.tree`'s
depth and length bounds, an empty or unparsable command are refused before
anything is touched; what the file system answers (a missing file, a symlink
loop, a FIFO, a name too long) is the call's error; a grade or check that
raises is a grade of 0 naming why (`deep_tree` for a tree past the walk's bounds).
A workspace the episode grew past `max_added_files` entries or `max_added_mb`
MiB is not graded (reward 0, `large_tree`): what a grade reads grows with it.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import random
import shlex
import stat
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from composer_mesh.configs.records import EDIT_UNDONE, ErrorKind, ErrorSite
from composer_mesh.configs.sections.env import SandboxConfig, ToolLoopConfig
from composer_mesh.envs.backend import SandboxBackend
from composer_mesh.envs.base import Environment, Observation
from composer_mesh.envs.coding import (
    REFERENCE_CHARS, CodingTask, ListPool, TaskPool, reference_change, render_reference, source_of,
)
from composer_mesh.envs.grading import Grade
from composer_mesh.envs.safeguards import MAX_SCAN_CHARS, TreeTooLarge, manifest, tree_size
from composer_mesh.envs.sandbox import SandboxResult, Workspace
from composer_mesh.envs.tree import MAX_DEPTH, MAX_PATH_CHARS, TreeTooDeep, resolve

logger = logging.getLogger(__name__)
# the largest file write_file makes (characters): every file it writes, the static scan reads whole
_MAX_WRITE = MAX_SCAN_CHARS
# privileged feedback kept per failure (the tail: test runners end with the failing assertion)
_FEEDBACK_CHARS = 4000
_SHELL_META = "|;&<>()"
# tools whose applied call `check_edits` follows with the visible tests
_EDITS = ("edit_file", "write_file")


def _fn(name: str, doc: str, **params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
                "required": [k for k in params if k != "path" or name != "list_dir"],
            },
        },
    }


TOOLS: list[dict[str, Any]] = [
    _fn("read_file", "Read a file of the repository.", path="path relative to the repository root"),
    _fn("write_file", "Create or overwrite a file.", path="path relative to the repository root", content="full text"),
    _fn(
        "edit_file", "Replace the one exact occurrence of old with new in a file.",
        path="path relative to the repository root", old="exact text to replace (must occur once)", new="replacement",
    ),
    _fn("list_dir", "List a directory (default: the root).", path="directory relative to the repository root"),
    _fn("run_tests", "Run the repository's visible tests."),
    _fn("shell", "Run one allowed program with arguments (no pipes or redirection).", command="command line"),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)


def offered_tools(names: Sequence[str]) -> list[dict[str, Any]]:
    """The schemas of `names` (`[env.tool_loop] tools`), in their listed order; unknown names are an error."""
    unknown = [n for n in names if n not in TOOL_NAMES]
    if unknown or not names:
        raise ValueError(f"env.tool_loop.tools: {unknown or 'empty'}; tools: {', '.join(TOOL_NAMES)}")
    by_name = {t["function"]["name"]: t for t in TOOLS}
    return [by_name[n] for n in dict.fromkeys(names)]


def check_verdict(passed: bool, undone: bool = False) -> str:
    """What `[env.tool_loop] check_edits` appends to an applied edit's result."""
    return f"\nvisible tests: {'passed' if passed else 'failed'}" + (EDIT_UNDONE if undone else "")


def system_prompt(names: Sequence[str]) -> str:
    return "You edit a Python repository with tools: " + ", ".join(dict.fromkeys(names)) + "."


class ToolError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ToolLoopEnv(Environment):
    """Episodes over `tasks` (a list cycled by seed, or a source whose `pick(seed)` makes one), graded by the task."""

    def __init__(
        self, tasks: Sequence[CodingTask] | TaskPool, sandbox: SandboxBackend, config: ToolLoopConfig | None = None
    ) -> None:
        super().__init__()
        self.tasks: TaskPool = tasks if hasattr(tasks, "pick") else ListPool(tasks)  # type: ignore[arg-type]
        self.sandbox = sandbox
        self.config = config or ToolLoopConfig()
        self.tool_schemas = offered_tools(self.config.tools)
        self.task: CodingTask | None = None
        self.ws: Workspace | None = None
        self._start_manifest: dict[str, str] = {}
        self._violations: list[tuple[str, str]] = []
        # what the episode has cost so far: edits applied, seconds of check_edits runs, calls refused by bound
        self._edits = 0
        self._checks_s = 0.0
        self._refused: Counter[str] = Counter()
        self._start_size = (0, 0)  # (entries, bytes) of the starting workspace, which the episode may add to
        # the task's reference files, and the starting text of each of their paths (teacher-only context)
        self._reference: dict[str, str] = {}
        self._reference_start: dict[str, str] = {}
        self._wall_s = _wall_timeout_s(sandbox)
        every: dict[str, Callable[..., str]] = {
            "read_file": self._read_file,
            "write_file": self._write_file,
            "edit_file": self._edit_file,
            "list_dir": self._list_dir,
            "run_tests": self._run_tests,
            "shell": self._shell,
        }
        self._tools = {name: every[name] for name in dict.fromkeys(self.config.tools)}

    def _start(self, seed: int | None) -> Observation:
        self.task = self.tasks.pick(seed if seed is not None else random.randrange(1 << 31))
        self.ws = self.task.workspace(self.sandbox)
        try:
            self._start_manifest = manifest(self.ws.path)
            self._start_size = tree_size(self.ws.path)
            self._reference = _reference_files(self.task)
            self._reference_start = {p: _start_text(self.ws.path / p) for p in self._reference}
        except BaseException:
            self._release()
            raise
        self._violations, self._edits, self._checks_s, self._refused = [], 0, 0.0, Counter()
        messages = [
            {"role": "system", "content": system_prompt(self._tools)}, {"role": "user", "content": self.task.prompt()},
        ]
        return Observation(messages, info={"task": self.task.name, "tools": self.tool_schemas})

    def _release(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            ws.cleanup()

    def _answer(self, action: dict[str, Any], turn: int) -> Observation:
        calls = _tool_calls(action)
        messages, sites = [], []
        for index, call in enumerate(calls):
            name, text, kind, feedback = self._apply(call, index)
            messages.append({"role": "tool", "tool_call_id": _call_id(call), "content": text})
            if kind is not None:
                sites.append(ErrorSite(turn, kind, text[:500], tool=name, feedback=feedback[-_FEEDBACK_CHARS:]))
        if calls and self.state.step_count < self.config.max_turns:
            return Observation(messages, error_sites=sites)
        return self._finish(messages, sites)

    def _finish(self, messages: list[dict[str, Any]], sites: list[ErrorSite]) -> Observation:
        assert self.task is not None and self.ws is not None
        task, ws = self.task, self.ws
        found = self._violations
        grade, seconds = self._judged(lambda: task.grade(self.sandbox, ws, self._start_manifest, found), found)
        ws.cleanup()  # the episode is over: free the disk now, whether or not close() is called
        errors = Counter(site.kind.value for site in [*self.state.error_sites, *sites])
        info = {
            "task": task.name, "template": task.template, "source": source_of(task),
            "reason": grade.reason, "violations": list(grade.violations),
            "passed": grade.passed, "total": grade.total, "grade_s": grade.grade_s, "turns": self.state.step_count,
            "tool_errors": dict(errors), "violation_kinds": dict(Counter(reason for reason, _ in grade.violations)),
            "grading_s": round(self._checks_s + seconds, 6), "calls_refused": dict(self._refused),
        }
        if grade.reward < 1.0:
            # teacher-only context of a failed episode (`actors.rollout.failure_sites`): the hidden tests' output,
            # the reference solution, the lines it writes and the hidden cases the workspace failed, as text;
            # nothing of it enters the workspace or the policy's messages
            cases = getattr(task, "failing_cases", None)
            info |= {"feedback": grade.output[-_FEEDBACK_CHARS:], "reference": render_reference(self._reference),
                     "reference_change": reference_change(self._reference_start, self._reference)[:REFERENCE_CHARS],
                     "failing_cases": _teacher_text(cases, grade)}
        return Observation(messages, reward=grade.reward, done=True, error_sites=sites, info=info)

    def _apply(self, call: Any, index: int) -> tuple[str, str, ErrorKind | None, str]:
        """(tool name, result text, error kind or None, teacher feedback) of the message's `index`-th call: refused
        past a bound, else run."""
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        name = fn.get("name") if isinstance(fn.get("name"), str) else ""
        raw = fn.get("arguments") or "{}"
        self._watch(name, _argument_text(raw))
        bound = self._bound(name, index)
        if bound is not None:
            self._refused[bound[0]] += 1
            text = self._clip(f"error: {name}: not run: {bound[1]}")
            return name, text, ErrorKind.BAD_TOOL_CALL, text
        return (name, *self._run(name, raw))

    def _bound(self, name: str, index: int) -> tuple[str, str] | None:
        """(bound, why) when the call must not run: past the calls of a message, the edits of an episode, or an
        edit whose check the grading budget cannot cover along with the final grade; None: it may run."""
        cfg = self.config
        if index >= cfg.max_calls_per_message:
            return "calls_per_message", f"at most {cfg.max_calls_per_message} tool calls run per message"
        if name not in _EDITS or name not in self._tools:
            return None
        if self._edits >= cfg.max_edits_per_episode:
            return "edits_per_episode", f"at most {cfg.max_edits_per_episode} edits are applied per episode"
        budget = cfg.grading_budget * self._wall_s
        if self._checked() and self._checks_s + 2 * self._wall_s > budget:
            return "grading_budget", (
                f"the episode's grading time is bounded by {budget:g} s ({self._checks_s:.1f} s spent on checks), "
                f"too little left to check another edit and grade the episode"
            )
        return None

    def _checked(self) -> bool:
        """Applied edits are followed by the visible tests (`check_edits` on, and a task that has them)."""
        return self.config.check_edits != "off" and hasattr(self.task, "check")

    def _run(self, name: str, raw: Any) -> tuple[str, ErrorKind | None, str]:
        """(result text, error kind or None, teacher feedback) of a call within the bounds; an applied edit is
        counted and, with `check_edits`, checked."""
        try:
            args = self._arguments(name, raw)
        except ToolError as exc:
            text = self._clip(f"error: {exc}")
            return text, exc.kind, text
        reverts = self._checked() and self.config.check_edits == "revert" and name in _EDITS
        before = self._before(args) if reverts else None
        text, kind = self._invoke(name, args)
        if kind is not None or name not in _EDITS:
            return text, kind, text
        self._edits += 1
        return self._check(text, before) if self._checked() else (text, None, text)

    def _arguments(self, name: str, raw: Any) -> dict[str, Any]:
        """The call's arguments as keywords of the tool `name`; ToolError (bad_tool_call) for an unknown tool,
        arguments that are not a JSON object, a string argument that is not valid UTF-8 text, or names the
        tool does not take."""
        if name not in self._tools:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"unknown tool {name!r}; tools: {', '.join(self._tools)}")
        try:
            args = json.loads(raw) if isinstance(raw, str) else dict(raw)
        except (ValueError, TypeError, RecursionError) as exc:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{name}: arguments are not a JSON object ({exc})") from None
        if not isinstance(args, dict):
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{name}: arguments must be a JSON object")
        for key, value in args.items():
            problem = _invalid_text(value) if isinstance(value, str) else ""
            if problem:
                raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{name}: argument {key!r} {problem}; nothing was done")
        try:
            inspect.signature(self._tools[name]).bind(**args)
        except TypeError as exc:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{name}: bad arguments ({exc})") from None
        return args

    def _invoke(self, name: str, args: dict[str, Any]) -> tuple[str, ErrorKind | None]:
        """(result text, error kind or None) of running the tool; whatever it raises is the call's error."""
        try:
            return self._clip(self._tools[name](**args)), None
        except ToolError as exc:
            return self._clip(f"error: {exc}"), exc.kind
        except Exception as exc:  # what the workspace's files made a tool raise: this call's error, not the batch's
            kind, why = _failure(exc)
            return self._clip(f"error: {name}: {why}"), kind

    def _check(self, text: str, before: tuple[Path, bytes | None] | None) -> tuple[str, ErrorKind | None, str]:
        """An applied edit's result with the visible tests' verdict (`check_edits`), its time counted against
        the grading budget; under "revert" a failing edit is undone."""
        assert self.task is not None and self.ws is not None
        task, ws = self.task, self.ws
        check_now = task.check  # type: ignore[attr-defined]
        check, seconds = self._judged(lambda: check_now(self.sandbox, ws, self._start_manifest))
        self._checks_s += seconds
        passed = check.reason == "passed"
        undone = not passed and before is not None and _restore(*before)
        text += check_verdict(passed, undone=undone)
        # the model sees the verdict only; the teacher also reads what failed
        return (text, None, text) if passed else (text, ErrorKind.TEST_FAILURE, check.output)

    def _judged(self, judge: Callable[[], Grade], violations: Sequence[tuple[str, str]] = ()) -> tuple[Grade, float]:
        """(`judge()`, the seconds it took), judged only while the workspace is within its bounds (`_bounded`):
        a workspace past them, or a judge that raised, is a grade of 0 naming why after `violations`."""
        began = time.perf_counter()
        try:
            self._bounded()
            return judge(), time.perf_counter() - began
        except Exception as exc:
            seconds = time.perf_counter() - began
            return _failed_grade(exc, violations, seconds), seconds

    def _bounded(self) -> None:
        """TreeTooLarge when the episode added more than `max_added_files` entries or `max_added_mb` MiB to its
        workspace, TreeTooDeep past `envs.tree`'s bounds: what a grade reads stays bounded."""
        assert self.ws is not None
        entries, size = self._start_size
        tree_size(self.ws.path, entries + self.config.max_added_files, size + (self.config.max_added_mb << 20))

    def _before(self, args: dict[str, Any]) -> tuple[Path, bytes | None] | None:
        """(file an edit names, its bytes now or None when absent), to undo the edit; None: nothing to undo."""
        try:
            real = self._resolve(args.get("path"))
            if not real.exists():
                return real, None
            return (real, real.read_bytes()) if stat.S_ISREG(real.stat().st_mode) else None
        except (ToolError, OSError, ValueError, RecursionError):
            return None  # the edit itself fails on the same path, and says why

    def _watch(self, name: str, raw: str) -> None:
        """Record an attempt to reach the hidden tests or the pristine copy (graded as 0)."""
        assert self.task is not None
        # tasks that keep hidden tests or a pristine copy on this host name them (a container task keeps neither)
        pristine = getattr(self.task, "pristine", None)
        targets = [str(pristine)] * (pristine is not None) + list(getattr(self.task, "hidden_tests", ()))
        hit = next((t for t in targets if t in raw), None)
        if hit is not None:
            self._violations.append(("reads_hidden_tests", f"{name}: {hit}"))

    def _clip(self, text: str) -> str:
        n = self.config.tool_output_chars
        return text if len(text) <= n else text[: n // 2] + "\n...[truncated]...\n" + text[-n // 2 :]

    def _resolve(self, path: str) -> Path:
        """The real path (symlinks resolved) `path` names in the workspace; refused unless it is a non-empty
        string without NUL bytes, inside the workspace, and within `envs.tree`'s depth and length bounds."""
        assert self.ws is not None
        if not isinstance(path, str) or not path:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, "path must be a non-empty string")
        if "\x00" in path:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, "path contains a NUL byte, which no file name can hold")
        if len(path) > MAX_PATH_CHARS:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"path longer than {MAX_PATH_CHARS} characters")
        root = Path(os.path.realpath(self.ws.path))
        try:
            real = Path(resolve(root / path))
        except OSError as exc:  # a symlink loop, or a chain longer than the kernel follows
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{path}: {exc.strerror}") from None
        if real != root and root not in real.parents:
            raise ToolError(ErrorKind.PERMISSION, f"{path}: outside the repository")
        rel = real.relative_to(root)
        if len(rel.parts) > MAX_DEPTH + 1 or len(str(rel)) >= MAX_PATH_CHARS:  # what `envs.tree.walk` refuses
            raise ToolError(
                ErrorKind.BAD_TOOL_CALL,
                f"{path}: deeper than {MAX_DEPTH} directories or longer than {MAX_PATH_CHARS} characters",
            )
        return real

    def _regular(self, path: str) -> Path:
        """The regular file `path` names (FILE_NOT_FOUND when absent; a directory, FIFO, socket is refused)."""
        real = self._resolve(path)
        if not real.exists():
            raise ToolError(ErrorKind.FILE_NOT_FOUND, f"{path}: no such file")
        if not stat.S_ISREG(real.stat().st_mode):
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{path}: not a regular file")
        return real

    def _read_file(self, path: str) -> str:
        return self._regular(path).read_text(errors="replace")

    def _write_file(self, path: str, content: str) -> str:
        assert self.ws is not None
        real = self._resolve(path)
        if not isinstance(content, str) or len(content) > _MAX_WRITE:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"content must be a string of at most {_MAX_WRITE} characters")
        if real.exists() and not stat.S_ISREG(real.stat().st_mode):
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{path}: not a regular file")
        data = content.encode("utf-8")  # before anything is touched: text that cannot be written changes nothing
        new_dirs = [d for d in [real.parent, *real.parent.parents] if not d.exists()]
        try:
            real.parent.mkdir(parents=True, exist_ok=True)
            _write_bytes(real, data)
        finally:
            for p in [real, *new_dirs]:  # the sandbox uid owns what the agent writes (what was made of it too)
                if os.path.lexists(p):
                    os.lchown(p, self.ws.uid, self.ws.uid)
        return f"wrote {len(content)} characters to {path}"

    def _edit_file(self, path: str, old: str, new: str) -> str:
        """Exact-string replace of the one occurrence of `old` (an edit that is missing or ambiguous changes nothing,
        nor does one of a file that is not UTF-8 text)."""
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, "edit_file: old must be a non-empty string and new a string")
        data = self._regular(path).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            why = f"{path}: not UTF-8 text (byte {exc.start}); use write_file"
            raise ToolError(ErrorKind.BAD_TOOL_CALL, why) from None
        count = text.count(old)
        if count == 0:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{path}: string to replace not found (old must match exactly)")
        if count > 1:
            raise ToolError(
                ErrorKind.BAD_TOOL_CALL, f"{path}: string to replace found {count} times; add context to make it unique"
            )
        self._write_file(path, text.replace(old, new, 1))
        return f"edited {path}"

    def _list_dir(self, path: str = ".") -> str:
        real = self._resolve(path)
        if not real.is_dir():
            raise ToolError(ErrorKind.FILE_NOT_FOUND, f"{path}: no such directory")
        return "\n".join(sorted(_shown(p.name) + ("/" if p.is_dir() else "") for p in real.iterdir())) or "(empty)"

    def _run_tests(self) -> str:
        assert self.ws is not None
        argv = [self.sandbox.python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "--tb=short"]
        result = self.sandbox.run(argv, self.ws, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
        text = (result.stdout + result.stderr).strip()
        if result.exit_code == 0 and not result.violations:
            return text
        kind = _result_kind(result, default=ErrorKind.TEST_FAILURE, file_errors=False)
        raise ToolError(kind, text or f"exit {result.exit_code}")

    def _shell(self, command: str) -> str:
        assert self.ws is not None
        if not isinstance(command, str) or not command.strip():
            raise ToolError(ErrorKind.BAD_TOOL_CALL, "command must be a non-empty string")
        if "\x00" in command:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, "command contains a NUL byte, which no argument can hold")
        try:  # no shell runs the command; operators outside quotes are refused so the model learns that
            lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            argv = list(lexer)
        except ValueError as exc:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"cannot parse command: {exc}") from None
        if not argv:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, "command holds no program to run (only a comment)")
        if any(tok and set(tok) <= set(_SHELL_META) for tok in argv):
            raise ToolError(ErrorKind.BAD_TOOL_CALL, "restricted shell: no pipes, redirection, chaining or substitution")
        if argv[0] not in self.config.shell_commands:
            raise ToolError(
                ErrorKind.COMMAND_NOT_FOUND,
                f"{argv[0]}: command not found (allowed: {', '.join(self.config.shell_commands)})",
            )
        if argv[0] == "python":
            argv[0] = self.sandbox.python()
        result = self.sandbox.run(argv, self.ws)
        text = (result.stdout + result.stderr).strip()
        if result.exit_code == 0 and not result.violations:
            return text or "(no output)"
        raise ToolError(_result_kind(result, default=ErrorKind.OTHER), text or f"exit {result.exit_code}")


def _reference_files(task: CodingTask) -> dict[str, str]:
    """The task's reference files ({} when reading them raised, logged: teacher context never fails an episode)."""
    try:
        return task.reference_files()
    except Exception:
        logger.warning("reading the reference files of %s raised", task.name, exc_info=True)
        return {}


def _start_text(path: Path) -> str:
    """The text of a starting file of the workspace ('' when the task's reference adds it)."""
    return path.read_text(errors="replace") if path.is_file() else ""


def _teacher_text(make: Callable[[Grade], str] | None, grade: Grade) -> str:
    """`make(grade)` cut to `_FEEDBACK_CHARS` (the task's failing hidden cases); '' for a task without them or
    when reading them failed (logged: teacher context never fails an episode)."""
    if make is None:
        return ""
    try:
        return make(grade)[:_FEEDBACK_CHARS]
    except Exception:
        logger.warning("reading the failing hidden cases raised", exc_info=True)
        return ""


def _wall_timeout_s(backend: SandboxBackend) -> float:
    """The backend's `[env.sandbox] wall_timeout_s` (a backend without a sandbox config: the default)."""
    return float(getattr(getattr(backend, "config", None), "wall_timeout_s", SandboxConfig().wall_timeout_s))


def _tool_calls(action: dict[str, Any]) -> list[Any]:
    """The message's tool calls; a `tool_calls` that is not a list is one malformed call."""
    calls = action.get("tool_calls") or []
    return calls if isinstance(calls, list) else [calls]


def _call_id(call: Any) -> str:
    return str(call.get("id", "")) if isinstance(call, dict) else ""


def _argument_text(raw: Any) -> str:
    """The text of a call's arguments the hidden-test watch searches (a JSON string, or an object's strings)."""
    if isinstance(raw, dict):
        return " ".join(v for v in raw.values() if isinstance(v, str))
    return raw if isinstance(raw, str) else ""


def _shown(name: str) -> str:
    """A file name as text: the bytes of one that is not UTF-8 (which a program can make) as `\\xNN` escapes."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _invalid_text(text: str) -> str:
    """Why `text` cannot be written as UTF-8 ('' when it can): its first lone surrogate, which a JSON escape
    such as "\\ud800" puts in a string."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"holds a lone surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}), not UTF-8 text"
    return ""


def _failure(exc: Exception) -> tuple[ErrorKind, str]:
    """The error kind and words of what a tool raised on a workspace a policy shaped: the file system's answer
    (missing, not permitted, a symlink loop, a name too long), or a tree or link chain too deep to follow.
    Anything else is logged with its traceback: a tool should not raise it."""
    if isinstance(exc, OSError):
        why = exc.strerror or str(exc)
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return ErrorKind.FILE_NOT_FOUND, why
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return ErrorKind.PERMISSION, why
        return ErrorKind.BAD_TOOL_CALL, why
    if isinstance(exc, ValueError):  # TreeTooDeep, text that cannot be encoded
        return ErrorKind.BAD_TOOL_CALL, str(exc)
    if isinstance(exc, RecursionError):
        return ErrorKind.BAD_TOOL_CALL, "nested too deeply to follow (a chain of links or directories)"
    logger.warning("a tool raised %s", type(exc).__name__, exc_info=exc)
    return ErrorKind.OTHER, f"{type(exc).__name__}: {exc}"


def _failed_grade(exc: Exception, violations: Sequence[tuple[str, str]], seconds: float) -> Grade:
    """Reward 0 for a grade (or check) that raised: `deep_tree` for a tree past `envs.tree`'s bounds,
    `large_tree` for one past the episode's size bounds, else `grader_error` (logged with its traceback), after
    the episode's own violations."""
    if isinstance(exc, TreeTooDeep):
        reason = "deep_tree"
    elif isinstance(exc, TreeTooLarge):
        reason = "large_tree"
    else:
        reason = "grader_error"
        logger.warning("grading raised %s", type(exc).__name__, exc_info=exc)
    detail = f"{type(exc).__name__}: {exc}"
    found = tuple(dict.fromkeys([*violations, (reason, detail)]))
    return Grade(0.0, found[0][0], 0, 0, found, output=f"{reason}: {detail}", grade_s=round(seconds, 6))


def _restore(real: Path, data: bytes | None) -> bool:
    """Put an edited file back as `ToolLoopEnv._before` found it (a file the edit made is removed); False when
    the file system refused."""
    try:
        if data is None:
            real.unlink(missing_ok=True)
        else:
            _write_bytes(real, data)
    except OSError:
        return False
    return True


def _write_bytes(real: Path, data: bytes) -> None:
    """Write `data` to `real` without following a symlink there (a new file gets mode 0644)."""
    fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _result_kind(result: SandboxResult, default: ErrorKind, file_errors: bool = True) -> ErrorKind:
    """The error kind of a failed program run, from its limits and its error text.

    file_errors: also classify missing files and permissions (not for test runs,
    whose output quotes whatever the tests exercise).
    """
    text = result.stdout + result.stderr
    if result.timed_out or "cpu_time_limit" in result.violations:
        return ErrorKind.TIMEOUT
    if "SyntaxError" in text or "IndentationError" in text:
        return ErrorKind.SYNTAX
    if not file_errors:
        return default
    if "No such file" in text or "FileNotFoundError" in text:
        return ErrorKind.FILE_NOT_FOUND
    if "Permission denied" in text or "Read-only file system" in text:
        return ErrorKind.PERMISSION
    return default
