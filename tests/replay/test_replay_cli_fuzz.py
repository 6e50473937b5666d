"""The fuzz table: hostile trace files through `composer-mesh replay` (one run on a directory).

Each case is a file; the CLI must finish without a traceback and its printed
summary must name every bad line as `file:line` with its reason; warnings for
files that yield nothing; budget refusals apart from failures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_mesh.replay.claude_code import parse_claude_code
from composer_mesh.replay.traces import load_traces, trace_states

FIXTURES = Path(__file__).parent / "fixtures"
V2 = FIXTURES / "claude_session_v2.jsonl"
REPO = Path(__file__).resolve().parents[2]
DEEP = 100_000

_USER = {"type": "user", "uuid": "u1", "parentUuid": None, "sessionId": "s", "isSidechain": False,
         "timestamp": "2025-12-01T09:00:00Z", "message": {"role": "user", "content": "hi"}}
_ASSISTANT = {"type": "assistant", "uuid": "a1", "parentUuid": "u1", "sessionId": "s", "message": {
    "id": "m1", "role": "assistant", "model": "claude-x", "content": [
        {"type": "text", "text": "t"}, {"type": "thinking", "thinking": "th"},
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]}}
_RESULT = {"type": "user", "uuid": "r1", "parentUuid": "a1", "sessionId": "s", "message": {"role": "user", "content": [
    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py", "is_error": False}]}}


def _set(rec: dict, path: tuple, value) -> dict:
    rec = json.loads(json.dumps(rec))
    node = rec
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return rec


# (record, path to the field, wrong value, reason): every field the reader looks at
_CC_WRONG = [
    (_USER, ("type",), 7, "bad_type:type"),
    (_USER, ("uuid",), ["u", "v"], "bad_type:uuid"),
    (_USER, ("parentUuid",), {"u": 1}, "bad_type:parentUuid"),
    (_USER, ("sessionId",), 7, "bad_type:sessionId"),
    (_USER, ("timestamp",), 1.5, "bad_type:timestamp"),
    (_USER, ("isSidechain",), "no", "bad_type:isSidechain"),
    (_USER, ("isMeta",), 1, "bad_type:isMeta"),
    (_USER, ("isCompactSummary",), "yes", "bad_type:isCompactSummary"),
    (_USER, ("agentId",), [], "bad_type:agentId"),
    (_RESULT, ("sourceToolAssistantUUID",), 5, "bad_type:sourceToolAssistantUUID"),
    (_USER, ("logicalParentUuid",), 5, "bad_type:logicalParentUuid"),
    (_USER, ("subtype",), 5, "bad_type:subtype"),
    (_USER, ("message",), "hi", "bad_type:message"),
    (_ASSISTANT, ("message", "id"), 5, "bad_type:message.id"),
    (_USER, ("message", "content"), 5, "bad_type:message.content"),
    (_ASSISTANT, ("message", "content", 0), "text", "bad_type:message.content[]"),
    (_ASSISTANT, ("message", "content", 0, "type"), 5, "bad_type:message.content[]"),
    (_ASSISTANT, ("message", "content", 0, "text"), 5, "bad_type:text.text"),
    (_ASSISTANT, ("message", "content", 1, "thinking"), None, "bad_type:thinking.thinking"),
    (_ASSISTANT, ("message", "content", 2, "id"), 5, "bad_type:tool_use.id"),
    (_ASSISTANT, ("message", "content", 2, "name"), None, "bad_type:tool_use.name"),
    (_ASSISTANT, ("message", "content", 2, "input"), "ls", "bad_type:tool_use.input"),
    (_RESULT, ("message", "content", 0, "tool_use_id"), 5, "bad_type:tool_result.tool_use_id"),
    (_RESULT, ("message", "content", 0, "is_error"), "true", "bad_type:tool_result.is_error"),
]
_CALL = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{}"}}
_OA = {"id": "o", "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                               {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "assistant", "content": "done"}]}
_OA_WRONG = [
    (("messages",), "x", "bad_type:messages"),
    (("messages",), [], "empty_trace"),
    (("messages", 0), "go", "bad_type:messages[]"),
    (("messages", 0, "role"), "robot", "bad_role"),
    (("messages", 0, "content"), 5, "bad_type:content"),
    (("messages", 1, "tool_calls"), "x", "bad_type:tool_calls"),
    (("messages", 1, "tool_calls", 0), 5, "bad_type:tool_calls[]"),
    (("messages", 1, "tool_calls", 0, "id"), 5, "bad_type:tool_calls.id"),
    (("messages", 1, "tool_calls", 0, "function"), "run()", "bad_type:tool_calls.function"),
    (("messages", 1, "tool_calls", 0, "function", "name"), ["run"], "bad_type:tool_calls.function.name"),
    (("messages", 1, "tool_calls", 0, "function", "arguments"), [1], "bad_type:tool_calls.function.arguments"),
    (("messages", 2, "tool_call_id"), 5, "bad_type:tool_call_id"),
    (("messages", 0, "name"), {"n": 1}, "bad_type:name"),
]


def _lines(recs: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in recs)


def _write_cases(d: Path) -> list[tuple[str, int, str]]:
    """The fuzz table as files in `d`; returns (file, line, reason) each bad line must be printed with."""
    good = V2.read_text()
    lines = good.splitlines(keepends=True)
    expect = []
    (d / "a_good.jsonl").write_text(good)
    (d / "truncated.jsonl").write_text("".join(lines[:10]) + lines[10][: len(lines[10]) // 2])
    expect.append(("truncated.jsonl", 11, "truncated"))
    (d / "non_json.jsonl").write_text("".join(lines[:12]) + "this is {not json\n" + "".join(lines[12:]))
    expect.append(("non_json.jsonl", 13, "malformed_json"))
    (d / "bad_utf8.jsonl").write_bytes(b"".join(x.encode() for x in lines[:3]) + b'{"type": "\xff\xfe"}\n')
    expect.append(("bad_utf8.jsonl", 4, "bad_utf8"))
    (d / "not_object.jsonl").write_text("".join(lines[:3]) + "42\n")
    expect.append(("not_object.jsonl", 4, "not_object"))
    # an unpaired surrogate escape decodes but cannot be written as UTF-8; a paired one (emoji) is fine
    emoji = _set(_USER, ("message", "content"), "\U0001F600 ok")
    lone = json.dumps(_set(_USER, ("message", "content"), "fix \ud800 this")).replace("u1", "u2")
    (d / "surrogate.jsonl").write_text(json.dumps(emoji) + "\n" + lone + "\n")
    expect.append(("surrogate.jsonl", 2, "lone_surrogate"))
    # NaN / Infinity / 1e999: Python's json reads them, request bodies cannot carry them
    oa = json.dumps(_OA)
    (d / "non_finite.jsonl").write_text("\n".join([oa, oa.replace('"go"', '"go", "name": NaN'),
                                                   oa.replace('"type": "function"', '"index": -Infinity'),
                                                   oa.replace('"content": "ok"', '"content": "ok", "w": 1e999')]) + "\n")
    expect += [("non_finite.jsonl", i, "non_finite_number") for i in (2, 3, 4)]
    nested_record = '{"type": "user", "message": {"content": ' + "[" * DEEP + "]" * DEEP + "}}"
    (d / "nested.jsonl").write_text(lines[2] + "[" * DEEP + "]" * DEEP + "\n" + nested_record + "\n")
    expect += [("nested.jsonl", 2, "too_deep"), ("nested.jsonl", 3, "too_deep")]
    wrong = [_set(rec, path, value) for rec, path, value, _ in _CC_WRONG]
    (d / "wrong_types.jsonl").write_text(_lines([_USER, *wrong]))
    expect += [("wrong_types.jsonl", i + 2, reason) for i, (*_, reason) in enumerate(_CC_WRONG)]
    (d / "openai_wrong.jsonl").write_text(_lines([_OA] + [_set(_OA, path, value) for path, value, _ in _OA_WRONG]))
    expect += [("openai_wrong.jsonl", i + 2, reason) for i, (*_, reason) in enumerate(_OA_WRONG)]
    (d / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + good.encode())
    (d / "crlf.jsonl").write_bytes(good.replace("\n", "\r\n").encode())
    (d / "duplicated.jsonl").write_text("".join(lines[:6] + lines[4:6] + lines[6:] + lines[20:21]))
    expect += [("duplicated.jsonl", 7, "duplicate"), ("duplicated.jsonl", 8, "duplicate"),
               ("duplicated.jsonl", len(lines) + 3, "duplicate")]
    # 20 MB: the session with a 20 MB tool output, and a corrupt line after it
    big = [json.loads(x) for x in lines]
    block = next(b for r in big if r.get("type") == "user" for b in r["message"]["content"] if isinstance(b, dict)
                 and b.get("type") == "tool_result")
    block["content"] = "x" * (20 << 20)
    (d / "big.jsonl").write_text(_lines(big[:20]) + '{"type": "user", "uuid": \n' + _lines(big[20:]))
    expect.append(("big.jsonl", 21, "malformed_json"))
    (d / "empty.jsonl").write_bytes(b"")
    (d / "no_trace.jsonl").write_text(lines[0] + lines[1])
    (d / "notes.txt").write_text("not a trace file: the directory glob is *.jsonl\n")
    return [(str(d / f), line, reason) for f, line, reason in expect]


@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    cases = root / "cases"
    cases.mkdir()
    expect = _write_cases(cases)
    cfg = root / "replay.toml"
    cfg.write_text(f"""
[replay]
traces = ["{cases}"]
output_dir = "{root / 'out'}"
max_states = 6
[replay.local_server]
enabled = true
responder = "consensus"
[teachers]
budget_usd = 0.002
[[teachers.models]]
name = "a"
model = "ma"
price_in_per_mtok = 1.0
price_out_per_mtok = 1.0
[[teachers.models]]
name = "b"
model = "mb"
price_in_per_mtok = 30.0
price_out_per_mtok = 30.0
""")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "composer_mesh.mesh.cli", "replay", "--no-progress", str(cfg)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return cases, expect, proc


def test_fuzz_table_no_traceback_and_every_bad_line_printed_with_file_and_line(fuzz_run):
    cases, expect, proc = fuzz_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    printed = proc.stdout.splitlines()
    for file, line, reason in expect:
        assert any(reason in row.split() and f"{file}:{line}" in row.split("  at ", 1)[-1].split(", ")
                   for row in printed), (file, line, reason)
    warnings = [w for w in proc.stderr.splitlines() if w.startswith("warning: ")]
    assert f"warning: {cases / 'empty.jsonl'}: empty file" in warnings
    assert any(w.startswith(f"warning: {cases / 'no_trace.jsonl'}: no usable claude_code trace") for w in warnings)
    brief = json.loads(printed[-1])
    assert printed[0].startswith(f"traces: {len(list(cases.glob('*.jsonl')))} file(s)")
    # every case file has its row; the BOM, CRLF and 20 MB files read like the clean one
    rows = {row.split(": ", 1)[0].removeprefix("  file "): row.split(": ", 1)[1] for row in printed if row.startswith("  file ")}
    assert set(rows) == {str(p) for p in cases.glob("*.jsonl")}
    n, traces = len(V2.read_text().splitlines()), load_traces(V2)[0]
    built = f"{len(traces)} traces, {sum(len(trace_states(t)) for t in traces)} states"
    good = f"{n} lines, {n} parsed, {built}"
    assert rows[str(cases / "a_good.jsonl")] == rows[str(cases / "bom.jsonl")] == rows[str(cases / "crlf.jsonl")] == good
    assert rows[str(cases / "big.jsonl")] == f"{n + 1} lines, {n} parsed, {built}"
    assert rows[str(cases / "empty.jsonl")] == "0 lines, 0 parsed, 0 traces, 0 states"
    assert rows[str(cases / "surrogate.jsonl")] == "2 lines, 1 parsed, 1 traces, 0 states"
    # the cap refuses the dear teacher's calls: refusals are counted apart from failures
    assert brief["budget_refusals"] > 0 and brief["failures"] == 0 and brief["outcomes"].get("budget", 0) > 0
    assert brief["skipped"]["too_deep"] == 2 and brief["dropped"]["duplicate"] == 3
    assert [f"warning: {w}" for w in brief["warnings"]] == warnings


def test_bom_crlf_and_duplicates_read_as_the_clean_file(fuzz_run):
    cases, _, _ = fuzz_run
    clean = load_traces(cases / "a_good.jsonl")[0]
    for name in ("bom.jsonl", "crlf.jsonl", "duplicated.jsonl"):
        traces, stats = load_traces(cases / name)
        assert traces == clean, name
        assert not stats.skipped and "off_thread" not in stats.dropped, (name, stats.as_dict())
    big, stats = parse_claude_code(cases / "big.jsonl")
    assert stats.skipped == {"malformed_json": 1} and len(big) == len(clean)
    assert sum(len(trace_states(t)) for t in big) == sum(len(trace_states(t)) for t in clean)


def test_missing_path_and_empty_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    (tmp_path / "empty").mkdir()
    for traces, rc, message in ((tmp_path / "nope.jsonl", 2, "no such file or directory"),
                                (tmp_path / "empty", 1, "directory holds no *.jsonl file")):
        cfg = tmp_path / "r.toml"
        cfg.write_text(f'[replay]\ntraces = ["{traces}"]\noutput_dir = "{tmp_path / "out"}"\n'
                       '[replay.local_server]\nenabled = true\n[[teachers.models]]\nname = "a"\nmodel = "a"\n')
        proc = subprocess.run([sys.executable, "-m", "composer_mesh.mesh.cli", "replay", "--no-progress", str(cfg)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == rc and message in proc.stderr and str(traces) in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
