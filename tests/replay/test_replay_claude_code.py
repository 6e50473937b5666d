"""Claude Code sessions as Claude Code 2.x writes them: split and parallel tool_use records,
results hanging off sibling branches, meta feedback, sidechains, compaction, images,
corrupted lines; and the property that no state holds a tool call without its result."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from composer_mesh.replay.claude_code import parse_claude_code
from composer_mesh.replay.trace_io import MAX_DEPTH, ParseStats, read_jsonl
from composer_mesh.replay.traces import context_problem, trace_states

FIXTURES = Path(__file__).parent / "fixtures"
V2 = FIXTURES / "claude_session_v2.jsonl"
SID = "c0ffee00-1c2d-4e5f-8a9b-0123456789ab"
_TURNS = ("user", "assistant")


def _raw(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _blocks(rec: dict) -> list[dict]:
    content = rec["message"]["content"]
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def _results_in_file(raw: list[dict]) -> dict[str, dict]:
    """tool_use_id -> tool_result block, read straight from the records."""
    return {b["tool_use_id"]: b for r in raw if r.get("type") == "user" for b in _blocks(r) if b["type"] == "tool_result"}


def _expected_tool_content(block: dict) -> str:
    content = block["content"]
    if isinstance(content, str):
        return content
    return "\n".join(b["text"] if b["type"] == "text" else "[image]" for b in content)


def test_v2_session_parallel_results_meta_sidechain_compaction_images():
    raw = _raw(V2)
    traces, stats = parse_claude_code(V2)
    by_id = {t.trace_id: t.messages for t in traces}
    assert list(by_id) == [f"{SID}:before-compact-1", SID, f"{SID}:sidechain:a1b2c3d4"]
    pre = by_id[f"{SID}:before-compact-1"]
    results = _results_in_file(raw)

    # one API response = thinking + text + three tool_use records sharing message.id: one message,
    # its calls in the order written, each followed at once by the result written for it
    first_id = next(r["message"]["id"] for r in raw if r.get("type") == "assistant")
    parts = [r for r in raw if r.get("type") == "assistant" and r["message"]["id"] == first_id]
    calls = [b for r in parts for b in _blocks(r) if b["type"] == "tool_use"]
    assert len(parts) == 5 and len(calls) == 3
    turn = pre[1]
    assert [c["id"] for c in turn["tool_calls"]] == [c["id"] for c in calls]
    assert [json.loads(c["function"]["arguments"]) for c in turn["tool_calls"]] == [c["input"] for c in calls]
    assert turn["reasoning"] == parts[0]["message"]["content"][0]["thinking"]
    assert turn["content"] == parts[1]["message"]["content"][0]["text"]
    for msg, call in zip(pre[2:5], calls):
        assert msg["role"] == "tool" and msg["tool_call_id"] == call["id"]
        assert msg["content"] == _expected_tool_content(results[call["id"]])
        assert msg.get("is_error", False) == results[call["id"]].get("is_error", False)
    # the real topology: results hang off their own tool_use record, so two of three are off the leaf's path
    assert stats.notes["reattached_result"] >= 2 and "off_thread" not in stats.dropped

    # harness feedback the model acted on is kept and marked, and the answer to it follows
    meta_at = next(i for i, m in enumerate(pre) if m.get("meta"))
    assert pre[meta_at]["content"].startswith("Stop hook feedback:")
    assert pre[meta_at + 1]["role"] == "assistant" and pre[meta_at + 1]["tool_calls"][0]["function"]["name"] == "Bash"
    # images are placeholders (text-only teachers), counted; redacted thinking is omitted, counted
    assert pre[meta_at + 4]["content"] == "[image]\nThe checkout page still shows this. Why?"
    assert stats.notes["image_placeholder"] == 2 and stats.notes["omitted_block:redacted_thinking"] == 1
    assert "EmwKAhgBEgy3va3pzix" not in json.dumps([t.messages for t in traces])

    # after /compact the thread starts at the summary; the sub-agent's conversation is its own trace
    post = by_id[SID]
    assert post[0]["compact_summary"] is True and post[1] == {"role": "user", "content": "Fix invoice.py the same way."}
    side = by_id[f"{SID}:sidechain:a1b2c3d4"]
    assert side[0]["content"].startswith("Search /home/dev/shop") and side[-1]["content"].startswith("One more")
    assert "Search /home/dev/shop for other" not in json.dumps(pre[:1])

    # every record is in a trace or dropped as not conversation; nothing is lost
    not_conversation = sum(1 for r in raw if r.get("type") not in _TURNS)
    assert sum(stats.dropped.values()) == not_conversation
    all_states = [s for t in traces for s in trace_states(t, 0, stats)]
    assert not stats.states_dropped
    assert len(all_states) == sum(1 for t in traces for m in t.messages[1:] if m["role"] == "assistant")
    assert all(context_problem(s.context) is None for s in all_states)


def _turn_tokens(rec: dict) -> list[str]:
    """What of a record must survive into some trace: its texts, thoughts and tool ids."""
    out = []
    for b in _blocks(rec):
        if b["type"] == "text":
            out.append(b["text"])
        elif b["type"] == "thinking":
            out.append(b["thinking"])
        elif b["type"] == "tool_use":
            out.append(b["id"])
        elif b["type"] == "tool_result":
            out.append(b["tool_use_id"])
    return out


def test_one_corrupted_middle_line_keeps_every_other_record(tmp_path):
    """Every conversation line in turn is cut mid-record: the others all stay (a result whose
    call was on the cut line is dropped as orphan, as an API would refuse it), the gap is
    bridged and reported by line number, and no state holds a call without its result."""
    lines = V2.read_text().splitlines()
    raw = [json.loads(line) for line in lines]
    middle = [i for i, r in enumerate(raw) if r.get("type") in _TURNS][1:-1]
    assert len(middle) > 25
    for k in middle:
        path = tmp_path / f"cut{k + 1}.jsonl"
        path.write_text("\n".join(line if i != k else line[: len(line) // 2] for i, line in enumerate(lines)) + "\n")
        traces, stats = parse_claude_code(path)
        assert stats.skipped == {"malformed_json": 1} and stats.where["malformed_json"] == [f"{path}:{k + 1}"]
        assert "off_thread" not in stats.dropped, (k, stats.as_dict())
        lost_calls = {b["id"] for b in _blocks(raw[k]) if b["type"] == "tool_use"}
        dump = json.dumps([t.messages for t in traces])
        for i, rec in enumerate(raw):
            if i == k or rec.get("type") not in _TURNS:
                continue
            for token in _turn_tokens(rec):
                if token in lost_calls:
                    assert token not in dump and stats.dropped["orphan_tool_result"] >= 1
                else:
                    assert json.dumps(token)[1:-1] in dump, (k + 1, i + 1, token[:40])
        assert "cart total is off by a cent" in dump  # the user's task survives
        assert stats.where.get("bridged", [f"{path}:{k + 1}"]) == [f"{path}:{k + 1}"]
        for trace in traces:
            for state in trace_states(trace, 0, stats):
                assert context_problem(state.context) is None


# ------------------------------------------------------------------ property: calls and results

_BASE = {"isSidechain": False, "userType": "external", "cwd": "/w", "sessionId": "prop", "version": "2.0.76"}


@st.composite
def _sessions(draw):
    """A session in Claude Code's topology, from a random plan of turns.

    Each assistant turn is one API response split into one record per block; its
    k parallel tool_use records are chained, each result's parentUuid is its own
    tool_use record, results are written in a random order and some are never
    written (the session was killed mid-tool); the next turn hangs off the last
    record written. Returns (records, ground truth turns).
    """
    records, turns, n = [], [], [0]

    def uid() -> str:
        n[0] += 1
        return f"u{n[0]}"

    parent = None
    for t in range(draw(st.integers(1, 6))):
        user = {**_BASE, "type": "user", "uuid": uid(), "parentUuid": parent,
                "isMeta": draw(st.booleans()), "message": {"role": "user", "content": f"ask {t}"}}
        records.append(user)
        parent = user["uuid"]
        for a in range(draw(st.integers(1, 3))):
            mid = f"msg_{t}_{a}"
            k = draw(st.integers(0, 4))
            head = draw(st.sampled_from(["text", "thinking", "none"]))
            blocks = [] if head == "none" else [{"type": head, head: f"{head} {t}.{a}"}]
            ids = [f"toolu_{t}_{a}_{j}" for j in range(k)]
            blocks += [{"type": "tool_use", "id": i, "name": "Bash", "input": {"command": f"echo {i}"}} for i in ids]
            if not blocks:
                blocks = [{"type": "text", "text": f"done {t}.{a}"}]
            owners = {}
            for block in blocks:
                rec = {**_BASE, "type": "assistant", "uuid": uid(), "parentUuid": parent,
                       "message": {"id": mid, "role": "assistant", "model": "claude-x", "content": [block]}}
                records.append(rec)
                parent = rec["uuid"]
                if block["type"] == "tool_use":
                    owners[block["id"]] = rec["uuid"]
            written = [i for i in ids if draw(st.integers(0, 9)) > 0]  # ~10% never answered
            order = draw(st.permutations(written))
            for i in order:
                rec = {**_BASE, "type": "user", "uuid": uid(), "parentUuid": owners[i], "sourceToolAssistantUUID": owners[i],
                       "toolUseResult": {"stdout": i}, "message": {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": i, "content": f"out {i}"}]}}
                records.append(rec)
                parent = rec["uuid"]
            turns.append((ids, set(written)))
    return records, turns


@settings(max_examples=120, deadline=None)
@given(session=_sessions())
def test_every_tool_use_has_its_result_in_the_state_or_the_state_is_counted(tmp_path_factory, session):
    records, turns = session
    path = tmp_path_factory.mktemp("prop") / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    traces, stats = parse_claude_code(path)
    assert [t.trace_id for t in traces] == ["prop"] and "off_thread" not in stats.dropped
    states = trace_states(traces[0], 0, stats)
    # ground truth: assistant turn i is replayable iff every call of turns < i was answered
    first_unanswered = next((i for i, (ids, written) in enumerate(turns) if set(ids) - written), len(turns))
    assert [s.step for s in states] == list(range(min(first_unanswered + 1, len(turns))))
    assert stats.states_dropped == ({"unanswered_tool_call": len(turns) - first_unanswered - 1}
                                    if first_unanswered < len(turns) - 1 else {})
    for state in states:
        answered = {m["tool_call_id"]: m["content"] for m in state.context if m["role"] == "tool"}
        for msg in state.context:
            for call in msg.get("tool_calls", ()):
                assert answered[call["id"]] == f"out {call['id']}"
        assert [c["id"] for c in state.action.get("tool_calls", ())] == turns[state.step][0]


def test_context_problem_names_what_an_api_would_refuse():
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    user = {"role": "user", "content": "go"}

    def tool(i: str) -> dict:
        return {"role": "tool", "tool_call_id": i, "content": "x"}

    assert context_problem([user, call, tool("b"), tool("a"), user]) is None
    assert context_problem([user, call, tool("a"), user]) == "unanswered_tool_call"
    assert context_problem([user, call, tool("a")]) == "unanswered_tool_call"
    assert context_problem([user, call, tool("a"), tool("b"), tool("a")]) == "orphan_tool_result"
    assert context_problem([user, tool("a")]) == "orphan_tool_result"
    stats = ParseStats()
    stats.note(stats.dropped, "r", "f:1")
    stats.note(stats.dropped, "r", "f:1")
    assert stats.dropped["r"] == 2 and stats.where["r"] == ["f:1"]


def test_nesting_depth_limit_is_exact(tmp_path):
    def nested(depth: int) -> str:  # a record whose containers nest `depth` levels
        return '{"type": "user", "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"

    path = tmp_path / "deep.jsonl"
    path.write_text(f"{nested(MAX_DEPTH)}\n{nested(MAX_DEPTH + 1)}\n")
    rows, stats = read_jsonl(path)
    assert [line for line, _ in rows] == [1] and stats.where["too_deep"] == [f"{path}:2"]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    """Every key path into a JSON value."""
    yield prefix
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield from _paths(child, (*prefix, key))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_any_field_of_any_record_set_to_any_json_never_raises(tmp_path_factory, data):
    """Wrong types in every field, found by search: some field of some records of the v2
    session replaced by arbitrary JSON; parsing never raises, lines add up, and no state
    holds a call without its result."""
    raw = _raw(V2)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        path = data.draw(st.sampled_from([p for p in _paths(raw[i]) if p]))
        node = raw[i]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = data.draw(_json)
    file = tmp_path_factory.mktemp("mut") / "s.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in raw))
    traces, stats = parse_claude_code(file)
    assert stats.parsed + sum(stats.skipped.values()) == stats.lines == len(raw)
    for trace in traces:
        for state in trace_states(trace, 0, stats):
            assert context_problem(state.context) is None
            json.dumps(state.context)


def test_sidechain_only_files_and_sidechains_sharing_an_agent_id(tmp_path):
    """Claude Code >= 2.0 writes each sub-agent to its own `agent-<id>.jsonl` (every record
    isSidechain); older files interleave several sidechains. Each is one trace, ids unique."""
    def side(uuid, parent, kind, text, agent):
        content = text if kind == "user" else [{"type": "text", "text": text}]
        msg = {"role": kind, "content": content, **({"id": f"m{uuid}", "model": "claude-x"} if kind == "assistant" else {})}
        return {"type": kind, "uuid": uuid, "parentUuid": parent, "isSidechain": True, "sessionId": "s",
                "agentId": agent, "message": msg}

    recs = [side("1", None, "user", "task one", "ag"), side("2", None, "user", "task two", "ag"),
            side("3", "1", "assistant", "answer one", "ag"), side("4", "2", "assistant", "answer two", "ag")]
    path = tmp_path / "agent-ag.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    traces, stats = parse_claude_code(path)
    assert {t.trace_id: [m["content"] for m in t.messages] for t in traces} == {
        "s:sidechain:ag": ["task one", "answer one"], "s:sidechain:2": ["task two", "answer two"]}
    assert not stats.dropped


@settings(max_examples=100, deadline=None)
@given(session=_sessions(), data=st.data())
def test_any_one_lost_line_loses_only_that_record(tmp_path_factory, session, data):
    """The corrupted-line sweep over random sessions: whichever line is cut, every other
    record's text, thought and tool ids are still in the trace (a result whose call was on the
    cut line excepted), nothing is `off_thread`, and the cut is reported by its line."""
    records, _ = session
    k = data.draw(st.integers(0, len(records) - 1))
    lines = [json.dumps(r) for r in records]
    lines[k] = lines[k][: len(lines[k]) // 2]
    path = tmp_path_factory.mktemp("cut") / "s.jsonl"
    path.write_text("\n".join(lines) + "\n")
    traces, stats = parse_claude_code(path)
    assert stats.where["malformed_json"] == [f"{path}:{k + 1}"] and "off_thread" not in stats.dropped
    lost_calls = {b["id"] for b in _blocks(records[k]) if b["type"] == "tool_use"}
    dump = json.dumps([t.messages for t in traces])
    for i, rec in enumerate(records):
        for token in _turn_tokens(rec) if i != k else ():
            assert (token in lost_calls) != (json.dumps(token)[1:-1] in dump), (k, i, token)
    for trace in traces:
        for state in trace_states(trace, 0, stats):
            assert context_problem(state.context) is None
