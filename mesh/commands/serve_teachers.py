"""`composer-mesh serve-teachers`: a local OpenAI-compatible teacher server on loopback."""

from __future__ import annotations

import argparse
import signal
import threading

from composer_mesh.configs.sections.replay import RESPONDERS

NAME = "serve-teachers"
HELP = "Serve /v1/chat/completions locally (consensus, echo, demo-task solver or local HF model), with fault injection."

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (keep it loopback)")
    parser.add_argument("--port", type=int, default=8765, help="port (0 = any free port)")
    parser.add_argument("--responder", choices=RESPONDERS, default="consensus", help="who answers")
    parser.add_argument("--model-dir", default="", help="local HF model directory (responder hf)")
    parser.add_argument("--noise", type=float, default=0.2,
                        help="consensus / solver responders: chance a model departs from the shared (solver: exact) answer")
    parser.add_argument("--models", default="", help="comma-separated model names served (default: any)")
    parser.add_argument("--request-log", default="", help="JSONL file logging every request answered")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault draws")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="refuse prompts + max_tokens over this many tokens (400) and report it in /v1/models (0 = none)")
    faults = parser.add_argument_group("fault injection")
    faults.add_argument("--latency", type=float, default=0.0, help="seconds added to every request")
    faults.add_argument("--latency-jitter", type=float, default=0.0, help="extra uniform random latency (s)")
    faults.add_argument("--p-429", type=float, default=0.0, help="chance of 429 with Retry-After")
    faults.add_argument("--retry-after", type=float, default=1.0, help="Retry-After sent with 429s (s)")
    faults.add_argument("--p-500", type=float, default=0.0, help="chance of HTTP 500")
    faults.add_argument("--p-malformed", type=float, default=0.0, help="chance of a malformed 200 body")
    faults.add_argument("--p-disconnect", type=float, default=0.0, help="chance of dropping the connection")
    faults.add_argument("--p-timeout", type=float, default=0.0, help="chance of answering after --timeout-delay")
    faults.add_argument("--timeout-delay", type=float, default=30.0, help="delay of slow answers (s)")


def run(args: argparse.Namespace) -> int:
    # lazy: start-up time: the server stack (uvicorn, transformers) loads only when this command runs
    from composer_mesh.mesh.responders import build_responder
    from composer_mesh.replay.server import FaultPlan, TeacherServer

    plan = FaultPlan(
        latency_s=args.latency, latency_jitter_s=args.latency_jitter, p_rate_limit=args.p_429,
        retry_after_s=args.retry_after, p_server_error=args.p_500, p_malformed=args.p_malformed,
        p_disconnect=args.p_disconnect, p_timeout=args.p_timeout, timeout_delay_s=args.timeout_delay,
    )
    models = [m for m in args.models.split(",") if m] or None
    server = TeacherServer(
        build_responder(args.responder, args.model_dir, args.noise), models=models, host=args.host,
        port=args.port, faults=plan, request_log=args.request_log or None, seed=args.seed,
        max_model_len=args.max_model_len or None,
    ).start()
    print(f"serving teachers on {server.url} (responder {args.responder}); Ctrl-C to stop", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    print(f"served {len(server.log)} requests", flush=True)
    return 0
