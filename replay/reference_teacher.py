"""Coding teachers for the local teacher server: the task's reference solution as a tool call, with slips.

`ReferenceResponder(lookup, noise, tool)` answers a coding episode's state the
way a good agent would: the change from the task's starting files to its
reference solution (`lookup(first user message) -> (start, reference)`, each
{path: full text}) as tool calls of the run's editing tool (`edit_file`: the
smallest differing line range per file; `write_file`: whole files), and once
the context holds those calls, a closing message without tool calls (which ends
a tool-loop episode). Like the demo's solver teachers, each model slips on a
share `noise` of states (chosen by a hash of model and context, so a repeated
request repeats): it writes a near miss (an operator swapped, else the last
digit moved by one, else the last line dropped). Two slipping teachers mostly slip on different states, so
the vote of `replay.pairs` decides. A state of an unknown task (e.g. from a
frozen trace of another repository) gets a message saying so, worded per model:
teachers never agree on it, so it never becomes a pair.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from composer_mesh.replay.server import departs

# prompt text of an episode -> (starting files, reference files), or None for an unknown task
Lookup = Callable[[str], "tuple[dict[str, str], dict[str, str]] | None"]
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
    """(name, arguments) of every tool call in the context's assistant messages."""
    out = []
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError:
                continue
            out.append((str(fn.get("name")), args))
    return out


class ReferenceResponder:
    """`(model, messages, params) -> assistant message`: the reference change as tool calls, or done."""

    def __init__(self, lookup: Lookup, noise: float = 0.0, tool: str = "edit_file") -> None:
        self.lookup = lookup
        self.noise = noise
        self.tool = tool

    def __call__(self, model: str, messages: list[dict], params: dict) -> dict:
        found = self.lookup(first_user_text(messages))
        if not found:
            # worded per model, so teachers never agree on it and it never becomes a pair
            return {"content": f"{model}: no reference solution for this task."}
        start, reference = found
        calls = change_calls(start, reference, self.tool)
        made = _calls_made(messages)
        if all((c["function"]["name"], json.loads(c["function"]["arguments"])) in made for c in calls):
            return {"content": DONE_TEXT}
        if departs(model, json.dumps(messages, sort_keys=True), self.noise):
            calls = change_calls(start, {p: near_miss(t) for p, t in reference.items()}, self.tool)
        return {"content": "", "tool_calls": calls}
