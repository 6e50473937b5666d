"""`composer-mesh replay` against two real vLLM OpenAI servers (the tiny model, hermes tool parsing).

Two `python -m vllm.entrypoints.openai.api_server` processes (seeds 1 and 2,
`--enable-auto-tool-choice --tool-call-parser hermes`, a 2048-token context)
serve the built tiny model as two teachers. The Claude Code and OpenAI fixture
traces (tool calls and tool results in the contexts, tools declared) are
replayed: pairs come out, the spend equals the servers' own token counters
(Prometheus `/metrics`) times the prices, the context length is learnt from
`/v1/models` and long states are trimmed to fit, a rerun buys nothing, and a
small budget is never exceeded.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from composer_mesh.mesh.cli import main

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"
TRACES = [FIXTURES / "claude_session.jsonl", FIXTURES / "openai_traces.jsonl"]
CONTEXT = 2048
PRICE_IN, PRICE_OUT = 100.0, 400.0  # USD per million tokens: large, so a small cap binds
VLLM_ARGS = ("--served-model-name", "tiny", "--max-model-len", str(CONTEXT),
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def servers(tiny_assets, tmp_path_factory, vllm_openai_server):
    """Two vLLM servers on the tiny model (seeds 1, 2), started together, shared by the module."""
    logs = tmp_path_factory.mktemp("vllm")
    started = []
    try:
        for seed in (1, 2):  # both load at once
            started.append(vllm_openai_server(tiny_assets.dense_dir, logs / f"seed{seed}.log", *VLLM_ARGS,
                                              "--seed", str(seed)))
        up = [server.wait() for server in started]
        yield [url for url, _ in up], [models for _, models in up]
    finally:
        for server in started:
            server.stop()


def _tokens(url: str) -> tuple[float, float]:
    """(prompt, generation) tokens the server has processed, from its Prometheus counters."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("prompt_tokens"), total("generation_tokens")


def _spend(urls: list[str], before: list[tuple[float, float]]) -> float:
    after = [_tokens(u) for u in urls]
    return sum((p1 - p0) * PRICE_IN + (g1 - g0) * PRICE_OUT for (p0, g0), (p1, g1) in zip(before, after)) / 1e6


def _config(path: Path, urls: list[str], out: Path, budget: float) -> Path:
    teachers = "".join(f"""
[[teachers.models]]
name = "vllm-{i}"
model = "tiny"
base_url = "{url}/v1"
price_in_per_mtok = {PRICE_IN}
price_out_per_mtok = {PRICE_OUT}
max_tokens = 16
max_concurrency = 2
""" for i, url in enumerate(urls))
    path.write_text(f"""
[replay]
traces = {json.dumps([str(t) for t in TRACES])}
output_dir = "{out}"
min_agree = 2
concurrency = 2
[teachers]
budget_usd = {budget}
read_timeout_s = 120.0
{teachers}""")
    return path


def _replay(cfg: Path, capsys) -> tuple[int, dict, dict]:
    rc = main(["replay", "--no-progress", str(cfg)])
    out = capsys.readouterr().out
    summary = json.loads((Path(json.loads(cfg.read_text().split("output_dir = ")[1].split("\n")[0])) / "summary.json").read_text())
    return rc, json.loads(out.splitlines()[-1]), summary


def test_replay_against_two_vllm_teachers(servers, tmp_path, capsys):
    urls, models = servers
    assert [m["data"][0]["max_model_len"] for m in models] == [CONTEXT, CONTEXT]
    cfg = _config(tmp_path / "r.toml", urls, tmp_path / "out", budget=50.0)
    before = [_tokens(u) for u in urls]
    rc, brief, summary = _replay(cfg, capsys)
    assert rc == 0 and brief["failures"] == 0, summary["failures_by_teacher"]
    # temperature 0, the same weights: the two teachers agree, and differ from the recorded actions
    assert brief["pairs_raw"] > 0  # (the default recipe filters the tiny model's gibberish out of the dataset)
    assert summary["client"]["context_limits"] == {"vllm-0": CONTEXT, "vllm-1": CONTEXT}
    assert summary["client"]["trimmed"] > 0  # the long states went out trimmed, not refused
    # billed from the server's usage: the client's spend is the servers' token counters times the prices
    assert summary["spend_usd"] == pytest.approx(_spend(urls, before), rel=1e-6)
    assert 0 < summary["spend_usd"] <= 50.0
    pairs = [json.loads(ln) for ln in (tmp_path / "out" / "pairs_raw.jsonl").read_text().splitlines()]
    assert any("tool_calls" in json.dumps(p) for p in pairs)  # contexts with tool calls went through
    # a rerun resumes from the cache: no token bought again, the same pairs
    again = [_tokens(u) for u in urls]
    rc2, brief2, summary2 = _replay(cfg, capsys)
    assert rc2 == 0 and [_tokens(u) for u in urls] == again
    assert brief2["pairs_raw"] == brief["pairs_raw"] and summary2["client"]["cache_hits"] == summary["client"]["successes"]


def test_budget_is_honoured_against_vllm(servers, tmp_path, capsys):
    urls, _ = servers
    cap = 0.3  # a few worst cases (~0.06-0.3 USD each at these prices)
    cfg = _config(tmp_path / "r.toml", urls, tmp_path / "out", budget=cap)
    before = [_tokens(u) for u in urls]
    rc, brief, summary = _replay(cfg, capsys)
    spent = _spend(urls, before)
    assert brief["budget_refusals"] > 0 and brief["failures"] == 0
    assert summary["spend_usd"] == pytest.approx(spent, rel=1e-6) and spent <= cap
