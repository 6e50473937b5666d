"""Plain-data records shared by `envs/` and `replay/` (stdlib only).

`ErrorSite` marks a turn where a tool call failed; environments emit them while
they run, trace ingestion finds them in frozen traces, and the hint pipeline in
`replay/hints.py` turns either kind into a hint for on-policy distillation.
They live here because `configs` is the one package both may import.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


# how a tool result says `[env.tool_loop] check_edits = "revert"` undid its edit (a teacher replaying the
# context must not count that edit: envs.tool_loop writes it, replay.reference_teacher reads it)
EDIT_UNDONE = "; edit undone"


class ErrorKind(str, enum.Enum):
    """What went wrong at an error turn (the hint templates are keyed by it)."""

    COMMAND_NOT_FOUND = "command_not_found"
    FILE_NOT_FOUND = "file_not_found"
    PERMISSION = "permission"
    SYNTAX = "syntax"
    TIMEOUT = "timeout"
    TEST_FAILURE = "test_failure"
    BAD_TOOL_CALL = "bad_tool_call"  # unknown tool or bad arguments
    OTHER = "other"


@dataclass(frozen=True)
class ErrorSite:
    """A failed tool call.

    turn: index into the chat message list of the assistant message whose tool
    call failed (messages[turn]["role"] == "assistant"); the hint is placed right
    after the failed call's result. tool: the tool's name ("" when unknown);
    message: the error text as the model saw it (trimmed); kind: the class.
    Privileged context, for the teacher of hint distillation only (never shown to
    the policy through these fields): feedback: the environment's full feedback
    on the failure (the failing tests' output, expected vs got, the tool's whole
    error; "" = only `message`); reference: the task's reference solution or
    answer ("" = the task has none); change: the lines the reference solution
    writes that the starting files lack, under a `--- path` line per file ("" =
    unknown); cases: hidden test cases the episode's final workspace failed, as
    their source ("" = none known).
    """

    turn: int
    kind: ErrorKind
    message: str
    tool: str = ""
    feedback: str = ""
    reference: str = ""
    change: str = ""
    cases: str = ""
