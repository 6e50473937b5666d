"""Teacher-client throughput against the local server, and what VOI gating saves.

1. Throughput. `composer-mesh serve-teachers` runs in its own process with
   injected latency L; one `TeacherClient` (durable cache on, as in a real run)
   sends N distinct requests to one teacher with max_concurrency C. With no
   overhead it would finish C/L requests per second; efficiency = achieved
   requests/s ÷ (C/L). C = 1 is measured too, so speedup = rps(C) / rps(1).
2. Gating. States of the CPU demo task (`envs.demo` problems) with a simulated,
   calibrated student: per state it has logits over 7 candidate answers (the
   correct one boosted by a random amount) and its recorded answer is sampled
   from them, so the less certain it is the more often it is wrong. Three
   teachers on the local server answer with the demo solver. The same states are
   replayed ungated and gated (entropy / top-2 margin of the student's logits):
   call reduction = 1 − calls(gated)/calls(ungated), pair retention =
   pairs(gated)/pairs(ungated), calls counted by the server. Tiered escalation
   (one cheap teacher first) is shown for scale.

    python benchmarks/replay_throughput.py --quick

Prints a table, then one JSON line
{"efficiency": ..., "gating_call_reduction": ..., "gating_pair_retention": ...}
(efficiency at the headline C and L).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from composer_mesh.configs.sections.env import DemoTaskConfig  # noqa: E402
from composer_mesh.configs.sections.replay import GatingConfig, ReplayConfig  # noqa: E402
from composer_mesh.configs.sections.teachers import TeachersConfig, TeacherSpec  # noqa: E402
from composer_mesh.envs.demo import make_problem, prompt_messages, solve  # noqa: E402
from composer_mesh.replay.cache import ResponseCache  # noqa: E402
from composer_mesh.replay.gating import Uncertainty, VOIGate, uncertainty_from_logits  # noqa: E402
from composer_mesh.replay.pipeline import replay_states  # noqa: E402
from composer_mesh.replay.server import TeacherServer  # noqa: E402
from composer_mesh.replay.teachers import TeacherClient  # noqa: E402
from composer_mesh.replay.traces import TraceState  # noqa: E402


def start_server(latency: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "composer_mesh.mesh.cli", "serve-teachers", "--port", "0", "--responder", "echo", "--latency", str(latency)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    return proc, line.split(" on ")[1].split()[0]


async def throughput(url: str, concurrency: int, latency: float, n: int, cache_dir: Path) -> float:
    """Requests per second for n distinct requests at the given concurrency."""
    spec = TeacherSpec(name="t", model="m", max_concurrency=concurrency, max_tokens=16)
    cfg = TeachersConfig(models=(spec,), base_url=url, budget_usd=100.0)
    client = TeacherClient(cfg, ResponseCache(cache_dir / f"c{concurrency}-{latency}.jsonl"))
    tag = f"{concurrency}-{latency}-{time.time()}"
    await client.complete("t", [{"role": "user", "content": f"warm {tag}"}])  # connect once
    start = time.perf_counter()
    replies = await asyncio.gather(*(client.complete("t", [{"role": "user", "content": f"{tag} {i}"}]) for i in range(n)))
    elapsed = time.perf_counter() - start
    await client.aclose()
    client.cache.close()
    assert all(r.error is None for r in replies), [r.error for r in replies if r.error][:3]
    return n / elapsed


def demo_states(n: int, seed: int) -> tuple[list[TraceState], dict[int, Uncertainty]]:
    """Demo problems with a calibrated simulated student; returns states and their uncertainty."""
    import torch

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cfg = DemoTaskConfig(ops=("add", "sub", "mul"), max_operand=99)
    states, unc = [], {}
    for i in range(n):
        problem = make_problem(seed * 100_003 + i, cfg)
        answer = int(solve(prompt_messages(problem)).split()[-1])
        candidates = [answer + d for d in (-3, -2, -1, 0, 1, 2, 3)]
        logits = torch.randn(7, generator=g)
        logits[3] += rng.uniform(0.0, 7.0)  # how sure the student is of the right answer
        pick = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        action = {"role": "assistant", "content": f"ANSWER: {candidates[pick]}"}
        states.append(TraceState(f"demo-{i}", 0, tuple(prompt_messages(problem)), action))
        unc[i] = uncertainty_from_logits(logits[None])
    return states, unc


async def replay_counting(states, server, gate, tiered: bool) -> tuple[int, int]:
    """(teacher calls the server saw, pairs) for one replay of the states."""
    specs = (TeacherSpec(name="cheap", model="cheap", tier=0), TeacherSpec(name="mid", model="mid", tier=1),
             TeacherSpec(name="big", model="big", tier=1))
    client = TeacherClient(TeachersConfig(models=specs, base_url=server.url, budget_usd=100.0))
    before = len(server.log)
    cfg = ReplayConfig(min_agree=2, concurrency=16, gating=GatingConfig(enabled=gate is not None, tiered=tiered))
    results = await replay_states(states, client, cfg, gate=gate)
    await client.aclose()
    return len(server.log) - before, sum(r.pair is not None for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests and states (1–2 minutes on 2 cores)")
    args = ap.parse_args()
    waves = 5 if args.quick else 15
    # (C, L): the headline first (latencies of real APIs are seconds), C = 1 at the same L, then others
    settings = [(16, 1.0), (1, 1.0), (4, 0.25), (32, 2.0)] + ([] if args.quick else [(64, 2.0), (16, 0.25)])
    headline = settings[0]
    rows, rps = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for c, lat in settings:
            proc, url = start_server(lat)
            try:
                n = c * waves if c > 1 else 4
                rps[(c, lat)] = asyncio.run(throughput(url, c, lat, n, Path(tmp)))
            finally:
                proc.terminate()
                proc.wait()
            rows.append((c, lat, n, rps[(c, lat)], rps[(c, lat)] / (c / lat)))
    print("throughput (server in its own process, echo responder, durable cache on)")
    print(f"{'C':>4} {'L (s)':>6} {'requests':>9} {'req/s':>8} {'ideal C/L':>10} {'efficiency':>11}")
    for c, lat, n, r, eff in rows:
        print(f"{c:>4} {lat:>6.2f} {n:>9} {r:>8.1f} {c / lat:>10.1f} {eff:>11.3f}")
    speedup = rps[headline] / rps[(1, headline[1])]
    print(f"speedup C={headline[0]} vs C=1 at L={headline[1]}: {speedup:.1f}x")

    n_states = 300 if args.quick else 1500
    states, unc = demo_states(n_states, seed=0)
    gate = VOIGate(GatingConfig(enabled=True, min_entropy=0.6, max_margin=0.3), lambda s: unc[int(s.trace_id.split("-")[1])])
    responder = lambda model, messages, params: solve(messages)  # noqa: E731
    with TeacherServer(responder) as server:
        table = {}
        for name, g, tiered in (("ungated", None, False), ("gated", gate, False),
                                ("ungated+tiered", None, True), ("gated+tiered", gate, True)):
            table[name] = asyncio.run(replay_counting(states, server, g, tiered))
    wrong = sum(1 for s in states if s.action["content"] != solve(list(s.context)))
    print(f"\ngating ({n_states} demo states, student wrong on {wrong}; 3 solver teachers, min_agree 2)")
    print(f"{'run':<16} {'teacher calls':>14} {'pairs':>6} {'call reduction':>15} {'pair retention':>15}")
    base_calls, base_pairs = table["ungated"]
    for name, (calls, pairs) in table.items():
        print(f"{name:<16} {calls:>14} {pairs:>6} {1 - calls / base_calls:>15.3f} {pairs / base_pairs:>15.3f}")
    gated_calls, gated_pairs = table["gated"]
    print(json.dumps({
        "efficiency": round(rows[0][4], 4),
        "gating_call_reduction": round(1 - gated_calls / base_calls, 4),
        "gating_pair_retention": round(gated_pairs / base_pairs, 4),
    }))


if __name__ == "__main__":
    main()
