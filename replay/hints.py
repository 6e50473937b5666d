"""Error sites → hints for the hint-distillation channel.

`classify_error` names what went wrong in a failed tool call; a `HintGenerator`
writes the hint for an `ErrorSite`: a fixed template per error kind, the
environment's privileged feedback on the failure (SDPO), the task's reference
solution (OPSD), the first lines the reference writes (a share adapted per task,
AdaBack-style), the hidden tests the attempt failed, or a teacher model's advice
through the teacher client; `make_hint_generator` picks one from
`[loss.distill] hint_kind`. A site without the privileged field a kind needs gets
the environment's feedback instead, counted in the generator's `fallbacks`. `insert_hint`
places the hint right after the failed call's results, and `hint_token_spans`
tells the trainer which tokens of the hinted context are the hint so the rest
can be aligned to the student's tokens (the teacher is the policy *with* the
hint, the student *without*).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from composer_mesh.configs.records import ErrorKind, ErrorSite
from composer_mesh.configs.sections.loss import HINT_KINDS, DistillLossConfig
from composer_mesh.configs.sections.teachers import TeachersConfig
from composer_mesh.replay.teachers import SyncTeacherClient

# Checked in order: the first kind whose pattern matches wins (timeouts and bad
# calls first: their messages often also mention files or commands).
_PATTERNS: tuple[tuple[ErrorKind, re.Pattern], ...] = tuple(
    (kind, re.compile(pattern, re.IGNORECASE))
    for kind, pattern in (
        (ErrorKind.TIMEOUT, r"timed? ?out|timeout|deadline exceeded|took too long"),
        (
            ErrorKind.BAD_TOOL_CALL,
            r"unknown tool|no such tool|tool .* (?:not found|does not exist|is not available)|"
            r"inputvalidationerror|invalid (?:tool )?(?:arguments|parameters|input)|"
            r"missing required (?:parameter|argument|field)|unexpected (?:keyword )?argument|"
            r"string to replace not found|has not been read yet|must read .* before",
        ),
        (
            ErrorKind.SYNTAX,
            r"syntaxerror|indentationerror|taberror|syntax error|parse error|unexpected token|"
            r"unexpected eof|unterminated string|invalid syntax",
        ),
        (
            ErrorKind.TEST_FAILURE,
            r"\b\d+ failed\b|\bfailed\b.*\bpassed\b|tests? failed|assertionerror|^FAIL[: ]|"
            r"\bFAILED\b|failures?=\d|test suite failed",
        ),
        (
            ErrorKind.COMMAND_NOT_FOUND,
            r"command not found|not recognized as an internal or external command|"
            r"executable file not found|no such command|unknown command",
        ),
        (ErrorKind.PERMISSION, r"permission denied|permissionerror|eacces|eperm|operation not permitted|read-only file system"),
        (
            ErrorKind.FILE_NOT_FOUND,
            r"no such file or directory|filenotfounderror|file does not exist|file not found|enoent|"
            r"cannot find the (?:file|path)|path does not exist|does not exist",
        ),
    )
)


def classify_error(message: str, tool: str = "") -> ErrorKind:
    """The `ErrorKind` of a failed tool call, from its error text (and tool name)."""
    for kind, pattern in _PATTERNS:
        if pattern.search(message):
            return kind
    if tool and re.search(r"not (?:found|available)|unknown", message, re.IGNORECASE):
        return ErrorKind.BAD_TOOL_CALL
    return ErrorKind.OTHER


class HintGenerator(Protocol):
    """Writes a short hint for a failed tool call, given the conversation so far."""

    def hint(self, site: ErrorSite, messages: Sequence[dict]) -> str: ...


_TEMPLATES: dict[ErrorKind, str] = {
    ErrorKind.COMMAND_NOT_FOUND: "The command you ran{tool} does not exist in this environment. "
    "Check which tools are installed, or use an equivalent command that is available.",
    ErrorKind.FILE_NOT_FOUND: "The path you used{tool} does not exist. List the directory or search "
    "for the file first, and use the exact path you find.",
    ErrorKind.PERMISSION: "The call{tool} was refused for lack of permission. Work inside a directory "
    "you can write to, or choose an action that needs no extra rights.",
    ErrorKind.SYNTAX: "The code or command{tool} has a syntax error. Read the reported line carefully "
    "and fix the syntax before running it again.",
    ErrorKind.TIMEOUT: "The call{tool} timed out. Make the operation smaller or faster, or avoid a "
    "command that waits for input.",
    ErrorKind.TEST_FAILURE: "Tests failed{tool}. Read the first failing assertion, find the code it "
    "exercises, and fix that behaviour rather than the test.",
    ErrorKind.BAD_TOOL_CALL: "The tool call{tool} was malformed: the tool does not exist or its "
    "arguments are wrong. Check the tool's name and required arguments.",
    ErrorKind.OTHER: "The previous call{tool} failed. Read the error message and change your approach "
    "instead of repeating the same call.",
}


class TemplateHintGenerator:
    """A fixed hint per error kind, with the error's first line quoted. No network."""

    def __init__(self, quote_chars: int = 200) -> None:
        self.quote_chars = quote_chars

    def hint(self, site: ErrorSite, messages: Sequence[dict]) -> str:
        text = _TEMPLATES[site.kind].format(tool=f" ({site.tool})" if site.tool else "")
        first_line = next((ln.strip() for ln in site.message.splitlines() if ln.strip()), "")
        if first_line:
            text += f' The error was: "{first_line[: self.quote_chars]}".'
        return text


class FeedbackHintGenerator:
    """The environment's feedback on the failed attempt, as privileged context (SDPO's self-teacher).

    The teacher reads it right before the attempt it re-scores: the failing tests' output, expected vs got,
    the tool's whole error (`site.feedback`, else the error as the model saw it). Long feedback keeps its
    last `max_chars` characters (runners end with the failing assertion).
    """

    def __init__(self, max_chars: int = 2000) -> None:
        self.max_chars = max_chars

    def hint(self, site: ErrorSite, messages: Sequence[dict]) -> str:
        feedback = (site.feedback or site.message).strip()[-self.max_chars :]
        tool = f" ({site.tool})" if site.tool else ""
        return f"Feedback from the environment on your attempt at this step{tool}:\n{feedback}\n" \
               "Take it into account and reply correctly."


def reference_note(reference: str) -> str:
    """The hint that hands the teacher a task's reference solution (`reference`: its files as text)."""
    return f"Here is a reference solution for this task:\n{reference}\nUse it to reply correctly."


def change_note(change: str, shown: int | None = None) -> str:
    """The hint that hands the teacher the lines a reference solution writes (`ErrorSite.change`: a `--- path`
    line per file, then its lines), or only the first `shown` of those lines (the `--- path` lines kept)."""
    lines = change.splitlines()
    written = [i for i, line in enumerate(lines) if not line.startswith("--- ")]
    if shown is None or shown >= len(written):
        return f"Here are the lines a reference solution writes:\n{change.rstrip()}\nUse them to reply correctly."
    head = "\n".join(lines[: written[shown - 1] + 1] if shown > 0 else lines[: written[0]])
    return (f"Here are the first {shown} of the {len(written)} lines a reference solution writes:\n{head}\n"
            "Use them to reply correctly.")


def cases_note(cases: str) -> str:
    """The hint that hands the teacher hidden test cases the attempt failed (`ErrorSite.cases`: their source)."""
    return f"Hidden tests of this task that your attempt fails:\n{cases.rstrip()}\nUse them to reply correctly."


class _SiteFieldHintGenerator:
    """A note (`note`) made of one privileged field of the error site (`field`), cut to its first `max_chars`
    characters; a site without it gets the fallback's hint (feedback by default), counted in `fallbacks`."""

    field = ""
    note: Callable[[str], str]

    def __init__(self, max_chars: int = 2000, fallback: HintGenerator | None = None) -> None:
        self.max_chars = max_chars
        self.fallback = fallback or FeedbackHintGenerator(max_chars)
        self.fallbacks = 0  # how many hints came from the fallback

    def hint(self, site: ErrorSite, messages: Sequence[dict]) -> str:
        text = str(getattr(site, self.field)).strip()[: self.max_chars]
        if not text:
            self.fallbacks += 1
            return self.fallback.hint(site, messages)
        return self.note(text)


class ReferenceHintGenerator(_SiteFieldHintGenerator):
    """The task's reference solution or answer, as privileged context (OPSD's teacher p(. | x, y*)):
    `site.reference` (the demo's correct answer, a coding task's reference files)."""

    field = "reference"
    note = staticmethod(reference_note)


def written_lines(change: str) -> int:
    """How many lines a change (`ErrorSite.change`) writes: its lines other than the `--- path` ones."""
    return sum(not line.startswith("--- ") for line in change.splitlines())


class ReferencePrefixHintGenerator:
    """The first lines a task's reference solution writes (`change_note`), as many as the task needs.

    Per task a share s of the change's n written lines is shown, k = ceil(s·n) lines: s starts at `start`,
    grows by `step` after a group of the task where every sample failed and shrinks by `step` after a group
    with a pass, within [0, 1] (`observe`; AdaBack's per-sample revealed fraction). `for_task(task)` is the
    task's generator; `hint` itself shows a task not seen yet. The shares are the run's state
    (`state_dict`). A site without a change gets the fallback's hint (feedback by default), counted.
    """

    def __init__(self, start: float = 0.5, step: float = 0.25, max_chars: int = 2000,
                 fallback: HintGenerator | None = None) -> None:
        self.start, self.step, self.max_chars = start, step, max_chars
        self.fallback = fallback or FeedbackHintGenerator(max_chars)
        self.shares: dict[str, float] = {}
        self.fallbacks = 0  # how many hints came from the fallback

    def share(self, task: str) -> float:
        return self.shares.get(task, self.start)

    def observe(self, task: str, solved: bool) -> None:
        """One group of `task`: fewer lines after a pass, more after a group that failed every sample."""
        self.shares[task] = min(1.0, max(0.0, self.share(task) + (-self.step if solved else self.step)))

    def for_task(self, task: str) -> HintGenerator:
        return _TaskPrefix(self, task)

    def hint(self, site: ErrorSite, messages: Sequence[dict]) -> str:
        return self.hint_for(None, site, messages)

    def hint_for(self, task: str | None, site: ErrorSite, messages: Sequence[dict]) -> str:
        change = site.change.strip()[: self.max_chars]
        total = written_lines(change)
        if not total:
            self.fallbacks += 1
            return self.fallback.hint(site, messages)
        share = self.start if task is None else self.share(task)
        return change_note(change, math.ceil(share * total))

    def state_dict(self) -> dict[str, float]:
        return dict(self.shares)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.shares = dict(state)


@dataclass(frozen=True)
class _TaskPrefix:
    """`ReferencePrefixHintGenerator` bound to one task."""

    owner: ReferencePrefixHintGenerator
    task: str

    def hint(self, site: ErrorSite, messages: Sequence[dict]) -> str:
        return self.owner.hint_for(self.task, site, messages)


class FailingTestHintGenerator(_SiteFieldHintGenerator):
    """The hidden test cases the attempt failed (`cases_note` of `site.cases`): what to make pass, without the
    solution."""

    field = "cases"
    note = staticmethod(cases_note)


class SyncCompleter(Protocol):
    """What `LLMHintGenerator` needs from a client: a blocking chat completion."""

    def complete(self, teacher: str, messages: list[dict]) -> Any: ...


_HINT_SYSTEM = (
    "You are a mentor for a coding agent. The agent's last tool call failed. "
    "Write a hint of at most two sentences that helps it recover. Do not write the full "
    "solution, do not repeat the error verbatim, do not mention that you are a mentor."
)


class LLMHintGenerator:
    """A teacher model writes the hint, through the teacher client (cache, budget, retries).

    client: anything with `complete(teacher, messages)` returning a `TeacherReply`
    (`replay.teachers.SyncTeacherClient`). When the call fails or the budget is
    spent, the fallback generator's hint is used, so a hint is always returned.
    """

    def __init__(
        self,
        client: SyncCompleter,
        teacher: str,
        *,
        context_messages: int = 6,
        fallback: HintGenerator | None = None,
    ) -> None:
        self.client = client
        self.teacher = teacher
        self.context_messages = context_messages
        self.fallback = fallback or TemplateHintGenerator()
        self.fallbacks = 0  # how many hints came from the fallback

    def prompt(self, site: ErrorSite, messages: Sequence[dict]) -> list[dict]:
        """The request: recent conversation, the failed call and its error."""
        window = messages[max(0, site.turn - self.context_messages + 1) : site.turn + 1]
        recent = [{k: m[k] for k in ("role", "content", "tool_calls") if m.get(k)} for m in window]
        body = (
            f"Conversation (most recent last):\n{json.dumps(recent, ensure_ascii=False, indent=1)}\n\n"
            f"Failed tool: {site.tool or 'unknown'}\nError kind: {site.kind.value}\n"
            f"Error message:\n{site.feedback or site.message}\n\nHint:"
        )
        return [{"role": "system", "content": _HINT_SYSTEM}, {"role": "user", "content": body}]

    def hint(self, site: ErrorSite, messages: Sequence[dict]) -> str:
        reply = self.client.complete(self.teacher, self.prompt(site, messages))
        text = (reply.message or {}).get("content") if reply.error is None else None
        if not text or not text.strip():
            self.fallbacks += 1
            return self.fallback.hint(site, messages)
        return text.strip()


@dataclass(frozen=True)
class HintedContext:
    """A context with one hint message inserted.

    messages: the hinted list; hint_index: where the hint message sits (the
    student's messages[i] is hinted messages[i] for i < hint_index and
    messages[i + 1] for i >= hint_index); after_index = hint_index - 1, the last
    message of the failed call's results.
    """

    messages: list[dict]
    hint_index: int
    site: ErrorSite

    @property
    def after_index(self) -> int:
        return self.hint_index - 1


def hint_position(messages: Sequence[dict], site: ErrorSite) -> int:
    """Index just after the failed call's results: the tool messages following `site.turn`
    (or, when the environment returned the result as a user message, that message)."""
    if not 0 <= site.turn < len(messages):
        raise ValueError(f"error site turn {site.turn} is outside the {len(messages)} messages")
    pos = site.turn + 1
    while pos < len(messages) and messages[pos].get("role") == "tool":
        pos += 1
    if pos == site.turn + 1 and pos < len(messages) and messages[pos].get("role") == "user":
        pos += 1
    return pos


def insert_hint(messages: list[dict], site: ErrorSite, hint: str, role: str = "user") -> HintedContext:
    """A copy of `messages` with `{"role": role, "content": hint}` right after the failed call's result."""
    pos = hint_position(messages, site)
    hinted = list(messages[:pos]) + [{"role": role, "content": hint}] + list(messages[pos:])
    return HintedContext(messages=hinted, hint_index=pos, site=site)


@dataclass(frozen=True)
class HintSpans:
    """Token alignment between the student's context and the hinted context.

    hinted ids [hint_start, hint_end) are the hint (and its chat markup); every
    other hinted token equals a student token: hinted[j] == student[j] for
    j < hint_start and hinted[j] == student[j - shift] for j >= hint_end.
    """

    hint_start: int
    hint_end: int
    student_len: int
    hinted_len: int

    @property
    def shift(self) -> int:
        return self.hinted_len - self.student_len

    def student_to_hinted(self, j: int) -> int:
        """Position in the hinted ids of student token j."""
        return j if j < self.hint_start else j + self.shift


def hint_token_spans(
    student_messages: Sequence[dict],
    hinted: HintedContext,
    apply_chat_template: Callable[..., list[int]],
    **template_kwargs: Any,
) -> tuple[list[int], list[int], HintSpans]:
    """Tokenize both contexts with a chat template and locate the hint's tokens.

    apply_chat_template: e.g. `tokenizer.apply_chat_template` (called with
    `tokenize=True` and `template_kwargs`). The hint span is what lies between
    the longest common prefix and the longest common suffix of the two id lists.
    """
    def ids(messages: list[dict]) -> list[int]:
        out = apply_chat_template(messages, tokenize=True, **template_kwargs)
        # HF may return a BatchEncoding
        return list(out["input_ids"] if isinstance(out, Mapping) else out)

    student, with_hint = ids(list(student_messages)), ids(hinted.messages)
    limit = min(len(student), len(with_hint))
    prefix = 0
    while prefix < limit and student[prefix] == with_hint[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and student[-1 - suffix] == with_hint[-1 - suffix]:
        suffix += 1
    if prefix + suffix != len(student):
        raise ValueError(
            "the chat template renders the hinted context differently outside the hint; "
            "student tokens cannot be aligned by insertion"
        )
    spans = HintSpans(prefix, len(with_hint) - suffix, len(student), len(with_hint))
    return student, with_hint, spans


def make_hint_generator(cfg: DistillLossConfig, teachers: TeachersConfig) -> HintGenerator:
    """The run's hint generator, from `[loss.distill] hint_kind` (`llm` asks `hint_teacher` of `[teachers]`)."""
    if cfg.hint_kind == "template":
        return TemplateHintGenerator()
    if cfg.hint_kind == "feedback":
        return FeedbackHintGenerator(cfg.hint_max_chars)
    if cfg.hint_kind == "reference":
        return ReferenceHintGenerator(cfg.hint_max_chars)
    if cfg.hint_kind == "reference_prefix":
        return ReferencePrefixHintGenerator(cfg.hint_reveal_start, cfg.hint_reveal_step, cfg.hint_max_chars)
    if cfg.hint_kind == "failing_test":
        return FailingTestHintGenerator(cfg.hint_max_chars)
    if cfg.hint_kind == "llm":
        # JobConfig checked that hint_teacher names one of teachers.models
        return LLMHintGenerator(SyncTeacherClient(teachers), cfg.hint_teacher)
    raise ValueError(f"loss.distill.hint_kind = {cfg.hint_kind!r}; choose from {', '.join(HINT_KINDS)}")
