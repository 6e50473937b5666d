"""Teacher client against the local server: cost, cache, faults, secrets, and the budget cap."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random

import pytest

from composer_mesh.configs.sections.teachers import TeachersConfig, TeacherSpec
from composer_mesh.replay.cache import ResponseCache
from composer_mesh.replay.server import ConsensusResponder, FaultPlan, TeacherServer
from composer_mesh.replay.teachers import TeacherClient

USER = [{"role": "user", "content": "what is 2 + 2"}]


def _cfg(url: str, *specs: TeacherSpec, **kw) -> TeachersConfig:
    kw.setdefault("backoff_base_s", 0.001)
    return TeachersConfig(models=specs, base_url=url, **kw)


def _run(coro):
    return asyncio.run(coro)


async def _complete(cfg, teacher, messages=USER, cache=None, **kw):
    client = TeacherClient(cfg, cache, **kw)
    try:
        return await client.complete(teacher, messages), client
    finally:
        await client.aclose()


def test_cost_from_usage_and_cache_survives_restart(tmp_path):
    spec = TeacherSpec(name="t", model="m", price_in_per_mtok=3.0, price_out_per_mtok=15.0, max_tokens=8)
    with TeacherServer(ConsensusResponder()) as server:
        cfg = _cfg(server.url, spec)
        reply, client = _run(_complete(cfg, "t", cache=ResponseCache(tmp_path / "c.jsonl")))
        usage = reply.usage
        assert reply.message["content"].startswith("answer ")
        assert reply.cost_usd == pytest.approx((usage["prompt_tokens"] * 3.0 + usage["completion_tokens"] * 15.0) / 1e6)
        assert client.budget.spent_usd == pytest.approx(reply.cost_usd)
        client.cache.close()
        # a new process's cache serves it: no request reaches the server
        again, client2 = _run(_complete(cfg, "t", cache=ResponseCache(tmp_path / "c.jsonl")))
        assert again.cached and again.message == reply.message and client2.stats.requests == 0
        assert client2.budget.spent_usd == pytest.approx(reply.cost_usd)  # prior spend carried over
        client2.cache.close()
        assert len(server.log) == 1
        # different params are a different key
        cfg2 = _cfg(server.url, TeacherSpec(name="t", model="m", max_tokens=9))
        third, _ = _run(_complete(cfg2, "t", cache=ResponseCache(tmp_path / "c.jsonl")))
        assert not third.cached and len(server.log) == 2


def test_per_teacher_concurrency_limit():
    active, peak = 0, 0
    import threading

    lock = threading.Lock()

    def slow(model, messages, params):
        nonlocal active, peak
        import time

        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.05)
        with lock:
            active -= 1
        return "ok"

    with TeacherServer(slow) as server:
        cfg = _cfg(server.url, TeacherSpec(name="t", model="m", max_concurrency=3))

        async def go():
            client = TeacherClient(cfg)
            await asyncio.gather(*(client.complete("t", [{"role": "user", "content": str(i)}]) for i in range(12)))
            await client.aclose()

        _run(go())
    assert peak == 3


@pytest.mark.parametrize("fault,kind", [
    ("rate_limit", "rate_limited"), ("server_error", "server_error"), ("malformed", "malformed"),
    ("disconnect", "disconnect"), ("timeout", "timeout"),
])
def test_each_fault_is_retried_then_recorded_as_failed(fault, kind):
    # read timeout far above normal latency (a loaded box must not turn a 429 into a timeout)
    plan = FaultPlan(**{f"p_{fault}": 1.0, "retry_after_s": 0.002, "timeout_delay_s": 2.5})
    with TeacherServer(ConsensusResponder(), model_faults={"bad": plan}) as server:
        cfg = _cfg(server.url, TeacherSpec(name="t", model="bad", max_tokens=4), max_retries=2, read_timeout_s=1.0)
        reply, client = _run(_complete(cfg, "t"))
    assert reply.message is None and reply.error.kind == kind and reply.attempts == 3
    assert [r["outcome"] for r in server.log] == [fault] * 3
    assert client.stats.failures == {kind: 1} and client.stats.retries == 2
    billed = sum(r["billed"] for r in server.log)
    assert billed == (3 if fault in ("malformed", "disconnect", "timeout") else 0)
    # outcomes the server may have billed are charged their worst case; 429/500 cost nothing
    worst = client.worst_case_nusd(cfg.models[0], {"messages": USER})
    assert client.budget.spent_nusd == (3 * worst if billed else 0)


@pytest.mark.parametrize("fault", ["rate_limit", "server_error", "malformed", "disconnect", "timeout"])
def test_a_fault_then_success_recovers(fault):
    with TeacherServer(ConsensusResponder(), faults=FaultPlan(retry_after_s=0.002, timeout_delay_s=2.5)) as server:
        server.inject("m", fault, "ok")
        cfg = _cfg(server.url, TeacherSpec(name="t", model="m"), read_timeout_s=1.0)
        reply, client = _run(_complete(cfg, "t"))
    assert reply.error is None and reply.attempts == 2
    assert [r["outcome"] for r in server.log] == [fault, "ok"]


def test_retry_after_is_honoured():
    delays = []

    async def sleep(s):
        delays.append(s)
        await asyncio.sleep(s)

    with TeacherServer(ConsensusResponder(), faults=FaultPlan(retry_after_s=0.3)) as server:
        server.inject("m", "rate_limit")
        cfg = _cfg(server.url, TeacherSpec(name="t", model="m"), backoff_base_s=0.0)
        reply, _ = _run(_complete(cfg, "t", sleep=sleep))
    assert reply.error is None and delays == [pytest.approx(0.3)]


def test_other_4xx_is_not_retried_and_is_structured():
    with TeacherServer(ConsensusResponder(), models=["m"]) as server:
        cfg = _cfg(server.url, TeacherSpec(name="t", model="nope"), max_retries=3)
        reply, client = _run(_complete(cfg, "t"))
    assert reply.error.kind == "client_error" and reply.error.status == 404 and reply.attempts == 1
    assert "not found" in reply.error.message and len(server.log) == 0


def test_unreachable_server_is_a_connection_failure():
    cfg = _cfg("http://127.0.0.1:9/v1", TeacherSpec(name="t", model="m"), max_retries=1, connect_timeout_s=0.5)
    reply, client = _run(_complete(cfg, "t"))
    assert reply.error.kind == "connection" and reply.attempts == 2 and client.budget.spent_nusd == 0


def test_api_key_from_env_is_sent_and_never_leaks(tmp_path, monkeypatch, capsys):
    secret = "sk-test-" + hashlib.sha256(b"k").hexdigest()[:24]
    monkeypatch.setenv("TEACHER_KEY", secret)
    monkeypatch.setenv("WRONG_KEY", secret[::-1])
    with TeacherServer(ConsensusResponder(), api_key=secret) as server:
        good = _cfg(server.url, TeacherSpec(name="t", model="m"), api_key_env="TEACHER_KEY")
        reply, client = _run(_complete(good, "t", cache=ResponseCache(tmp_path / "c.jsonl")))
        assert reply.error is None
        bad = _cfg(server.url, TeacherSpec(name="t", model="m", api_key_env="WRONG_KEY"))
        refused, client2 = _run(_complete(bad, "t", cache=ResponseCache(tmp_path / "c2.jsonl")))
    assert refused.error.kind == "client_error" and refused.error.status == 401
    assert "Incorrect API key provided: ***" in refused.error.message  # the server echoed it; we redacted
    seen = repr(client) + repr(client2) + repr(reply) + repr(refused) + capsys.readouterr().out
    seen += (tmp_path / "c.jsonl").read_text() + (tmp_path / "c2.jsonl").read_text()
    assert secret not in seen and secret[::-1] not in seen
    with pytest.raises(ValueError, match="MISSING_KEY is not set"):
        TeacherClient(_cfg("http://x/v1", TeacherSpec(name="t", model="m", api_key_env="MISSING_KEY")))


def test_budget_refuses_before_sending():
    spec = TeacherSpec(name="t", model="m", price_in_per_mtok=1000.0, price_out_per_mtok=1000.0, max_tokens=100)
    with TeacherServer(ConsensusResponder()) as server:
        cfg = _cfg(server.url, spec, budget_usd=0.05)  # worst case ≈ $0.1 + prompt
        reply, client = _run(_complete(cfg, "t"))
    assert reply.error.kind == "budget" and reply.attempts == 0 and server.log == []


class RandomLength:
    """Completions of 0..2·max_tokens words, fixed per (model, context): exercises truncation."""

    def __call__(self, model, messages, params):
        h = int(hashlib.sha256((model + json.dumps(messages)).encode()).hexdigest()[:8], 16)
        return " ".join(["w"] * (h % (2 * params["max_tokens"] + 1)))


def test_budget_cap_holds_in_1000_randomized_trials():
    """Random prices, latencies, faults, concurrency and caps: the server's billed cost
    never exceeds the cap, and a run refused for budget stops within one worst case of it."""
    trials = 1000
    with TeacherServer(RandomLength(), faults=FaultPlan(timeout_delay_s=0.08)) as server:

        async def trial(i: int) -> dict:
            rng = random.Random(i)
            specs = []
            for j in range(rng.randint(1, 3)):
                model = f"t{i}-{j}"
                p = [rng.random() * 0.08 for _ in range(5)] if rng.random() < 0.6 else [0.0] * 5
                server.model_faults[model] = FaultPlan(
                    latency_s=rng.random() * 0.004, latency_jitter_s=0.002, p_rate_limit=p[0], retry_after_s=0.001,
                    p_server_error=p[1], p_malformed=p[2], p_disconnect=p[3], p_timeout=p[4] / 4, timeout_delay_s=0.08,
                )
                specs.append(TeacherSpec(
                    name=f"n{j}", model=model, max_tokens=rng.randint(1, 48), max_concurrency=rng.randint(1, 8),
                    price_in_per_mtok=rng.choice([0.0, 0.1, 1.0, 3.0, 15.0, 75.0]) * rng.random(),
                    price_out_per_mtok=rng.choice([0.5, 4.0, 15.0, 75.0]) * rng.random(),
                ))
            n = rng.randint(2, 8)
            jobs = [(rng.choice(specs).name, [{"role": "user", "content": f"trial {i} q {k} " + "x " * rng.randint(0, 30)}])
                    for k in range(n)]
            cfg = TeachersConfig(models=tuple(specs), base_url=server.url, budget_usd=0.0, max_retries=rng.randint(0, 2),
                                 backoff_base_s=0.001, read_timeout_s=0.04)
            probe = TeacherClient(cfg)
            worst = [probe.worst_case_nusd(probe.teachers[t], {"messages": m}) for t, m in jobs]
            cap = sum(worst) * rng.choice([0.05, 0.3, 0.6, 1.0, 2.0]) / 1e9
            client = TeacherClient(dataclasses.replace(cfg, budget_usd=cap), seed=i)
            replies = await asyncio.gather(*(client.complete(t, m) for t, m in jobs))
            await client.aclose()
            return {"specs": specs, "cap": cap, "client": client, "replies": replies, "worst": worst, "jobs": jobs}

        async def all_trials():
            out = []
            for start in range(0, trials, 25):  # 25 trials at a time in one event loop
                out += await asyncio.gather(*(trial(i) for i in range(start, start + 25)))
            return out

        results = asyncio.run(all_trials())
        log = list(server.log)
    by_model: dict[str, list[dict]] = {}
    for rec in log:
        by_model.setdefault(rec["model"], []).append(rec)
    refused_runs = 0
    for res in results:
        billed = 0.0
        for s in res["specs"]:
            for rec in by_model.get(s.model, []):
                if rec["billed"]:
                    billed += (rec["prompt_tokens"] * s.price_in_per_mtok + rec["completion_tokens"] * s.price_out_per_mtok) / 1e6
                    assert rec["completion_tokens"] <= s.max_tokens
        budget = res["client"].budget
        assert billed <= res["cap"] + 1e-12, "the server billed more than the cap"
        assert billed <= budget.spent_usd + 1e-12, "the client under-counted its spend"
        assert budget.spent_usd <= res["cap"] + 1e-12 and budget.reserved_nusd == 0 and budget.overruns == 0
        refused = [w for w, r in zip(res["worst"], res["replies"]) if r.error is not None and r.error.kind == "budget"]
        if refused:  # work remained: the stop came within one worst-case call of the cap
            refused_runs += 1
            assert res["cap"] - budget.spent_usd < max(res["worst"]) / 1e9
            assert all(res["cap"] - budget.spent_usd < w / 1e9 for w in refused)
    print(f"\nbudget trials: {trials} trials, {len(log)} requests, {sum(r['billed'] for r in log)} billed, "
          f"{refused_runs} runs stopped by the cap, max spend/cap "
          f"{max(r['client'].budget.spent_usd / r['cap'] for r in results if r['cap'] > 0):.4f}")
    assert refused_runs > 200  # the caps bound often enough to test the second claim
    assert sum(r["billed"] for r in log) > 3000 and len({r["outcome"] for r in log}) == 6


def test_hf_responder_serves_a_local_model_with_exact_usage(tiny_assets):
    from composer_mesh.replay.server import HFResponder

    responder = HFResponder(tiny_assets.dense_dir)
    with TeacherServer(responder) as server:
        cfg = _cfg(server.url, TeacherSpec(name="t", model="tiny", max_tokens=6))
        first, _ = _run(_complete(cfg, "t"))
        second, _ = _run(_complete(cfg, "t"))
    prompt = responder.tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert first.usage["prompt_tokens"] == len(prompt["input_ids"])
    assert 0 < first.usage["completion_tokens"] <= 6
    assert first.message == second.message  # greedy
    assert [r["completion_tokens"] for r in server.log] == [first.usage["completion_tokens"]] * 2


def test_cache_survives_torn_lines_and_refuses_a_second_live_run(tmp_path):
    path = tmp_path / "c.jsonl"
    cache = ResponseCache(path)
    attempt = cache.intent("k1", "t", 500, "ctx")
    cache.result(attempt, "k1", "t", "m", 120, {"role": "assistant", "content": "hi"}, {"prompt_tokens": 1})
    cache.intent("k2", "t", 700, "ctx2")  # in flight when the run "dies"
    with pytest.raises(RuntimeError, match="in use by another run"):
        ResponseCache(path)
    cache.close()
    with open(path, "ab") as f:
        f.write(b'{"kind":"result","attempt":"x-9","key":"k3"')  # torn by a kill mid-write
    again = ResponseCache(path)
    assert again.get("k1").message == {"role": "assistant", "content": "hi"} and again.get("k2") is None
    assert again.corrupt_lines == 1 and again.unresolved_at_load == 1
    assert again.prior_spend_nusd == 120 + 700  # settled cost + worst case of the unresolved intent
    attempt = again.intent("k4", "t", 1, "ctx4")
    again.result(attempt, "k4", "t", "m", 1, {"role": "assistant", "content": "x"}, {})
    again.close()
    lines = path.read_bytes().split(b"\n")
    assert json.loads(lines[-2])["key"] == "k4"  # appended on a fresh line, not glued to the torn one


def test_solver_teachers_slip_apart_and_the_vote_decides():
    """`SolverResponder(noise)` over HTTP: each model is exact except on a hashed `noise` share of contexts,
    where it answers a near miss; slipping models mostly miss differently, so three teachers sometimes
    have no majority; the same request gets the same answer; noise 0 is the exact solver."""
    from composer_mesh.envs.demo import DemoEnv, solve
    from composer_mesh.replay.pairs import Vote, decide
    from composer_mesh.replay.server import SolverResponder
    from composer_mesh.replay.traces import TraceState

    specs = [TeacherSpec(name=n, model=f"local-{n}", max_tokens=16) for n in "abc"]
    contexts = []
    for seed in range(80):
        env = DemoEnv()
        env.reset(seed=seed)
        contexts.append(list(env.state.messages))

    async def ask(cfg):
        client = TeacherClient(cfg, None)
        try:
            rows = [asyncio.gather(*(client.complete(s.name, ctx) for s in specs)) for ctx in contexts]
            return [[r.message for r in row] for row in await asyncio.gather(*rows)]
        finally:
            await client.aclose()

    with TeacherServer(SolverResponder(solve, noise=0.3)) as server:
        answers = _run(ask(_cfg(server.url, *specs)))
        assert _run(ask(_cfg(server.url, *specs))) == answers
    slips = [[m["content"] != solve(ctx) for m in row] for row, ctx in zip(answers, contexts)]
    rate = sum(map(sum, slips)) / (3 * len(contexts))
    assert 0.2 < rate < 0.4
    for row, ctx in zip(answers, contexts):
        for m in row:
            assert abs(int(m["content"].removeprefix("ANSWER: ")) - int(solve(ctx).removeprefix("ANSWER: "))) <= 2
    outcomes = []
    for row, ctx in zip(answers, contexts):
        state = TraceState(trace_id="t", step=0, context=tuple(ctx),
                           action={"role": "assistant", "content": "ANSWER: 99"})
        votes = [Vote(s.name, m) for s, m in zip(specs, row)]
        d = decide(state, votes, min_agree=2, equivalence="text")
        outcomes.append(d.outcome)
        if d.outcome == "pair":
            assert d.pair.chosen["content"] in {m["content"] for m in row}
    assert outcomes.count("pair") > len(contexts) / 2
    assert outcomes.count("no_consensus") + outcomes.count("too_few_votes") > 0
    assert sum(not all(s) and any(s) for s in slips) > 0  # some states split the teachers

    with TeacherServer(SolverResponder(solve, noise=0.0)) as server:
        exact = _run(ask(_cfg(server.url, *specs)))
    assert all(m["content"] == solve(ctx) for row, ctx in zip(exact, contexts) for m in row)
