"""Trace files as lines: JSONL reading that skips bad lines and says where they were.

Shared by the Claude Code and OpenAI chat readers (`replay/claude_code.py`,
`replay/traces.py`). Nothing here raises on bad content: every line is parsed,
or skipped and counted by reason with its `file:line`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BOM = b"\xef\xbb\xbf"
# `file:line` locations kept per reason (the count is always complete).
MAX_WHERE = 5
# Deeper values are skipped as `too_deep`: json decodes up to ~1000 levels, but
# later json.dumps calls (cache keys, requests) from deeper stacks would not.
MAX_DEPTH = 200


@dataclass(frozen=True)
class Trace:
    """One conversation: OpenAI-style messages (assistant `reasoning` kept)."""

    trace_id: str
    messages: tuple[dict, ...]


@dataclass
class ParseStats:
    """Line, record and state accounting for one or more trace files.

    lines = parsed + sum(skipped.values()); `skipped` counts lines that are not
    JSON objects (by reason), `dropped` parsed records that are in no trace,
    `notes` what was kept only by a repair or with a change (meta records,
    bridged gaps, re-attached parallel results, image placeholders),
    `states_dropped` states refused by `trace_states`. `where[reason]` holds the first `MAX_WHERE`
    `file:line` (or `trace:step`) locations; `warnings` says what produced nothing;
    `traces` and `states` count what was built.
    """

    lines: int = 0
    parsed: int = 0
    skipped: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)
    states_dropped: Counter = field(default_factory=Counter)
    where: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    traces: int = 0
    states: int = 0

    def note(self, counter: Counter, reason: str, where: str, n: int = 1) -> None:
        """Count `n` of `reason` in `counter` and remember where it happened."""
        counter[reason] += n
        places = self.where.setdefault(reason, [])
        if len(places) < MAX_WHERE and where not in places:
            places.append(where)

    def add(self, other: "ParseStats") -> None:
        self.lines += other.lines
        self.parsed += other.parsed
        for mine, theirs in ((self.skipped, other.skipped), (self.dropped, other.dropped),
                             (self.notes, other.notes), (self.states_dropped, other.states_dropped)):
            mine.update(theirs)
        for reason, places in other.where.items():
            mine_places = self.where.setdefault(reason, [])
            mine_places.extend(p for p in places if p not in mine_places)
            del mine_places[MAX_WHERE:]
        self.warnings.extend(other.warnings)
        self.traces += other.traces
        self.states += other.states

    def as_dict(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "parsed": self.parsed,
            "skipped": dict(self.skipped),
            "dropped": dict(self.dropped),
            "notes": dict(self.notes),
            "states_dropped": dict(self.states_dropped),
            "where": {k: list(v) for k, v in self.where.items()},
            "warnings": list(self.warnings),
            "traces": self.traces,
            "states": self.states,
        }


def read_jsonl(path: str | Path) -> tuple[list[tuple[int, dict]], ParseStats]:
    """(line number, object) for every line that decodes to a JSON object or list, plus counts.

    A UTF-8 BOM and a CR before the newline are tolerated on any line. Skips (by
    reason, with `file:line`) blank lines, undecodable bytes, malformed JSON,
    NaN / infinite numbers, nesting deeper than `MAX_DEPTH`, unpaired UTF-16
    surrogate escapes,
    non-object values, and a truncated last line
    (no newline and not JSON). A JSON list is returned as `{"messages": list}`.
    """
    stats = ParseStats()
    out: list[tuple[int, dict]] = []
    raw = Path(path).read_bytes()
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        # the newline after the last line ends it; it adds no line
        lines.pop()
    last_unterminated = not raw.endswith(b"\n")
    for i, line in enumerate(lines, start=1):
        stats.lines += 1
        where = f"{path}:{i}"
        line = line.removeprefix(_BOM).removesuffix(b"\r")
        if not line.strip():
            stats.note(stats.skipped, "blank", where)
            continue
        try:
            obj = json.loads(line.decode("utf-8"), parse_constant=_non_finite, parse_float=_finite_float)
        except UnicodeDecodeError:
            stats.note(stats.skipped, "bad_utf8", where)
            continue
        except _NonFinite:
            stats.note(stats.skipped, "non_finite_number", where)
            continue
        except RecursionError:
            stats.note(stats.skipped, "too_deep", where)
            continue
        except ValueError:
            truncated = last_unterminated and i == len(lines)
            stats.note(stats.skipped, "truncated" if truncated else "malformed_json", where)
            continue
        if not isinstance(obj, (dict, list)):
            stats.note(stats.skipped, "not_object", where)
            continue
        if _deeper_than(obj, MAX_DEPTH):
            stats.note(stats.skipped, "too_deep", where)
            continue
        if (b"\\ud" in line or b"\\uD" in line) and _has_lone_surrogate(obj):
            stats.note(stats.skipped, "lone_surrogate", where)
            continue
        stats.parsed += 1
        out.append((i, obj if isinstance(obj, dict) else {"messages": obj}))
    if not raw:
        stats.warnings.append(f"{path}: empty file")
    return out, stats


class _NonFinite(ValueError):
    """NaN or an infinity: Python's json reads them, strict JSON (and request bodies) refuse them."""


def _non_finite(token: str) -> float:
    raise _NonFinite(token)


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):  # 1e999
        raise _NonFinite(token)
    return value


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` levels (iterative: no recursion to blow)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _has_lone_surrogate(obj: Any) -> bool:
    """Whether a decoded value holds a `\\udXXX` escape that is not half of a pair: such a
    string cannot be written as UTF-8 (dataset, cache, request body)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def text_of(content: Any) -> tuple[str, int]:
    """(text, images) of a tool_result / user content: a string or a list of blocks.

    Image blocks become an `[image]` placeholder (teachers are text-only chat
    endpoints; base64 data would fill their context); `images` counts them.
    """
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        return ("" if content is None else json.dumps(content, ensure_ascii=False)), 0
    parts, images = [], 0
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") == "image":
            parts.append("[image]")
            images += 1
    return "\n".join(parts), images
