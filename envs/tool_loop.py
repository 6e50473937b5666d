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
"""

from __future__ import annotations

import json
import os
import random
import shlex
import stat
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from composer_mesh.configs.records import EDIT_UNDONE, ErrorKind, ErrorSite
from composer_mesh.configs.sections.env import ToolLoopConfig
from composer_mesh.envs.backend import SandboxBackend
from composer_mesh.envs.base import Environment, Observation
from composer_mesh.envs.coding import CodingTask, ListPool, TaskPool, render_reference, source_of
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.sandbox import SandboxResult, Workspace

_MAX_WRITE = 1 << 20
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
        self._start_manifest = manifest(self.ws.path)
        self._violations = []
        messages = [
            {"role": "system", "content": system_prompt(self._tools)}, {"role": "user", "content": self.task.prompt()},
        ]
        return Observation(messages, info={"task": self.task.name, "tools": self.tool_schemas})

    def close(self) -> None:
        if self.ws is not None:
            self.ws.cleanup()
            self.ws = None

    def _answer(self, action: dict[str, Any], turn: int) -> Observation:
        calls = action.get("tool_calls") or []
        messages, sites = [], []
        checked = self.config.check_edits != "off" and hasattr(self.task, "check")
        for call in calls:
            reverts = checked and self.config.check_edits == "revert" and (call.get("function") or {}).get("name") in _EDITS
            before = self._before(call) if reverts else None
            name, text, kind = self._call(call)
            # the whole result is privileged feedback for the teacher; the model saw it in the tool message
            feedback = text
            if kind is None and name in _EDITS and checked:
                check = self.task.check(self.sandbox, self.ws, self._start_manifest)
                passed = check.reason == "passed"
                if not passed and before is not None:
                    self._restore(*before)
                text += check_verdict(passed, undone=not passed and before is not None)
                # the model sees the verdict only; the teacher also reads what failed
                kind, feedback = (None, text) if passed else (ErrorKind.TEST_FAILURE, check.output)
            messages.append({"role": "tool", "tool_call_id": str(call.get("id", "")), "content": text})
            if kind is not None:
                sites.append(ErrorSite(turn=turn, kind=kind, message=text[:500], tool=name, feedback=feedback[-_FEEDBACK_CHARS:]))
        if calls and self.state.step_count < self.config.max_turns:
            return Observation(messages, error_sites=sites)
        return self._finish(messages, sites)

    def _finish(self, messages: list[dict[str, Any]], sites: list[ErrorSite]) -> Observation:
        assert self.task is not None and self.ws is not None
        grade = self.task.grade(self.sandbox, self.ws, self._start_manifest, self._violations)
        self.ws.cleanup()  # the episode is over: free the disk now, whether or not close() is called
        errors = Counter(site.kind.value for site in [*self.state.error_sites, *sites])
        info = {
            "task": self.task.name, "template": self.task.template, "source": source_of(self.task),
            "reason": grade.reason, "violations": list(grade.violations),
            "passed": grade.passed, "total": grade.total, "grade_s": grade.grade_s, "turns": self.state.step_count,
            "tool_errors": dict(errors), "violation_kinds": dict(Counter(reason for reason, _ in grade.violations)),
        }
        if grade.reward < 1.0:
            # teacher-only context of a failed episode (`actors.rollout.failure_sites`): the hidden tests' output
            # and the reference solution, as text; nothing of it enters the workspace or the policy's messages
            info |= {"feedback": grade.output[-_FEEDBACK_CHARS:], "reference": render_reference(self.task.reference_files())}
        return Observation(messages, reward=grade.reward, done=True, error_sites=sites, info=info)

    def _before(self, call: dict[str, Any]) -> tuple[Path, str | None] | None:
        """(file an edit call names, its text now or None when absent), to undo the edit; None: nothing to undo."""
        try:
            args = json.loads((call.get("function") or {}).get("arguments") or "{}")
            real = self._resolve(args["path"]) if isinstance(args, dict) else None
        except (json.JSONDecodeError, TypeError, KeyError, ToolError):
            return None
        if real is None or (real.exists() and not stat.S_ISREG(real.stat().st_mode)):
            return None
        return real, real.read_text(errors="replace") if real.exists() else None

    def _restore(self, real: Path, text: str | None) -> None:
        """Put an edited file back as `_before` found it (as the workspace's uid; a file the edit made is removed)."""
        assert self.ws is not None
        if text is None:
            real.unlink(missing_ok=True)
            return
        _write_text(real, text)

    def _call(self, call: dict[str, Any]) -> tuple[str, str, ErrorKind | None]:
        """(tool name, result text, error kind or None) for one tool call."""
        fn = call.get("function") or {}
        name = str(fn.get("name", ""))
        raw = fn.get("arguments") or "{}"
        self._watch(name, str(raw))
        try:
            if name not in self._tools:
                raise ToolError(ErrorKind.BAD_TOOL_CALL, f"unknown tool {name!r}; tools: {', '.join(self._tools)}")
            try:
                args = json.loads(raw) if isinstance(raw, str) else dict(raw)
            except (json.JSONDecodeError, TypeError, ValueError) as exc:
                raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{name}: arguments are not a JSON object ({exc})") from None
            if not isinstance(args, dict):
                raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{name}: arguments must be a JSON object")
            try:
                text = self._tools[name](**args)
            except TypeError as exc:
                raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{name}: bad arguments ({exc})") from None
            return name, self._clip(text), None
        except ToolError as exc:
            return name, self._clip(f"error: {exc}"), exc.kind

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
        assert self.ws is not None
        if not isinstance(path, str) or not path:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, "path must be a non-empty string")
        root = Path(os.path.realpath(self.ws.path))
        real = Path(os.path.realpath(root / path))
        if real != root and root not in real.parents:
            raise ToolError(ErrorKind.PERMISSION, f"{path}: outside the repository")
        return real

    def _read_file(self, path: str) -> str:
        real = self._resolve(path)
        if not real.exists():
            raise ToolError(ErrorKind.FILE_NOT_FOUND, f"{path}: no such file")
        if not stat.S_ISREG(real.stat().st_mode):
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{path}: not a regular file")
        return real.read_text(errors="replace")

    def _write_file(self, path: str, content: str) -> str:
        assert self.ws is not None
        real = self._resolve(path)
        if not isinstance(content, str) or len(content) > _MAX_WRITE:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"content must be a string of at most {_MAX_WRITE} characters")
        if real.exists() and not stat.S_ISREG(real.stat().st_mode):
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"{path}: not a regular file")
        new_dirs = [d for d in [real.parent, *real.parent.parents] if not d.exists()]
        real.parent.mkdir(parents=True, exist_ok=True)
        _write_text(real, content)
        for p in [real, *new_dirs]:  # the sandbox uid owns what the agent writes
            os.lchown(p, self.ws.uid, self.ws.uid)
        return f"wrote {len(content)} characters to {path}"

    def _edit_file(self, path: str, old: str, new: str) -> str:
        """Exact-string replace of the one occurrence of `old` (an edit that is missing or ambiguous changes nothing)."""
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, "edit_file: old must be a non-empty string and new a string")
        text = self._read_file(path)
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
        return "\n".join(sorted(p.name + ("/" if p.is_dir() else "") for p in real.iterdir())) or "(empty)"

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
        try:  # no shell runs the command; operators outside quotes are refused so the model learns that
            lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            argv = list(lexer)
        except ValueError as exc:
            raise ToolError(ErrorKind.BAD_TOOL_CALL, f"cannot parse command: {exc}") from None
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


def _write_text(real: Path, text: str) -> None:
    """Write `text` to `real` without following a symlink there (a new file gets mode 0644)."""
    fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


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
