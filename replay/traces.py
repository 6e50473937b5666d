"""Trace ingestion: frozen agent sessions → per-step replay states.

Two formats:
- Claude Code session JSONL (`~/.claude/projects/<dir>/<session>.jsonl`): one
  record per line; one assistant message is often split over several lines that
  share `message.id`; the conversation is a tree linked by `parentUuid` and the
  main thread is the path from the last main-thread record back to the root;
  sidechain (sub-agent), meta, system, summary, file-history-snapshot and
  queue-operation records are not part of what the model saw.
- OpenAI chat JSONL: one trace per line, a list of messages or
  `{"id": ..., "messages": [...]}`, tool calls in `tool_calls`.

Both become OpenAI-style message lists. Assistant messages keep their thinking
in a `reasoning` key (the student action keeps it; replayed context drops it);
tool results are `role: tool` messages, tagged `is_error` when the tool failed.
Bad lines are skipped and counted, never raised: `parsed + skipped == lines`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from configs.records import ErrorSite
from replay.hints import classify_error

TraceFormat = Literal["auto", "claude_code", "openai"]

# Claude Code record types that never enter the model's context.
_DROPPED_TYPES = ("summary", "file-history-snapshot", "queue-operation", "system")
_ERROR_MESSAGE_CHARS = 2000


@dataclass
class ParseStats:
    """Line and record accounting for one or more trace files.

    lines = parsed + sum(skipped.values()); `dropped` counts parsed records that
    are not in any trace (by reason); `traces` counts traces produced.
    """

    lines: int = 0
    parsed: int = 0
    skipped: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    traces: int = 0

    def add(self, other: "ParseStats") -> None:
        self.lines += other.lines
        self.parsed += other.parsed
        self.skipped.update(other.skipped)
        self.dropped.update(other.dropped)
        self.traces += other.traces

    def as_dict(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "parsed": self.parsed,
            "skipped": dict(self.skipped),
            "dropped": dict(self.dropped),
            "traces": self.traces,
        }


@dataclass(frozen=True)
class Trace:
    """One conversation: OpenAI-style messages (assistant `reasoning` kept)."""

    trace_id: str
    messages: tuple[dict, ...]


@dataclass(frozen=True)
class TraceState:
    """One replayable step: what the model saw, and what it did.

    context: messages before the step, thinking removed (what teachers get);
    action: the recorded assistant message (with `reasoning` when it thought);
    step: index of this assistant turn within the trace; error_sites: failed
    tool calls inside `context` (`turn` indexes `context`); tools: names of the
    tools the trace used (teachers may be offered them).
    """

    trace_id: str
    step: int
    context: tuple[dict, ...]
    action: dict
    error_sites: tuple[ErrorSite, ...] = ()
    tools: tuple[str, ...] = ()


def read_jsonl(path: str | Path) -> tuple[list[tuple[int, dict]], ParseStats]:
    """(line number, object) for every line that decodes to a JSON object, plus counts.

    Skips (and counts by reason) blank lines, undecodable bytes, malformed JSON,
    non-object values, and a truncated last line (no newline and not JSON).
    """
    stats = ParseStats()
    out: list[tuple[int, dict]] = []
    raw = Path(path).read_bytes()
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline after the last line ends it; it adds no line
    last_unterminated = not raw.endswith(b"\n")
    for i, line in enumerate(lines, start=1):
        stats.lines += 1
        if not line.strip():
            stats.skipped["blank"] += 1
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            stats.skipped["bad_utf8"] += 1
            continue
        except ValueError:
            truncated = last_unterminated and i == len(lines)
            stats.skipped["truncated" if truncated else "malformed_json"] += 1
            continue
        if not isinstance(obj, dict) and not isinstance(obj, list):
            stats.skipped["not_object"] += 1
            continue
        stats.parsed += 1
        out.append((i, obj if isinstance(obj, dict) else {"messages": obj}))
    return out, stats


# ---------------------------------------------------------------- Claude Code


def _text_of(content: Any) -> str:
    """Text of a tool_result / user content: a string or a list of blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else json.dumps(content, ensure_ascii=False)
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") == "image":
            parts.append("[image]")
    return "\n".join(parts)


def _assistant_message(blocks: list[dict]) -> dict:
    """Merge Anthropic content blocks into one OpenAI-style assistant message."""
    text, thinking, calls = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": str(block.get("name", "")),
                        "arguments": json.dumps(block.get("input", {}), ensure_ascii=False, sort_keys=True),
                    },
                }
            )
    msg: dict = {"role": "assistant", "content": "\n".join(t for t in text if t)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning"] = "\n".join(thinking)
    return msg


def _user_messages(content: Any) -> list[dict]:
    """A Claude Code user record → user text and/or tool result messages."""
    if not isinstance(content, list):
        return [{"role": "user", "content": _text_of(content)}]
    out, text = [], []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            msg = {
                "role": "tool",
                "tool_call_id": str(block.get("tool_use_id", "")),
                "content": _text_of(block.get("content")),
            }
            if block.get("is_error"):
                msg["is_error"] = True
            out.append(msg)
        else:
            text.append(block)
    if text:
        out.append({"role": "user", "content": _text_of(text)})
    return out


def _main_thread(records: list[dict], dropped: Counter) -> list[dict]:
    """Records on the path from the last main-thread message back to the root, in order."""
    by_uuid: dict[str, dict] = {}
    leaf = None
    for rec in records:
        uuid = rec.get("uuid")
        if isinstance(uuid, str):
            by_uuid[uuid] = rec
        if rec.get("type") in ("user", "assistant") and not rec.get("isSidechain") and uuid:
            leaf = rec
    chain: list[dict] = []
    seen: set[str] = set()
    node = leaf
    while node is not None and node["uuid"] not in seen:
        seen.add(node["uuid"])
        chain.append(node)
        parent = node.get("parentUuid")
        node = by_uuid.get(parent) if isinstance(parent, str) else None
        if isinstance(parent, str) and node is None:
            dropped["orphan_parent"] += 1  # points at a record the file does not hold
    chain.reverse()
    for rec in records:
        if rec.get("uuid") not in seen:
            dropped[_drop_reason(rec) or "off_thread"] += 1
    return chain


def _drop_reason(rec: dict) -> str | None:
    kind = rec.get("type")
    if kind in _DROPPED_TYPES:
        return str(kind)
    if kind not in ("user", "assistant"):
        return "unknown_type"
    if rec.get("isSidechain"):
        return "sidechain"
    if rec.get("isMeta"):
        return "meta"
    if not isinstance(rec.get("message"), dict):
        return "no_message"
    if kind == "assistant" and rec["message"].get("model") == "<synthetic>":
        return "synthetic"  # client-made placeholder (API error, interruption), not a model action
    return None


def claude_code_trace(records: list[dict], trace_id: str, dropped: Counter) -> Trace:
    """The main thread of one Claude Code session as OpenAI-style messages."""
    messages: list[dict] = []
    open_id: str | None = None  # message.id of the assistant message being merged
    blocks: list[dict] = []

    def flush() -> None:
        nonlocal open_id, blocks
        if open_id is not None:
            messages.append(_assistant_message(blocks))
        open_id, blocks = None, []

    for rec in _main_thread(records, dropped):
        reason = _drop_reason(rec)
        if reason is not None:
            dropped[reason] += 1
            continue
        msg = rec["message"]
        if rec["type"] == "assistant":
            msg_id = str(msg.get("id") or rec.get("uuid"))
            if msg_id != open_id:
                flush()
                open_id = msg_id
            content = msg.get("content")
            blocks.extend(b for b in (content if isinstance(content, list) else [{"type": "text", "text": content}]) if isinstance(b, dict))
        else:
            flush()
            messages.extend(_user_messages(msg.get("content")))
    flush()
    return Trace(trace_id=trace_id, messages=tuple(messages))


def parse_claude_code(path: str | Path) -> tuple[list[Trace], ParseStats]:
    """One session file → one trace (its main thread)."""
    rows, stats = read_jsonl(path)
    records = [rec for _, rec in rows]
    session = next((r.get("sessionId") for r in records if isinstance(r.get("sessionId"), str)), None)
    trace = claude_code_trace(records, session or Path(path).stem, stats.dropped)
    traces = [trace] if trace.messages else []
    stats.traces = len(traces)
    return traces, stats


# ---------------------------------------------------------------- OpenAI chat

_ROLES = ("system", "user", "assistant", "tool")


def _openai_messages(raw: Any) -> list[dict] | None:
    """Validated copies of OpenAI chat messages; None if the list is not one."""
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            return None
        msg = dict(m)
        content = msg.get("content")
        msg["content"] = content if isinstance(content, str) else _text_of(content)
        if m["role"] == "assistant":
            thought = msg.pop("reasoning_content", None) or msg.get("reasoning")
            if thought:
                msg["reasoning"] = str(thought)
            calls = msg.get("tool_calls")
            if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
                return None
        out.append(msg)
    return out


def parse_openai_chat(path: str | Path) -> tuple[list[Trace], ParseStats]:
    """One trace per line: a message list or an object with `messages`."""
    rows, stats = read_jsonl(path)
    traces = []
    for lineno, obj in rows:
        messages = _openai_messages(obj.get("messages"))
        if messages is None:
            stats.dropped["not_a_trace"] += 1
            continue
        trace_id = str(obj.get("id") or f"{Path(path).stem}:{lineno}")
        traces.append(Trace(trace_id=trace_id, messages=tuple(messages)))
    stats.traces = len(traces)
    return traces, stats


def detect_format(path: str | Path) -> Literal["claude_code", "openai"]:
    """Claude Code records carry `sessionId`/`parentUuid`/`type`; anything else is OpenAI chat."""
    rows, _ = read_jsonl(path)
    for _, obj in rows[:50]:
        if "parentUuid" in obj or "sessionId" in obj or obj.get("type") in _DROPPED_TYPES:
            return "claude_code"
    return "openai"


def load_traces(path: str | Path, fmt: TraceFormat = "auto") -> tuple[list[Trace], ParseStats]:
    """Traces of one file in the given (or detected) format."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    return parse_claude_code(path) if fmt == "claude_code" else parse_openai_chat(path)


# ---------------------------------------------------------------- states


def strip_reasoning(message: dict) -> dict:
    """The message without its thinking (what a replaying teacher may see)."""
    return {k: v for k, v in message.items() if k != "reasoning"}


def find_error_sites(messages: Iterable[dict]) -> list[ErrorSite]:
    """Failed tool calls: each `is_error` tool result → the assistant turn that made the call."""
    messages = list(messages)
    sites, calls = [], {}  # tool_call_id -> (turn, tool name)
    for i, msg in enumerate(messages):
        if msg.get("role") == "assistant":
            for call in msg.get("tool_calls") or ():
                calls[call.get("id")] = (i, str((call.get("function") or {}).get("name", "")))
        elif msg.get("role") == "tool" and msg.get("is_error"):
            turn, tool = calls.get(msg.get("tool_call_id"), (None, ""))
            if turn is None:
                continue
            text = str(msg.get("content", ""))[:_ERROR_MESSAGE_CHARS]
            sites.append(ErrorSite(turn=turn, kind=classify_error(text, tool), message=text, tool=tool))
    return sites


def trace_states(trace: Trace, max_context_messages: int = 0) -> list[TraceState]:
    """One state per assistant turn that has some context before it."""
    msgs = trace.messages
    tools = sorted(
        {str((c.get("function") or {}).get("name", "")) for m in msgs for c in (m.get("tool_calls") or ())} - {""}
    )
    states = []
    step = 0
    for i, msg in enumerate(msgs):
        if msg.get("role") != "assistant":
            continue
        start = max(0, i - max_context_messages) if max_context_messages else 0
        while start < i and msgs[start].get("role") == "tool":
            start += 1  # never open a context with results whose call was cut off
        if i > start:
            context = tuple(strip_reasoning(m) for m in msgs[start:i])
            states.append(
                TraceState(
                    trace_id=trace.trace_id,
                    step=step,
                    context=context,
                    action=dict(msg),
                    error_sites=tuple(find_error_sites(context)),
                    tools=tuple(tools),
                )
            )
        step += 1
    return states
