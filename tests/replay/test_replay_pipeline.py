"""The replay run end to end: local server, faults, data-juicer, SIGKILL resume, CLI."""

from __future__ import annotations

import json
import os
import signal
import string
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from composer_mesh.configs.sections.replay import ReplayConfig
from composer_mesh.configs.sections.teachers import TeachersConfig, TeacherSpec
from composer_mesh.replay.normalize import run_recipe, validate_pairs
from composer_mesh.replay.pipeline import run_replay
from composer_mesh.replay.server import ConsensusResponder, FaultPlan, TeacherServer

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
FAULTY = {  # teacher name -> (model, fault plan that always fails)
    "r429": ("m-429", FaultPlan(p_rate_limit=1.0, retry_after_s=0.01)),
    "r500": ("m-500", FaultPlan(p_server_error=1.0)),
    "rbad": ("m-bad", FaultPlan(p_malformed=1.0)),
    "rdrop": ("m-drop", FaultPlan(p_disconnect=1.0)),
    "rslow": ("m-slow", FaultPlan(p_timeout=1.0, timeout_delay_s=3.0)),
}


def _agreeing(model, messages, params):
    """Two healthy teachers that always agree (and never with the recorded action)."""
    return {"content": "", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "Bash", "arguments": json.dumps({"command": f"echo {len(messages)}"})}}]}


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    with TeacherServer(_agreeing, model_faults={m: p for m, p in FAULTY.values()}) as server:
        specs = [TeacherSpec(name="good1", model="g1", price_in_per_mtok=1.0, price_out_per_mtok=2.0),
                 TeacherSpec(name="good2", model="g2", price_in_per_mtok=1.0, price_out_per_mtok=2.0)]
        specs += [TeacherSpec(name=n, model=m) for n, (m, _) in FAULTY.items()]
        teachers = TeachersConfig(models=tuple(specs), base_url=server.url, max_retries=1, backoff_base_s=0.001,
                                  read_timeout_s=1.5, budget_usd=1.0)
        # the session twice: its pairs come out twice, and deduplication must drop the copies
        cfg = ReplayConfig(traces=(str(FIXTURES / "claude_session.jsonl"), str(FIXTURES / "openai_traces.jsonl"),
                                   str(FIXTURES / "claude_session.jsonl")), output_dir=str(out), min_agree=2)
        summary = run_replay(cfg, teachers)
        log = list(server.log)
    return out, summary, log


def test_faults_are_retried_recorded_and_listed_without_crashing(pipeline_run):
    out, summary, log = pipeline_run
    states = summary["states"]
    assert states == 16 and summary["outcomes"] == {"pair": states}  # 2 x (5 main + 1 sidechain) + 4 OpenAI
    kinds = Counter((f["teacher"], f["kind"]) for f in summary["failures"])
    assert kinds == {("r429", "rate_limited"): states, ("r500", "server_error"): states, ("rbad", "malformed"): states,
                     ("rdrop", "disconnect"): states, ("rslow", "timeout"): states}
    assert all(f["attempts"] == 2 for f in summary["failures"])
    per_model = Counter(r["model"] for r in log)
    assert all(per_model[m] == 2 * states for m, _ in FAULTY.values())
    assert json.loads((out / "summary.json").read_text())["failures"] == summary["failures"]


def test_default_recipe_ran_on_pipeline_output_with_stats(pipeline_run):
    out, summary, _ = pipeline_run
    raw = [json.loads(line) for line in (out / "pairs_raw.jsonl").read_text().splitlines()]
    data = [json.loads(line) for line in (out / "dataset.jsonl").read_text().splitlines()]
    assert len(raw) == summary["pairs_raw"] == 16
    assert len({r["text"] for r in raw}) == 10  # the repeated session's 6 pairs are exact copies
    assert summary["dataset"]["records_out"] == len(data) == 10
    for rec in data:
        stats = rec["__dj__stats__"]
        assert stats["text_len"] == len(rec["text"])
        # words: whitespace split, stripped of punctuation and digits at both ends, empty ones dropped
        assert stats["num_words"] == sum(1 for w in rec["text"].split() if w.strip(string.punctuation + string.digits))
        assert 0 <= stats["special_char_ratio"] <= 0.6
        votes = json.loads(rec["votes_json"])
        assert votes["good1"] == votes["good2"] == "chosen" and votes["r500"] == "failed"
        assert json.loads(rec["chosen_json"])["tool_calls"][0]["function"]["name"] == "Bash"
    assert set(summary["dataset"]["stats"]) == {"text_len", "num_words", "special_char_ratio"}


def test_multiturn_recipe_and_validator_never_resynthesize(pipeline_run):
    out, _, _ = pipeline_run
    raw = [json.loads(line) for line in (out / "pairs_raw.jsonl").read_text().splitlines()]
    same = dict(raw[0], chosen_json=raw[0]["rejected_json"], chosen=raw[0]["rejected"])
    empty = dict(raw[1], rejected="  ")
    raw = list({r["text"]: r for r in raw}.values())  # distinct pairs
    valid, dropped = validate_pairs([same, empty] + raw)
    assert dropped == {"chosen_equals_rejected": 1, "empty_side": 1} and valid == raw
    res = run_recipe([same] + raw, out / "multiturn", "multiturn")
    assert res.dropped == {"chosen_equals_rejected": 1} and res.records_out == len(raw)
    for rec in (json.loads(line) for line in res.dataset.read_text().splitlines()):
        assert rec["__dj__stats__"]["text_len"] == len(rec["chosen"])  # text_key: chosen
        assert rec["chosen_json"] in {r["chosen_json"] for r in raw}


def _write_traces(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"t{i}", "messages": [
                {"role": "user", "content": f"problem {i}"}, {"role": "assistant", "content": "answer 9"},
                {"role": "user", "content": f"check {i} again"}, {"role": "assistant", "content": "answer 8"}]}) + "\n")


def _write_config(path: Path, traces: Path, out: Path, url: str) -> None:
    path.write_text(f"""
[replay]
traces = ["{traces}"]
output_dir = "{out}"
min_agree = 2
concurrency = 4
[replay.gating]
tiered = false
[teachers]
base_url = "{url}"
budget_usd = 1.0
[[teachers.models]]
name = "a"
model = "ma"
price_in_per_mtok = 1.0
price_out_per_mtok = 4.0
[[teachers.models]]
name = "b"
model = "mb"
price_in_per_mtok = 1.0
price_out_per_mtok = 4.0
[[teachers.models]]
name = "c"
model = "mc"
price_in_per_mtok = 2.0
price_out_per_mtok = 8.0
""")


def _replay_cmd(cfg: Path) -> list[str]:
    return [sys.executable, "-m", "composer_mesh.mesh.cli", "replay", "--no-progress", str(cfg)]


def _journal(path: Path) -> tuple[set, set]:
    """(teacher, context) of responses stored, and of requests in flight (intent, no result)."""
    intents, done = {}, set()
    for line in path.read_bytes().split(b"\n"):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec["kind"] == "intent":
            intents[rec["attempt"]] = (rec["teacher"], rec["context"])
        elif rec["message"] is not None:
            done.add(intents.pop(rec["attempt"]))
        else:
            intents.pop(rec["attempt"])
    return done, set(intents.values())


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_repeats_no_paid_request(tmp_path):
    traces = tmp_path / "traces.jsonl"
    _write_traces(traces, 60)  # 120 states x 3 teachers
    model_of = {"a": "ma", "b": "mb", "c": "mc"}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    responder = ConsensusResponder(noise=0.3)
    with TeacherServer(responder, faults=FaultPlan(latency_s=0.1), request_log=tmp_path / "log_a.jsonl") as server:
        _write_config(tmp_path / "a.toml", traces, tmp_path / "a", server.url)
        proc = subprocess.Popen(_replay_cmd(tmp_path / "a.toml"), cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cache = tmp_path / "a" / "cache.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if cache.exists() and cache.read_bytes().count(b'"kind":"result"') >= 90:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
        done, in_flight = _journal(cache)
        assert 90 <= len(done) < 360
        resumed = subprocess.run(_replay_cmd(tmp_path / "a.toml"), cwd=REPO, env=env, capture_output=True, text=True)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "log_a.jsonl").read_text().splitlines()]
    sent = Counter((r["model"], r["context"]) for r in log)
    assert all(sent[(model_of[t], ctx)] == 1 for t, ctx in done), "a response stored before the kill was bought twice"
    repeated = {k for k, n in sent.items() if n > 1}
    assert repeated <= {(model_of[t], ctx) for t, ctx in in_flight} and len(in_flight) <= 12
    assert len(sent) == 360  # every (teacher, state) asked, and answered exactly once more at most
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["client"]["cache_hits"] == len(done) and summary["inflight_at_previous_kill"] == len(in_flight)

    with TeacherServer(responder, faults=FaultPlan(latency_s=0.02)) as server_b:
        _write_config(tmp_path / "b.toml", traces, tmp_path / "b", server_b.url)
        straight = subprocess.run(_replay_cmd(tmp_path / "b.toml"), cwd=REPO, env=env, capture_output=True, text=True)
        assert straight.returncode == 0, straight.stderr[-3000:]
    for name in ("pairs_raw.jsonl", "dataset.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    assert len((tmp_path / "b" / "dataset.jsonl").read_text().splitlines()) > 50
    print(f"\nresume: {len(done)} responses stored before SIGKILL, {len(in_flight)} in flight, "
          f"{len(repeated)} requests repeated (all in flight), {len(log)} requests in all")


def test_serve_teachers_command_and_replay_errors(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_mesh.mesh.cli", "serve-teachers", "--port", "0", "--responder", "solver", "--noise", "0",
         "--models", "demo"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        url = line.split(" on ")[1].split()[0]
        assert httpx.get(f"{url}/models").json()["data"] == [{"id": "demo", "object": "model", "owned_by": "composer-mesh"}]
        r = httpx.post(f"{url}/chat/completions", json={"model": "demo", "messages": [{"role": "user", "content": "12 + 7"}]})
        body = r.json()
        assert body["choices"][0]["message"]["content"] == "ANSWER: 19" and body["usage"]["completion_tokens"] == 2
        assert httpx.get(f"{url}/usage").json()["billed"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert "served 1 requests" in proc.stdout.read()
    _write_config(tmp_path / "c.toml", tmp_path / "missing.jsonl", tmp_path / "c", "http://127.0.0.1:9/v1")
    bad = subprocess.run(_replay_cmd(tmp_path / "c.toml"), cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "no such file" in bad.stderr and not (tmp_path / "c" / "cache.jsonl").exists()
    typo = subprocess.run(_replay_cmd(tmp_path / "c.toml") + ["--replay.min_agre=3"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert typo.returncode == 2 and "min_agree" in typo.stderr


def test_teachers_that_say_why_they_cannot_answer_are_counted_not_failed(tmp_path):
    """A reply carrying OpenAI's `refusal` field is a reply (it votes, worded per model here, so no pair from it)
    and summary.json counts it by teacher and reason, apart from the failures."""
    reason = "no reference solution: the task has none"

    def responder(model, messages, params):
        if model == "m-none":
            return {"content": f"{model}: no reference solution for this task.", "refusal": reason}
        return _agreeing(model, messages, params)

    with TeacherServer(responder) as server:
        specs = (TeacherSpec(name="good1", model="g1"), TeacherSpec(name="good2", model="g2"),
                 TeacherSpec(name="none", model="m-none"))
        teachers = TeachersConfig(models=specs, base_url=server.url, max_retries=1, backoff_base_s=0.001, budget_usd=1.0)
        cfg = ReplayConfig(traces=(str(FIXTURES / "openai_traces.jsonl"),), output_dir=str(tmp_path), min_agree=2)
        summary = run_replay(cfg, teachers)
    assert summary["refusals_by_teacher"] == {"none": {reason: summary["states"]}} and summary["states"] > 0
    assert summary["failures"] == [] and summary["outcomes"].get("pair", 0) > 0
    assert json.loads((tmp_path / "summary.json").read_text())["refusals_by_teacher"] == summary["refusals_by_teacher"]
