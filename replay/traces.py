"""Trace ingestion: frozen agent sessions → per-step replay states.

Two formats:
- Claude Code session JSONL (`replay/claude_code.py`): the main thread of a
  session, and each sub-agent sidechain, with split assistant records merged
  and parallel tool results attached by id;
- OpenAI chat JSONL: one trace per line, a list of messages or
  `{"id": ..., "messages": [...]}`, tool calls in `tool_calls`.

Both become OpenAI-style message lists. Assistant messages keep their thinking
in a `reasoning` key (the student action keeps it; replayed context drops it);
tool results are `role: tool` messages, tagged `is_error` when the tool failed.
Bad lines and records are skipped and counted with `file:line`, never raised:
`parsed + skipped == lines`. A state whose context holds a tool call without its
result (or a result without its call) is refused and counted: OpenAI-compatible
APIs answer such a context with a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from composer_mesh.configs.records import ErrorSite
from composer_mesh.replay.claude_code import NOT_CONVERSATION, parse_claude_code
from composer_mesh.replay.hints import classify_error
from composer_mesh.replay.trace_io import ParseStats, Trace, read_jsonl, text_of

TraceFormat = Literal["auto", "claude_code", "openai"]
_ERROR_MESSAGE_CHARS = 2000


@dataclass(frozen=True)
class TraceState:
    """One replayable step: what the model saw, and what it did.

    context: messages before the step, thinking removed (what teachers get);
    action: the recorded assistant message (with `reasoning` when it thought);
    step: index of this assistant turn within the trace; error_sites: failed
    tool calls inside `context` (`turn` indexes `context`); tools: names of the
    tools the trace used (teachers may be offered them); env_seed / env_split: the
    run's episode this state comes from (`reset(seed)` on that split replays its
    context), None for frozen external traces.
    """

    trace_id: str
    step: int
    context: tuple[dict, ...]
    action: dict
    error_sites: tuple[ErrorSite, ...] = ()
    tools: tuple[str, ...] = ()
    env_seed: int | None = None
    env_split: str = "train"


# ---------------------------------------------------------------- OpenAI chat

_ROLES = ("system", "user", "assistant", "tool")
# OpenAI's `developer` role is the system role of its reasoning models; teachers behind other
# servers (vLLM chat templates) know only `system`, so it is read as one.
_ROLE_ALIASES = {"developer": "system"}


def _openai_call(call: Any) -> tuple[dict | None, str | None]:
    """A validated copy of one `tool_calls` entry (dict arguments are serialized), or the reason it is not one."""
    if not isinstance(call, dict):
        return None, "bad_type:tool_calls[]"
    fn = call.get("function")
    if not isinstance(call.get("id"), str):
        return None, "bad_type:tool_calls.id"
    if not isinstance(fn, dict):
        return None, "bad_type:tool_calls.function"
    if not isinstance(fn.get("name"), str):
        return None, "bad_type:tool_calls.function.name"
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False, sort_keys=True)
    if not isinstance(args, str):
        return None, "bad_type:tool_calls.function.arguments"
    return {**call, "type": "function", "function": {**fn, "arguments": args}}, None


def _openai_message(m: Any) -> tuple[dict | None, str | None]:
    """A validated copy of one chat message, or the reason it is not one."""
    if not isinstance(m, dict):
        return None, "bad_type:messages[]"
    role = _ROLE_ALIASES.get(m.get("role"), m.get("role"))
    if role not in _ROLES:
        return None, "bad_role"
    msg = {**m, "role": role}
    content = msg.get("content")
    if content is not None and not isinstance(content, (str, list)):
        return None, "bad_type:content"
    msg["content"] = content if isinstance(content, str) else text_of(content)[0]
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        return None, "bad_type:tool_call_id"
    if m.get("name") is not None and not isinstance(m["name"], str):
        # sent as is: an API would refuse the request
        return None, "bad_type:name"
    if role == "assistant":
        thought = msg.pop("reasoning_content", None) or msg.get("reasoning")
        if thought:
            msg["reasoning"] = str(thought)
        calls = msg.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                return None, "bad_type:tool_calls"
            msg["tool_calls"] = []
            for call in calls:
                checked, reason = _openai_call(call)
                if reason is not None:
                    return None, reason
                msg["tool_calls"].append(checked)
    return msg, None


def _openai_messages(raw: Any) -> tuple[list[dict], str | None]:
    """Validated copies of OpenAI chat messages, or the reason the value is not a trace."""
    if not isinstance(raw, list):
        return [], "bad_type:messages"
    if not raw:
        return [], "empty_trace"
    out = []
    for m in raw:
        msg, reason = _openai_message(m)
        if reason is not None:
            return [], reason
        out.append(msg)
    return out, None


def parse_openai_chat(
    path: str | Path, read: tuple[list[tuple[int, dict]], ParseStats] | None = None
) -> tuple[list[Trace], ParseStats]:
    """One trace per line: a message list or an object with `messages`; bad lines dropped with the reason.

    read: `read_jsonl(path)` when the caller already has it.
    """
    rows, stats = read or read_jsonl(path)
    traces = []
    for lineno, obj in rows:
        messages, reason = _openai_messages(obj.get("messages"))
        if reason is not None:
            stats.note(stats.dropped, reason, f"{path}:{lineno}")
            continue
        trace_id = obj.get("id")
        trace_id = str(trace_id) if isinstance(trace_id, (str, int)) else f"{Path(path).stem}:{lineno}"
        traces.append(Trace(trace_id=trace_id, messages=tuple(messages)))
    stats.traces = len(traces)
    return traces, stats


def detect_format(rows: list[tuple[int, dict]]) -> Literal["claude_code", "openai"]:
    """Claude Code records carry `sessionId`/`parentUuid`/`type`; anything else is OpenAI chat."""
    for _, obj in rows[:50]:
        if "parentUuid" in obj or "sessionId" in obj or obj.get("type") in NOT_CONVERSATION:
            return "claude_code"
    return "openai"


def load_traces(path: str | Path, fmt: TraceFormat = "auto") -> tuple[list[Trace], ParseStats]:
    """Traces of one file in the given (or detected) format; warns (in the stats) when it yields none."""
    read = read_jsonl(path)
    if fmt == "auto":
        fmt = detect_format(read[0])
    traces, stats = parse_claude_code(path, read) if fmt == "claude_code" else parse_openai_chat(path, read)
    if not traces and stats.lines:
        lost = {**stats.skipped, **stats.dropped}
        why = ", ".join(f"{k} {v}" for k, v in sorted(lost.items())) or "nothing to replay"
        stats.warnings.append(f"{path}: no usable {fmt} trace in {stats.lines} lines ({why})")
    return traces, stats


def trace_paths(paths: Iterable[str]) -> tuple[list[Path], list[str]]:
    """(files, warnings) named by `paths`: a directory stands for its `*.jsonl` files (sorted, not recursive)."""
    out, missing, warnings = [], [], []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.glob("*.jsonl") if f.is_file())
            if not files:
                warnings.append(f"{p}: directory holds no *.jsonl file")
            out.extend(files)
        elif p.is_file():
            out.append(p)
        else:
            missing.append(str(p))
    if missing:
        raise FileNotFoundError(f"replay.traces: no such file or directory: {', '.join(missing)}")
    return out, warnings


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
                calls[call["id"]] = (i, call["function"]["name"])
        elif msg.get("role") == "tool" and msg.get("is_error"):
            turn, tool = calls.get(msg["tool_call_id"], (None, ""))
            if turn is None:
                continue
            text = str(msg.get("content", ""))[:_ERROR_MESSAGE_CHARS]
            sites.append(ErrorSite(turn=turn, kind=classify_error(text, tool), message=text, tool=tool))
    return sites


def context_problem(context: Iterable[dict]) -> str | None:
    """Why an OpenAI-compatible API would refuse this context, or None.

    Every assistant `tool_calls` id must be answered by a `tool` message before
    the next non-tool message, and every `tool` message must answer a call of
    the assistant message just before its run.
    """
    pending: set[str] = set()
    for msg in context:
        if msg["role"] == "tool":
            if msg["tool_call_id"] not in pending:
                return "orphan_tool_result"
            pending.discard(msg["tool_call_id"])
            continue
        if pending:
            return "unanswered_tool_call"
        pending = {c["id"] for c in msg.get("tool_calls") or ()} if msg["role"] == "assistant" else set()
    return "unanswered_tool_call" if pending else None


def trace_states(trace: Trace, max_context_messages: int = 0, stats: ParseStats | None = None) -> list[TraceState]:
    """One state per assistant turn that has some context before it.

    A state whose context `context_problem` refuses is left out and counted in
    `stats.states_dropped` (with `trace:step`).
    """
    msgs = trace.messages
    tools = sorted({c["function"]["name"] for m in msgs for c in (m.get("tool_calls") or ())} - {""})
    states = []
    step = 0
    for i, msg in enumerate(msgs):
        if msg.get("role") != "assistant":
            continue
        start = max(0, i - max_context_messages) if max_context_messages else 0
        while start < i and msgs[start].get("role") == "tool":
            # never open a context with results whose call was cut off
            start += 1
        if i > start:
            context = tuple(strip_reasoning(m) for m in msgs[start:i])
            problem = context_problem(context)
            if problem is not None:
                if stats is not None:
                    stats.note(stats.states_dropped, problem, f"{trace.trace_id}:step {step}")
            else:
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
