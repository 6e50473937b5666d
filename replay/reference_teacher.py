"""Coding teachers for the local teacher server: the task's reference solution as a tool call, with slips.

`ReferenceResponder(lookup, noise, tool)` answers a coding episode's state the
way a good agent would: the change from the task's starting files to its
reference solution (`lookup(first user message) -> TaskFiles(start, reference)`,
each {path: full text}) as tool calls of the run's editing tool (`edit_file`: the
smallest differing line range per file; `write_file`: whole files), made from
the files as the context's own calls left them (a wrong edit is edited again),
and once they match the reference, a closing message without tool calls (which
ends a tool-loop episode). Like the demo's solver teachers, each model slips on a
share `noise` of states (chosen by a hash of model and context, so a repeated
request repeats): it writes a near miss (an operator swapped, else the last
digit moved by one, else the last line dropped). Two slipping teachers mostly slip on different states, so
the vote of `replay.pairs` decides. A state the lookup cannot serve (a task it
does not know, e.g. from a frozen trace of another repository, or one without a
reference) gets a message saying so, worded per model so that teachers never agree
on it and it never becomes a pair, with the lookup's reason in the message's
`refusal` field (OpenAI's: why the model did not answer), which the replay counts.
"""

from __future__ import annotations

import json
import re
from typing import Callable, NamedTuple

from composer_mesh.configs.records import EDIT_UNDONE
from composer_mesh.replay.server import departs



class TaskFiles(NamedTuple):
    """A coding task's files a teacher answers from: those its reference solution writes, as the agent first sees
    them (`start`, "" for a file the solution adds) and as the solution leaves them (`reference`)."""

    start: dict[str, str]
    reference: dict[str, str]


# prompt text of an episode -> the task's files, or why the teacher cannot answer (one line; None: an unknown task)
Lookup = Callable[[str], "TaskFiles | str | None"]
UNKNOWN_TASK = "unknown task: no task of the run has this prompt"
_SWAP = {" + ": " - ", " - ": " + ", " * ": " + "}
DONE_TEXT = "Done: the change is written."


def first_user_text(messages: list[dict]) -> str:
    """The content of the first user message ('' when there is none)."""
    return next((str(m.get("content") or "") for m in messages if m.get("role") == "user"), "")


def near_miss(text: str) -> str:
    """`text` with its last binary +, - or * swapped (code after its docstring), else its last digit moved by one,
    else without its last line."""
    ops = [(text.rfind(op), op) for op in _SWAP if op in text]
    if ops:
        at, op = max(ops)
        return text[:at] + _SWAP[op] + text[at + len(op) :]
    digits = list(re.finditer(r"\d", text))
    if digits:
        at = digits[-1].start()
        return text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :]
    lines = text.rstrip("\n").split("\n")
    return "\n".join(lines[:-1]) + "\n"


def edit_args(path: str, start: str, reference: str) -> dict[str, str] | None:
    """`edit_file` arguments turning `start` into `reference`: the differing line range, the first line's
    indentation left in place, widened by context lines until `old` is unique in `start` (None: no change)."""
    if start == reference:
        return None
    a, b = start.split("\n"), reference.split("\n")
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    lo, hi_a, hi_b = head, len(a) - tail, len(b) - tail
    while True:
        old, new = "\n".join(a[lo:hi_a]), "\n".join(b[lo:hi_b])
        indent = len(old) - len(old.lstrip(" "))
        if new[:indent] == old[:indent]:
            old, new = old[indent:], new[indent:]
        if old and start.count(old) == 1:
            return {"path": path, "old": old, "new": new}
        if lo == 0 and hi_a == len(a):
            return None
        lo, hi_a, hi_b = max(0, lo - 1), min(len(a), hi_a + 1), min(len(b), hi_b + 1)


def change_calls(start: dict[str, str], reference: dict[str, str], tool: str) -> list[dict]:
    """OpenAI tool calls making `reference` from `start`, in path order (`edit_file` falls back to
    `write_file` arguments for a file it cannot edit: the run offers what the recipe offers)."""
    calls = []
    for path, text in sorted(reference.items()):
        args = edit_args(path, start.get(path, ""), text) if tool == "edit_file" and start.get(path) else None
        if tool == "edit_file" and args is None and start.get(path) == text:
            continue
        name = tool if args is not None else "write_file"
        calls.append({"id": f"call_{len(calls)}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args or {"path": path, "content": text})}})
    return calls


def _calls_made(messages: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments) of the context's tool calls that the loop did not undo (a call's result is the tool
    message in its place after the call's assistant message: ids repeat across turns, so order pairs them)."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") or () if m.get("role") == "assistant" else ()
        results = [str(r.get("content")) for r in messages[i + 1 : i + 1 + len(calls)] if r.get("role") == "tool"]
        for k, call in enumerate(calls):
            if k < len(results) and EDIT_UNDONE in results[k]:
                continue
            fn = call.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError:
                continue
            out.append((str(fn.get("name")), args))
    return out


def files_after(start: dict[str, str], calls: list[tuple[str, dict]]) -> dict[str, str]:
    """`start` with the context's `edit_file` / `write_file` calls applied as the tool loop applies them (an edit
    whose `old` is missing or not unique changes nothing), so a teacher answers from the files as they are now."""
    files = dict(start)
    for name, args in calls:
        path = args.get("path")
        if name == "write_file" and isinstance(path, str) and isinstance(args.get("content"), str):
            files[path] = args["content"]
        elif name == "edit_file" and isinstance(path, str) and path in files:
            old, new = args.get("old"), args.get("new")
            if isinstance(old, str) and isinstance(new, str) and old and files[path].count(old) == 1:
                files[path] = files[path].replace(old, new, 1)
    return files


class ReferenceResponder:
    """`(model, messages, params) -> assistant message`: the reference change as tool calls, or done."""

    def __init__(self, lookup: Lookup, noise: float = 0.0, tool: str = "edit_file") -> None:
        self.lookup = lookup
        self.noise = noise
        self.tool = tool

    def __call__(self, model: str, messages: list[dict], params: dict) -> dict:
        found = self.lookup(first_user_text(messages))
        if found is None or isinstance(found, str):
            # worded per model, so teachers never agree on it and it never becomes a pair
            return {"content": f"{model}: no reference solution for this task.", "refusal": found or UNKNOWN_TASK}
        start, reference = found
        now = files_after(start, _calls_made(messages))
        if all(now.get(path) == text for path, text in reference.items()):
            return {"content": DONE_TEXT}
        if departs(model, json.dumps(messages, sort_keys=True), self.noise):
            reference = {p: near_miss(t) for p, t in reference.items()}
        calls = change_calls(now, reference, self.tool)
        return {"content": "", "tool_calls": calls} if calls else {"content": DONE_TEXT}
