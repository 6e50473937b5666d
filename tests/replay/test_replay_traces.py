"""Trace ingestion: Claude Code sessions and OpenAI chat traces → states."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from composer_mesh.configs.records import ErrorKind
from composer_mesh.replay.claude_code import parse_claude_code
from composer_mesh.replay.trace_io import read_jsonl
from composer_mesh.replay.traces import load_traces, parse_openai_chat, trace_states

FIXTURES = Path(__file__).parent / "fixtures"
SESSION = FIXTURES / "claude_session.jsonl"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_claude_session_main_thread_and_drops():
    traces, stats = parse_claude_code(SESSION)
    sid = "5b0c1e8a-3f7d-4c2e-9a61-2d8f4b7c9e10"
    assert [t.trace_id for t in traces] == [sid, f"{sid}:sidechain:e3151288-62c3-4a4f-b774-eb5248db40af"]
    msgs = traces[0].messages
    assert [m["role"] for m in msgs] == [
        "user", "assistant", "tool", "assistant", "tool", "assistant", "tool", "tool", "user", "user", "assistant",
        "tool", "assistant",
    ]
    raw = _records(SESSION)
    # every record is accounted for: in the thread, or dropped with a reason
    kinds = {r.get("type") for r in raw}
    assert {"queue-operation", "file-history-snapshot", "summary", "system"} <= kinds
    assert stats.notes["meta"] == sum(1 for r in raw if r.get("isMeta")) == 1
    assert msgs[8]["meta"] is True and msgs[8]["content"].startswith("Caveat:")  # the model was sent it
    assert stats.dropped["summary"] == 1 and stats.dropped["system"] == 1
    assert stats.dropped["queue-operation"] == 2 and stats.dropped["file-history-snapshot"] == 1
    assert stats.dropped["off_thread"] == 1 and stats.dropped["synthetic"] == 1  # the abandoned branch
    text = json.dumps(msgs)
    assert "subtract function" not in text and "API Error" not in text  # abandoned branch
    assert "other uses of add()" not in text  # the sidechain is its own trace
    assert [m["role"] for m in traces[1].messages] == ["user", "assistant"]
    assert traces[1].messages[0]["content"] == "Search the repo for other uses of add()"


def test_split_assistant_lines_merge_into_one_message_with_thinking():
    raw = _records(SESSION)
    first_id = next(r["message"]["id"] for r in raw if r.get("type") == "assistant")
    assert sum(1 for r in raw if r.get("type") == "assistant" and r["message"]["id"] == first_id) == 3
    msg = parse_claude_code(SESSION)[0][0].messages[1]
    assert msg["content"] == "I'll run the tests first to see what fails."
    assert msg["reasoning"].startswith("The user wants the failing test fixed")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["Bash"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"])["command"] == "python -m pytest -q"


def test_parallel_tool_calls_and_error_results():
    msgs = parse_claude_code(SESSION)[0][0].messages
    parallel = msgs[5]
    assert [c["function"]["name"] for c in parallel["tool_calls"]] == ["Edit", "Bash"]
    ids = [c["id"] for c in parallel["tool_calls"]]
    assert [m["tool_call_id"] for m in msgs[6:8]] == ids
    assert "is_error" not in msgs[6] and msgs[7]["is_error"] is True
    assert msgs[2]["is_error"] is True and "1 failed" in msgs[2]["content"]
    assert msgs[4]["content"].startswith("     1\tdef add")  # list-of-blocks tool result flattened


def test_states_strip_thinking_from_context_but_keep_it_in_the_action():
    trace = parse_claude_code(SESSION)[0][0]
    states = trace_states(trace)
    assert [s.step for s in states] == [0, 1, 2, 3, 4]
    assert states[0].action["reasoning"]
    for s in states:
        assert all("reasoning" not in m for m in s.context)
    last = states[-1]
    assert [(e.turn, e.kind, e.tool) for e in last.error_sites] == [
        (1, ErrorKind.TEST_FAILURE, "Bash"), (5, ErrorKind.FILE_NOT_FOUND, "Bash"),
    ]
    for site in last.error_sites:
        assert last.context[site.turn]["role"] == "assistant"
    assert set(last.tools) == {"Bash", "Read", "Edit"}


def test_truncated_last_line_and_corrupt_line_are_skipped_and_counted():
    traces, stats = load_traces(FIXTURES / "claude_session_truncated.jsonl")
    assert stats.skipped == {"malformed_json": 1, "truncated": 1}
    assert stats.parsed + sum(stats.skipped.values()) == stats.lines == 8
    msgs = traces[0].messages
    assert msgs[-1] == {"role": "user", "content": "and with hidden files?"}
    assert [s.step for s in trace_states(traces[0])] == [0, 1]


def test_openai_chat_traces():
    traces, stats = parse_openai_chat(FIXTURES / "openai_traces.jsonl")
    assert [t.trace_id for t in traces] == ["oa-1", "openai_traces:2"]
    assert stats.skipped == {"malformed_json": 1} and stats.dropped == {"bad_role": 1}
    assert stats.where["bad_role"] == [f"{FIXTURES / 'openai_traces.jsonl'}:3"]
    states = trace_states(traces[0])
    assert states[0].action["reasoning"] == "Look at the file and run tests."
    assert len(states[0].action["tool_calls"]) == 2
    assert [(e.turn, e.kind, e.tool) for e in states[1].error_sites] == [(2, ErrorKind.TEST_FAILURE, "run")]
    assert load_traces(FIXTURES / "openai_traces.jsonl")[0] == traces  # format detection


def test_context_window_never_starts_with_orphan_tool_results():
    trace = parse_claude_code(SESSION)[0][0]
    for s in trace_states(trace, max_context_messages=2):
        assert s.context[0]["role"] != "tool" and len(s.context) <= 2


_real_lines = SESSION.read_bytes().split(b"\n")[:-1]
_line = st.one_of(
    st.sampled_from(_real_lines),
    st.sampled_from(_real_lines).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),  # cut
    st.binary(max_size=60),  # garbage, including invalid UTF-8
    st.sampled_from([b"", b"   ", b"[]", b"42", b'"str"', b"null", b'{"type": "assistant"}', b'{"type":"user","message":7}']),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_line, max_size=25), trailing_newline=st.booleans(), fmt=st.sampled_from(["claude_code", "openai"]))
def test_fuzz_corrupted_jsonl_never_raises_and_counts_add_up(tmp_path_factory, lines, trailing_newline, fmt):
    path = tmp_path_factory.mktemp("fuzz") / "t.jsonl"
    content = b"\n".join(line.replace(b"\n", b" ") for line in lines) + (b"\n" if trailing_newline and lines else b"")
    path.write_bytes(content)
    rows, stats = read_jsonl(path)
    # a line is newline-terminated, or the unterminated tail of the file
    expected_lines = content.count(b"\n") + (0 if content.endswith(b"\n") or not content else 1)
    assert stats.lines == expected_lines
    assert stats.parsed + sum(stats.skipped.values()) == stats.lines
    assert len(rows) == stats.parsed
    traces, stats2 = load_traces(path, fmt)
    assert stats2.parsed + sum(stats2.skipped.values()) == stats2.lines == stats.lines
    for trace in traces:
        for state in trace_states(trace):
            assert state.action["role"] == "assistant"
            assert all("reasoning" not in m for m in state.context)


def test_compaction_starts_the_context_at_the_boundary_and_multi_result_records(tmp_path):
    """After /compact the model sees the summary, not the old turns; one user record
    may also carry several tool results (older Claude Code versions)."""
    base = {"isSidechain": False, "userType": "external", "sessionId": "s", "version": "1.0.80", "cwd": "/w"}
    recs = [
        {**base, "type": "user", "uuid": "u1", "parentUuid": None, "message": {"role": "user", "content": "old task"}},
        {**base, "type": "assistant", "uuid": "a1", "parentUuid": "u1",
         "message": {"id": "m1", "role": "assistant", "model": "claude-x", "content": [
             {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
             {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "pwd"}}]}},
        {**base, "type": "user", "uuid": "u2", "parentUuid": "a1", "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "/w"}]}},
        {**base, "type": "system", "subtype": "compact_boundary", "uuid": "b1", "parentUuid": None,
         "logicalParentUuid": "u2", "content": "Conversation compacted", "compactMetadata": {"trigger": "manual"}},
        {**base, "type": "user", "uuid": "u3", "parentUuid": "b1", "isCompactSummary": True,
         "message": {"role": "user", "content": "This session is being continued. Summary: listed a.py in /w."}},
        {**base, "type": "assistant", "uuid": "a2", "parentUuid": "u3",
         "message": {"id": "m2", "role": "assistant", "model": "claude-x", "content": "Continuing."}},
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    pre, post = parse_claude_code(path)[0]
    assert [m["role"] for m in post.messages] == ["user", "assistant"] and post.trace_id == "s"
    assert post.messages[0]["content"].startswith("This session is being continued")
    assert post.messages[0]["compact_summary"] is True
    assert post.messages[1] == {"role": "assistant", "content": "Continuing."}
    # the turns before /compact are what the model saw then: their own trace
    assert pre.trace_id == "s:before-compact-1" and pre.messages[0] == {"role": "user", "content": "old task"}
    assert [m.get("tool_call_id") for m in pre.messages[2:]] == ["toolu_1", "toolu_2"]


def test_openai_developer_role_is_read_as_system(tmp_path):
    path = tmp_path / "dev.jsonl"
    path.write_text(json.dumps({"id": "d", "messages": [
        {"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}]}) + "\n")
    traces, stats = parse_openai_chat(path)
    assert stats.dropped == {} and [m["role"] for m in traces[0].messages] == ["system", "user", "assistant"]
