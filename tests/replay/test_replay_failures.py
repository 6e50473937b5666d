"""Failures and context limits as a user of `composer-mesh replay` sees them, against the real local server.

- every call refused with the same client error: the teacher is stopped after
  `stop_after_client_errors` calls, the summary groups the failures by teacher
  and reason with the server's message, and the command exits 1;
- states longer than a teacher's context (learnt from `/v1/models`
  `max_model_len`, or set in the config) are skipped or trimmed before anything
  is paid, reported as skipped, not failed; a server's own context-length 400
  is a free skip too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_mesh.configs.sections.teachers import TeacherSpec, TeachersConfig
from composer_mesh.mesh.cli import main
from composer_mesh.replay.server import ConsensusResponder, TeacherServer
from composer_mesh.replay.teachers import SyncTeacherClient

FIXTURES = Path(__file__).parent / "fixtures"
TRACES = [FIXTURES / "claude_session.jsonl", FIXTURES / "openai_traces.jsonl"]
MODELS = ("m-a", "m-b")


def _config(path: Path, url: str, out: Path, teachers: str = "", **replay: object) -> Path:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in replay.items())
    path.write_text(f"""
[replay]
traces = {json.dumps([str(t) for t in TRACES])}
output_dir = "{out}"
min_agree = 2
{extra}
[teachers]
base_url = "{url}"
budget_usd = 1.0
max_retries = 1
backoff_base_s = 0.01
{teachers}
[[teachers.models]]
name = "a"
model = "{MODELS[0]}"
price_in_per_mtok = 1.0
price_out_per_mtok = 2.0
max_tokens = 8
[[teachers.models]]
name = "b"
model = "{MODELS[1]}"
price_in_per_mtok = 1.0
price_out_per_mtok = 2.0
max_tokens = 8
""")
    return path


def _replay(cfg: Path, capsys) -> tuple[int, list[str], str, dict]:
    rc = main(["replay", "--no-progress", str(cfg)])
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    return rc, lines, captured.err, json.loads(lines[-1])


def test_every_call_refused_stops_the_teacher_and_exits_nonzero(tmp_path, capsys):
    # the server serves other model names: every call is the same 404, as a wrong `model` key gives
    with TeacherServer(ConsensusResponder(), models=["served"]) as server:
        cfg = _config(tmp_path / "r.toml", server.url, tmp_path / "out", concurrency=8)
        rc, lines, err, brief = _replay(cfg, capsys)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert rc == 1 and "error: no pair made" in err
    assert brief["pairs_raw"] == 0 and brief["failures"] == brief["teacher_calls"] == 2 * brief["states"]
    # 8 states at once, yet a teacher's first calls go one at a time: exactly N requests per teacher went out
    assert summary["client"]["requests"] == 2 * 3
    assert summary["client"]["stopped"] == {t: f"HTTP 404: {json.dumps({'error': {'message': f'model {m!r} not found', 'type': 'not_found'}}, separators=(',', ':'))}"
                                            for t, m in zip("ab", MODELS)}
    for teacher, model in zip("ab", MODELS):
        groups = summary["failures_by_teacher"][teacher]
        assert groups["client_error 404"]["count"] == 3 and f"model '{model}' not found" in groups["client_error 404"]["message"]
        assert groups["stopped"]["count"] == brief["states"] - 3
        rows = {ln.split()[2]: ln.split() for ln in lines if ln.startswith(f"  {teacher} ") and "stopped:" not in ln}
        assert rows["client_error"][1:5] == ["failed", "client_error", "404", "3"] and f"'{model}'" in " ".join(rows["client_error"])
        assert rows["stopped"][1:4] == ["failed", "stopped", str(brief["states"] - 3)]
        assert any(ln.startswith(f"  {teacher} ") and "stopped: its first calls all failed with: HTTP 404" in ln for ln in lines)


def test_stop_needs_the_first_calls_to_fail_the_same_way():
    """A teacher that answered once is never stopped; different client errors do not stop it."""
    with TeacherServer(ConsensusResponder(), models=["m"]) as server:
        cfg = TeachersConfig(base_url=server.url, max_retries=0, stop_after_client_errors=2, models=(
            TeacherSpec(name="ok-then-bad", model="m"), TeacherSpec(name="varied", model="x")))
        client = SyncTeacherClient(cfg)
        try:
            assert client.complete("ok-then-bad", [{"role": "user", "content": "hi"}]).error is None
            server.models = ("other",)
            kinds = [client.complete("ok-then-bad", [{"role": "user", "content": f"q{i}"}]).error.kind for i in range(3)]
            assert kinds == ["client_error"] * 3
            server.api_key = "k"  # 401 first, then (with the key check gone) a 404: two different errors
            first = client.complete("varied", [{"role": "user", "content": "a"}]).error
            server.api_key = None
            second = client.complete("varied", [{"role": "user", "content": "b"}]).error
            third = client.complete("varied", [{"role": "user", "content": "c"}]).error
            assert (first.status, second.status, third.status) == (401, 404, 404)
            assert client.client.stats.stopped == {}
        finally:
            client.close()


@pytest.fixture(scope="module")
def sized_server():
    """A server with a 600-token context; its word-count tokens are well under the client's byte bound."""
    with TeacherServer(ConsensusResponder(choices=2, noise=0.0), models=MODELS, max_model_len=600) as server:
        yield server


@pytest.mark.parametrize("overflow", ["skip", "trim"])
def test_oversize_states_are_skipped_or_trimmed_before_paying(sized_server, tmp_path, capsys, overflow):
    server = sized_server
    n0 = len(server.log)
    cfg = _config(tmp_path / "r.toml", server.url, tmp_path / "out", f'context_overflow = "{overflow}"')
    rc, lines, err, brief = _replay(cfg, capsys)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    sent = server.log[n0:]
    assert rc == 0 and brief["failures"] == 0 and brief["pairs_raw"] > 0
    assert summary["client"]["context_limits"] == {"a": 600, "b": 600}  # learnt from /v1/models
    # nothing refused by the server, nothing over the limit sent, every answer billed
    assert all(r["outcome"] == "ok" and r["billed"] and r["prompt_tokens"] + 8 <= 600 for r in sent)
    skips = [f for f in summary["failures"] if f["kind"] == "context_length"]
    if overflow == "skip":
        assert skips and brief["context_skips"] == len(skips) and summary["client"]["trimmed"] == 0
        assert brief["outcomes"]["context_length"] == len(skips) // 2  # both teachers skip the same states
        assert len(sent) == 2 * brief["states"] - len(skips) == brief["teacher_calls"] - len(skips)
        assert any(ln.split()[1:4] == ["skipped", "context_length", str(len(skips) // 2)] for ln in lines)
        assert "exceeds the context length 600" in summary["failures_by_teacher"]["a"]["context_length"]["message"]
    else:  # the long states went out with their oldest messages dropped
        assert summary["client"]["trimmed"] > 0 and len(sent) + len(skips) == 2 * brief["states"]
        assert len(skips) < summary["client"]["trimmed"]


def test_config_limit_and_a_servers_own_refusal_are_skips(tmp_path, capsys):
    # the client believes 1 token per 1000 bytes and a 100k context: the server refuses long prompts itself
    with TeacherServer(ConsensusResponder(choices=2, noise=0.0), models=MODELS, max_model_len=100) as server:
        cfg = _config(tmp_path / "r.toml", server.url, tmp_path / "out",
                      "prompt_tokens_per_byte = 0.001\nprompt_tokens_overhead = 0")
        cfg.write_text(cfg.read_text().replace("max_tokens = 8\n", "max_tokens = 8\nmax_context_tokens = 100000\n"))
        rc, lines, err, brief = _replay(cfg, capsys)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    refused = [f for f in summary["failures"] if f["kind"] == "context_length"]
    assert rc == 0 and brief["failures"] == 0 and refused and brief["context_skips"] == len(refused)
    assert all(f["status"] == 400 and f["attempts"] == 1 and "maximum context length is 100" in f["message"] for f in refused)
    assert len(server.log) == 2 * brief["states"] - len(refused)  # refused requests were never answered, nor billed
    assert summary["client"]["context_limits"] == {} and summary["spend_usd"] == pytest.approx(
        sum(r["prompt_tokens"] * 1.0 + r["completion_tokens"] * 2.0 for r in server.log) / 1e6)
