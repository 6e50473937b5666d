"""Coding teachers for the local teacher server: the task's reference solution as a tool call, with slips.

`ReferenceResponder(lookup, noise)` answers a coding episode's state the way a
good agent would: a `write_file` call per file of the task's reference solution
(`lookup(first user message) -> {path: full text}`), and once the context holds
those writes, a closing message without tool calls (which ends a tool-loop
episode). Like the demo's solver teachers, each model slips on a share `noise`
of states (chosen by a hash of model and context, so a repeated request repeats):
it writes a near miss, the reference with its last digit moved by one (or its
last line dropped). Two slipping teachers mostly slip on different states, so
the vote of `replay.pairs` decides. A state of an unknown task (e.g. from a
frozen trace of another repository) gets a plain message saying so; it never
matches a student's tool call, and a vote with a single such answer has no quorum.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from composer_mesh.replay.server import departs

# prompt text of an episode -> its reference files ({} / None: unknown task)
Lookup = Callable[[str], "dict[str, str] | None"]
DONE_TEXT = "Done: the change is written."


def first_user_text(messages: list[dict]) -> str:
    """The content of the first user message ('' when there is none)."""
    return next((str(m.get("content") or "") for m in messages if m.get("role") == "user"), "")


def near_miss(text: str) -> str:
    """`text` with its last digit moved by one, or without its last non-empty line when it has no digit."""
    digits = list(re.finditer(r"\d", text))
    if digits:
        at = digits[-1].start()
        return text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :]
    lines = text.rstrip("\n").split("\n")
    return "\n".join(lines[:-1]) + "\n"


def write_calls(files: dict[str, str]) -> list[dict]:
    """OpenAI tool calls writing each file, in path order."""
    return [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "write_file", "arguments": json.dumps({"path": path, "content": text})}}
        for i, (path, text) in enumerate(sorted(files.items()))
    ]


def _written(messages: list[dict]) -> dict[str, str]:
    """What the context's assistant messages wrote with write_file, last write per path."""
    out: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            if fn.get("name") != "write_file":
                continue
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError:
                continue
            if isinstance(args, dict) and isinstance(args.get("path"), str):
                out[args["path"]] = str(args.get("content", ""))
    return out


class ReferenceResponder:
    """`(model, messages, params) -> assistant message`: the reference as write_file calls, or done."""

    def __init__(self, lookup: Lookup, noise: float = 0.0) -> None:
        self.lookup = lookup
        self.noise = noise

    def __call__(self, model: str, messages: list[dict], params: dict) -> dict:
        files = self.lookup(first_user_text(messages))
        if not files:
            return {"content": "I do not know this task."}
        written = _written(messages)
        if all(written.get(path) == text for path, text in files.items()):
            return {"content": DONE_TEXT}
        if departs(model, json.dumps(messages, sort_keys=True), self.noise):
            files = {path: near_miss(text) for path, text in files.items()}
        return {"content": "", "tool_calls": write_calls(files)}
