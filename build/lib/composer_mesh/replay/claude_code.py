"""Claude Code session JSONL → traces (the main thread, and one per sub-agent sidechain).

A session file (`~/.claude/projects/<dir>/<session>.jsonl`) holds one record per
line. The conversation is a tree linked by `parentUuid`; the main thread is the
path from the last main-thread user/assistant record back to the root. Shapes
handled here, as real sessions write them:

- one API response is split over several assistant records sharing
  `message.id` (one content block each: thinking, text, each parallel
  `tool_use`); they are merged into one message wherever they sit in the tree;
- each `tool_result` record's `parentUuid` is its own one-block `tool_use`
  record (`sourceToolAssistantUUID`), so all but one parallel result hang off
  a sibling branch; results are attached by `tool_use_id`, right after the
  assistant message that made the call;
- `isMeta` user records (harness feedback such as "Stop hook feedback: …",
  command caveats, expanded skills) were sent to the model: kept, `meta: True`;
- `/compact` writes a `compact_boundary` record with a null `parentUuid`, then
  an `isCompactSummary` user record: the thread after it starts at the summary
  (kept, `compact_summary: True`), and the turns before the boundary become
  their own trace `<id>:before-compact-<k>` (the model saw them then); type
  `summary` records (session titles) are not conversation and are dropped;
- `isSidechain` records (a Task sub-agent's own conversation) are not in the
  main thread (the parent saw only the Task result); each sidechain becomes its
  own trace `<session>:sidechain:<agentId or root uuid>`;
- a record lost to a corrupted line breaks the parent chain: the walk bridges
  the gap to the nearest earlier record of the same thread (file order, no later
  timestamp) and reports the bad line.

Records with wrong field types are dropped with `bad_type:<field>` and their
`file:line`; nothing here raises on content.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_mesh.replay.trace_io import ParseStats, Trace, read_jsonl, text_of

_CONVERSATION = ("user", "assistant")
# Record types that never enter the model's context (any other non-turn type is `unknown_type`).
NOT_CONVERSATION = ("summary", "file-history-snapshot", "queue-operation", "system", "progress")
# Optional top-level fields and the types they may have (None is always allowed).
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "uuid": str, "parentUuid": str, "sessionId": str, "timestamp": str, "agentId": str,
    "logicalParentUuid": str, "subtype": str,
    "isSidechain": bool, "isMeta": bool, "isCompactSummary": bool, "sourceToolAssistantUUID": str,
}
# Content block fields a block of each type must carry, and their types.
_BLOCK_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "text": {"text": str},
    "thinking": {"thinking": str},
    "tool_use": {"id": str, "name": str, "input": dict},
    "tool_result": {"tool_use_id": str},
}


@dataclass(frozen=True)
class _Rec:
    line: int
    raw: dict

    @property
    def uuid(self) -> str | None:
        return self.raw.get("uuid")

    @property
    def side(self) -> bool:
        return bool(self.raw.get("isSidechain"))

    @property
    def is_turn(self) -> bool:
        return self.raw.get("type") in _CONVERSATION

    @property
    def msg_id(self) -> str:
        return self.raw["message"].get("id") or self.raw["uuid"]


def field_error(rec: dict) -> str | None:
    """`bad_type:<field>` for the first field whose type is wrong, else None."""
    if not isinstance(rec.get("type"), str):
        return "bad_type:type"
    for key, types in _FIELD_TYPES.items():
        if rec.get(key) is not None and not isinstance(rec[key], types):
            return f"bad_type:{key}"
    if rec["type"] not in _CONVERSATION:
        return None
    if not isinstance(rec.get("uuid"), str):
        return "bad_type:uuid"
    msg = rec.get("message")
    if not isinstance(msg, dict):
        return "bad_type:message"
    if msg.get("id") is not None and not isinstance(msg["id"], str):
        return "bad_type:message.id"
    content = msg.get("content")
    if not isinstance(content, (str, list)):
        return "bad_type:message.content"
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            return "bad_type:message.content[]"
        for key, types in _BLOCK_FIELDS.get(block["type"], {}).items():
            if not isinstance(block.get(key), types):
                return f"bad_type:{block['type']}.{key}"
        if block["type"] == "tool_result" and block.get("is_error") not in (None, True, False):
            return "bad_type:tool_result.is_error"
    return None


def drop_reason(rec: dict) -> str | None:
    """Why a (well-typed) record is not part of what the model saw, or None."""
    kind = rec["type"]
    if kind in NOT_CONVERSATION:
        return kind
    if kind not in _CONVERSATION:
        return "unknown_type"
    if kind == "assistant" and rec["message"].get("model") == "<synthetic>":
        # client-made placeholder (API error, interruption), not a model action
        return "synthetic"
    return None


def _assistant_message(blocks: list[dict], notes: ParseStats, where: str) -> dict:
    """Merge Anthropic content blocks into one OpenAI-style assistant message."""
    text, thinking, calls, ids = [], [], [], set()
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            text.append(block["text"])
        elif kind == "thinking":
            thinking.append(block["thinking"])
        elif kind == "tool_use" and block["id"] not in ids:
            ids.add(block["id"])
            arguments = json.dumps(block["input"], ensure_ascii=False, sort_keys=True)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind != "tool_use":
            # redacted_thinking, server tools, ...
            notes.note(notes.notes, f"omitted_block:{kind}", where)
    msg: dict = {"role": "assistant", "content": "\n".join(t for t in text if t)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning"] = "\n".join(thinking)
    return msg


def _blocks(rec: _Rec) -> list[dict]:
    """A conversation record's content as blocks (a plain string is one text block)."""
    content = rec.raw["message"]["content"]
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


class _Session:
    """The records of one file, indexed for thread walks."""

    def __init__(self, path: Path, rows: list[tuple[int, dict]], stats: ParseStats):
        self.path, self.stats = path, stats
        self.bad = sorted(set(range(1, stats.lines + 1)) - {line for line, _ in rows})
        self.recs: list[_Rec] = []
        self.by_uuid: dict[str, _Rec] = {}
        for line, raw in rows:
            error = field_error(raw)
            if error is not None:
                stats.note(stats.dropped, error, self.at(line))
                bisect.insort(self.bad, line)  # a lost record: walks may bridge over it
                continue
            rec = _Rec(line, raw)
            if rec.uuid is not None:
                if rec.uuid in self.by_uuid:
                    stats.note(stats.dropped, "duplicate", self.at(line))
                    continue
                self.by_uuid[rec.uuid] = rec
            self.recs.append(rec)
        self.lines = [r.line for r in self.recs]
        self.used: set[int] = set()  # lines of records accounted for
        # message.id -> assistant records, and tool_use_id -> result record, per side
        self.parts: dict[tuple[bool, str], list[_Rec]] = {}
        self.results: dict[tuple[bool, str], tuple[_Rec, dict]] = {}
        for rec in self.recs:
            if not rec.is_turn or drop_reason(rec.raw) is not None:
                continue
            content = rec.raw["message"]["content"]
            if rec.raw["type"] == "assistant":
                self.parts.setdefault((rec.side, rec.msg_id), []).append(rec)
            for block in content if isinstance(content, list) else ():
                if block["type"] == "tool_result":
                    self.results.setdefault((rec.side, block["tool_use_id"]), (rec, block))
        # every tool_use id of the file's assistant records
        self.called = {
            b["id"] for parts in self.parts.values() for p in parts for b in _blocks(p) if b["type"] == "tool_use"
        }

    def unused_reason(self, rec: _Rec) -> str:
        """Why a record is in no trace: not conversation, a result whose call the file lost, or off the thread."""
        reason = drop_reason(rec.raw)
        if reason is not None:
            return reason
        content = rec.raw["message"]["content"]
        if rec.raw["type"] == "user" and isinstance(content, list) and content and all(
            b["type"] == "tool_result" and b["tool_use_id"] not in self.called for b in content
        ):
            return "orphan_tool_result"
        return "off_thread"

    def at(self, line: int) -> str:
        return f"{self.path}:{line}"

    def leaves(self) -> list[tuple[str | None, _Rec]]:
        """(sidechain name or None, last record) of the main thread and of each sidechain."""
        main = next((r for r in reversed(self.recs) if r.is_turn and not r.side), None)
        out: list[tuple[str | None, _Rec]] = [(None, main)] if main else []
        # root uuid -> last sidechain turn under it
        roots: dict[str, _Rec] = {}
        names: dict[str, str] = {}
        root_of: dict[str, _Rec] = {}
        for rec in self.recs:
            if rec.is_turn and rec.side:
                root = self._root(rec, root_of)
                roots[root.uuid] = rec
                if root.uuid not in names:
                    name = rec.raw.get("agentId") or root.uuid
                    # unique trace ids
                    names[root.uuid] = root.uuid if name in names.values() else name
        out.extend((names[root], leaf) for root, leaf in roots.items())
        return out

    def _root(self, rec: _Rec, root_of: dict[str, _Rec]) -> _Rec:
        """The first record of `rec`'s sidechain (memoized in `root_of`)."""
        path: dict[str, None] = {}  # ordered set
        node = rec
        while node.uuid not in root_of and node.uuid not in path:
            path[node.uuid] = None
            parent = self.by_uuid.get(node.raw.get("parentUuid") or "")
            if parent is None or parent.side != node.side:
                break
            node = parent
        root = root_of.get(node.uuid, node)
        root_of.update(dict.fromkeys(path, root))
        return root

    def thread(self, leaf: _Rec) -> list[_Rec]:
        """Records from the root to `leaf`, bridging gaps left by lost lines."""
        chain, seen = [], set()
        node: _Rec | None = leaf
        while node is not None and node.line not in seen:
            seen.add(node.line)
            chain.append(node)
            parent = node.raw.get("parentUuid")
            if parent is None:
                break
            node = self.by_uuid.get(parent) or self._bridge(node, seen)
        chain.reverse()
        return chain

    def segments(self, leaf: _Rec) -> list[list[_Rec]]:
        """The thread ending at `leaf`, split at compaction boundaries, oldest first.

        A `compact_boundary` record has a null `parentUuid` and its
        `logicalParentUuid` names the last record before `/compact`: the turns
        before it are a conversation the model saw then, replayed as their own trace.
        """
        chains: list[list[_Rec]] = []
        seen: set[int] = set()
        node: _Rec | None = leaf
        while node is not None and node.line not in seen:
            chain = self.thread(node)
            chains.append(chain)
            seen.update(r.line for r in chain)
            first = chain[0]
            before = first.raw.get("logicalParentUuid") if first.raw.get("subtype") == "compact_boundary" else None
            node = (self.by_uuid.get(before) or self._bridge(first, seen)) if before else None
        return chains[::-1]

    def _bridge(self, node: _Rec, seen: set[int]) -> _Rec | None:
        """Where `node`'s thread went on when its parent was lost on a bad line: the nearest
        earlier turn of the same side not yet walked, no later than `node` (a sibling of `node`
        under the lost parent, or what the lost record followed); None (the thread starts at
        `node`) when no bad line precedes it."""
        gap = bisect.bisect_left(self.bad, node.line)
        if gap == 0:
            self.stats.note(self.stats.notes, "orphan_parent", self.at(node.line))
            return None
        bad_line = self.bad[gap - 1]
        stamp = node.raw.get("timestamp")
        for i in range(bisect.bisect_left(self.lines, node.line) - 1, -1, -1):
            cand = self.recs[i]
            later = stamp and cand.raw.get("timestamp") and cand.raw["timestamp"] > stamp
            if cand.is_turn and cand.side == node.side and cand.line not in seen and not later:
                self.stats.note(self.stats.notes, "bridged", self.at(bad_line))
                return cand
        self.stats.note(self.stats.notes, "orphan_parent", self.at(node.line))
        return None

    def messages(self, chain: list[_Rec]) -> list[dict]:
        """The thread as OpenAI-style messages; every tool call is followed by its result if the file has it."""
        out: list[dict] = []
        merged: set[str] = set()
        answered: set[str] = set()
        on_chain = {r.line for r in chain}
        for rec in chain:
            reason = drop_reason(rec.raw)
            if reason is not None:
                self.stats.note(self.stats.dropped, reason, self.at(rec.line))
                self.used.add(rec.line)
                continue
            self.used.add(rec.line)
            if rec.raw["type"] == "assistant":
                if rec.msg_id not in merged:
                    merged.add(rec.msg_id)
                    out.extend(self._assistant_turn(rec, on_chain, answered))
                continue
            out.extend(self._user_turn(rec, answered))
        return out

    def _assistant_turn(self, rec: _Rec, on_chain: set[int], answered: set[str]) -> list[dict]:
        parts = self.parts[(rec.side, rec.msg_id)]
        blocks = []
        for part in parts:
            blocks.extend(_blocks(part))
            if part.line not in on_chain:
                self.stats.note(self.stats.notes, "merged_off_thread", self.at(part.line))
            self.used.add(part.line)
        msg = _assistant_message(blocks, self.stats, self.at(rec.line))
        out = [msg]
        for call in msg.get("tool_calls", ()):
            found = self.results.get((rec.side, call["id"]))
            if found is None:
                # the state check (`trace_states`) refuses contexts that hold this call
                continue
            result_rec, block = found
            out.append(self._tool_message(block, result_rec))
            answered.add(call["id"])
            if result_rec.line not in on_chain:
                self.stats.note(self.stats.notes, "reattached_result", self.at(result_rec.line))
            self.used.add(result_rec.line)
        return out

    def _tool_message(self, block: dict, rec: _Rec) -> dict:
        content, images = text_of(block.get("content"))
        if images:
            self.stats.note(self.stats.notes, "image_placeholder", self.at(rec.line), images)
        msg = {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
        if block.get("is_error"):
            msg["is_error"] = True
        return msg

    def _user_turn(self, rec: _Rec, answered: set[str]) -> list[dict]:
        content = rec.raw["message"]["content"]
        rest: Any = content
        if isinstance(content, list):
            rest = []
            for block in content:
                if block["type"] != "tool_result":
                    rest.append(block)
                elif block["tool_use_id"] not in answered:
                    self.stats.note(self.stats.dropped, "orphan_tool_result", self.at(rec.line))
            if not rest:
                return []
        text, images = text_of(rest)
        if images:
            self.stats.note(self.stats.notes, "image_placeholder", self.at(rec.line), images)
        msg: dict = {"role": "user", "content": text}
        for key, mark in (("isMeta", "meta"), ("isCompactSummary", "compact_summary")):
            if rec.raw.get(key):
                msg[mark] = True
                self.stats.note(self.stats.notes, mark, self.at(rec.line))
        return [msg]


def parse_claude_code(
    path: str | Path, read: tuple[list[tuple[int, dict]], ParseStats] | None = None
) -> tuple[list[Trace], ParseStats]:
    """One session file → its main-thread trace and one trace per sidechain.

    read: `read_jsonl(path)` when the caller already has it.
    """
    rows, stats = read or read_jsonl(path)
    session = _Session(Path(path), rows, stats)
    sid = next((r.raw["sessionId"] for r in session.recs if r.raw.get("sessionId")), None) or Path(path).stem
    traces = []
    for side_name, leaf in session.leaves():
        chains = session.segments(leaf)
        for k, chain in enumerate(chains):
            trace_id = sid if side_name is None else f"{sid}:sidechain:{side_name}"
            if k < len(chains) - 1:
                trace_id += f":before-compact-{k + 1}"
            messages = session.messages(chain)
            if messages:
                traces.append(Trace(trace_id=trace_id, messages=tuple(messages)))
    for rec in session.recs:
        if rec.line not in session.used:
            stats.note(stats.dropped, session.unused_reason(rec), session.at(rec.line))
    stats.traces = len(traces)
    return traces, stats
