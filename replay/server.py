"""A local OpenAI-compatible teacher server (`composer-mesh serve-teachers`).

`POST /v1/chat/completions`, `GET /v1/models` and `GET /v1/usage` on loopback:
a Starlette app served by uvicorn on its own thread (HTTP/1.1 keep-alive,
responders run in a worker thread each, so concurrent clients are served
concurrently). Answers come from a pluggable `Responder`
`(model, messages, params) -> str | dict` (a dict is an assistant message with
`content` and/or `tool_calls`, and may carry the responder's own `usage`). Usage is counted per request (prompt and
completion tokens; completions are cut at `max_tokens`) and every answered
request is logged (in memory and optionally to a JSONL file) *before* its
response is written, with whether it was billed: the log is the ground truth the
budget and resume tests check the client against.

Fault injection (per server or per model, random with a seed, or scripted):
latency, 429 with Retry-After / retry-after-ms, 500, a malformed 200 body, a
dropped connection, and a response slower than the client's timeout.
Billing model: 429 / 500 / 4xx are free; any request that produced a completion
(ok, malformed, dropped, slow) is billed. `max_model_len` makes the server
refuse prompts longer than that (HTTP 400, vLLM's message) and report it in
`/v1/models`, as vLLM does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import random
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from composer_mesh.replay.cache import context_hash

Responder = Callable[[str, list[dict], dict], "str | dict"]

FAULTS = ("rate_limit", "server_error", "malformed", "disconnect", "timeout")


@dataclass(frozen=True)
class FaultPlan:
    """Injected behaviour: latency for every request, then at most one fault drawn in FAULTS order."""

    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    p_rate_limit: float = 0.0
    retry_after_s: float = 1.0
    p_server_error: float = 0.0
    p_malformed: float = 0.0
    p_disconnect: float = 0.0
    p_timeout: float = 0.0
    timeout_delay_s: float = 30.0


def word_count(text: str) -> int:
    """Token count of the built-in responders: whitespace-separated words."""
    return len(text.split())


def echo_responder(model: str, messages: list[dict], params: dict) -> str:
    """The last user message, back."""
    return next((str(m.get("content", "")) for m in reversed(messages) if m.get("role") == "user"), "")


def _hash(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("\x00".join(parts).encode()).digest()[:8], "big")


def departs(model: str, ctx: str, noise: float) -> bool:
    """Whether `model` departs from the shared answer on `ctx` (chance `noise`, fixed per pair)."""
    return (_hash(model, ctx, "noise") % 10_000) / 10_000 < noise


class ConsensusResponder:
    """Deterministic teachers that mostly agree: every model gives the context's shared
    answer, except that each model departs from it with probability `noise`
    (decided by a hash of model and context, so repeated requests repeat)."""

    def __init__(self, choices: int = 4, noise: float = 0.2) -> None:
        if choices < 2:
            raise ValueError("choices must be at least 2")
        self.choices = choices
        self.noise = noise

    def __call__(self, model: str, messages: list[dict], params: dict) -> str:
        ctx = json.dumps(messages, sort_keys=True)
        base = _hash(ctx) % self.choices
        if departs(model, ctx, self.noise):
            base = (base + 1 + _hash(model, ctx) % (self.choices - 1)) % self.choices
        return f"answer {base}"


# A task's solver: (messages, slip) -> the answer, off by `slip` when slip != 0.
Solver = Callable[[list[dict], int], str]


class SolverResponder:
    """A task's solver as teachers that sometimes slip: each model answers exactly, except that
    with probability `noise` (a hash of model and context, so repeated requests repeat) it gives
    a near miss, the result off by ±1 or ±2. Two slipping teachers mostly miss differently, so
    the teachers disagree and the vote decides. The demo task's is `envs.demo.solve`
    (`mesh.responders` joins the two: replay does not import envs)."""

    def __init__(self, solve: Solver, noise: float = 0.0) -> None:
        self.solve = solve
        self.noise = noise

    def __call__(self, model: str, messages: list[dict], params: dict) -> str:
        ctx = json.dumps(messages, sort_keys=True)
        slip = (1, -1, 2, -2)[_hash(model, ctx) % 4] if departs(model, ctx, self.noise) else 0
        return self.solve(messages, slip)


class HFResponder:
    """A local Hugging Face causal LM directory answering greedily (one request at a time)."""

    def __init__(self, model_dir: str | Path) -> None:
        # lazy: start-up time: transformers and torch load only when an HF responder is asked for
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        self._lock = threading.Lock()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _prompt_ids(self, messages: list[dict]) -> dict:
        return self.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m.get("content") or ""} for m in messages],
            add_generation_prompt=True, return_tensors="pt", return_dict=True,
        )

    def prompt_tokens(self, messages: list[dict], params: dict) -> int:
        """Prompt length as the model sees it (the chat template applied)."""
        return self._prompt_ids(messages)["input_ids"].shape[1]

    def __call__(self, model: str, messages: list[dict], params: dict) -> dict:
        # lazy: start-up time: torch loads only when an HF responder is asked for
        import torch

        ids = self._prompt_ids(messages)
        with self._lock, torch.no_grad():
            out = self.model.generate(
                **ids, max_new_tokens=int(params.get("max_tokens") or 64), do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
            )
        prompt_len = ids["input_ids"].shape[1]
        new_ids = out[0, prompt_len:]
        usage = {"prompt_tokens": prompt_len, "completion_tokens": len(new_ids)}
        return {"content": self.tokenizer.decode(new_ids, skip_special_tokens=True), "usage": usage}


class TeacherServer:
    """The server; `with TeacherServer(responder) as server: server.url` → `http://127.0.0.1:PORT/v1`.

    models: names served (None = any model name is accepted); model_faults:
    per-model FaultPlans overriding `faults`; request_log: JSONL path;
    api_key: when set, requests must carry `Authorization: Bearer <api_key>`;
    max_model_len: when set, prompts longer than this are refused (400) and
    `/v1/models` reports it.
    """

    def __init__(
        self,
        responder: Responder,
        *,
        models: Iterable[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultPlan = FaultPlan(),
        model_faults: dict[str, FaultPlan] | None = None,
        request_log: str | Path | None = None,
        seed: int = 0,
        api_key: str | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.responder = responder
        self.api_key = api_key
        self.models = tuple(models) if models is not None else None
        self.faults = faults
        self.model_faults = dict(model_faults or {})
        self.max_model_len = max_model_len
        self.count_tokens: Callable[[str], int] = getattr(responder, "count_tokens", word_count)
        self.log: list[dict] = []
        self._log_path = Path(request_log) if request_log else None
        self._log_file = None
        self._scripted: dict[str, deque] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        # bound here so that `url` is known (port 0 = any free port) before the server starts
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._socket.listen(256)
        config = uvicorn.Config(
            self.app(), log_level="critical", access_log=False, lifespan="off", timeout_keep_alive=60,
            server_header=False, date_header=False,
            # stop() does not wait out an injected slow answer
            timeout_graceful_shutdown=1,
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> "TeacherServer":
        if self._log_path is not None:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self._log_path, "a", encoding="utf-8")
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._uvicorn.serve(sockets=[self._socket])), name="teacher-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self._socket.close()
        if self._log_file is not None:
            self._log_file.close()

    def __enter__(self) -> "TeacherServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def inject(self, model: str, *faults: str) -> None:
        """Apply these faults (names from FAULTS, or "ok") to the model's next requests, in order."""
        for f in faults:
            if f not in FAULTS and f != "ok":
                raise ValueError(f"unknown fault {f!r}; choose from {FAULTS + ('ok',)}")
        with self._lock:
            self._scripted.setdefault(model, deque()).extend(faults)

    def usage(self) -> dict[str, Any]:
        """Totals over the log: requests, billed requests and tokens per model."""
        with self._lock:
            out: dict[str, Any] = {"requests": len(self.log), "billed": 0, "models": {}}
            for rec in self.log:
                m = out["models"].setdefault(rec["model"], {"requests": 0, "billed": 0, "prompt_tokens": 0, "completion_tokens": 0})
                m["requests"] += 1
                if rec["billed"]:
                    out["billed"] += 1
                    m["billed"] += 1
                    m["prompt_tokens"] += rec["prompt_tokens"]
                    m["completion_tokens"] += rec["completion_tokens"]
            return out

    def app(self) -> Starlette:
        """The ASGI app (routes; anything else is a 404 in the OpenAI error format)."""
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/usage", self._usage, methods=["GET"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
            ],
            exception_handlers={404: _not_found, 405: _not_found},
        )

    # -- routes

    async def _models(self, request: Request) -> Response:
        extra = {"max_model_len": self.max_model_len} if self.max_model_len else {}
        data = [{"id": m, "object": "model", "owned_by": "composer-mesh", **extra} for m in self.models or ()]
        return JSONResponse({"object": "list", "data": data})

    async def _usage(self, request: Request) -> Response:
        return JSONResponse(self.usage())

    async def _chat(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            model, messages = str(body["model"]), body["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise TypeError("messages must be a list of objects")
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"bad request: {exc}", "invalid_request_error")
        if self.api_key is not None:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ")
            # echoes the key it got, as public APIs do: clients must redact
            if given != self.api_key:
                return _error(401, f"Incorrect API key provided: {given}", "invalid_request_error")
        if self.models is not None and model not in self.models:
            return _error(404, f"model {model!r} not found", "not_found")
        params = {k: v for k, v in body.items() if k not in ("model", "messages")}
        if self.max_model_len is not None:
            prompt = await run_in_threadpool(self._prompt_tokens, messages, params)
            if prompt + int(params.get("max_tokens") or 0) > self.max_model_len:  # vLLM's check and wording
                return _error(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"your request has {prompt} input tokens and asks for {params.get('max_tokens')} "
                              "output tokens. Please reduce the length of the input messages.", "BadRequestError")
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        plan, fault = self._plan(model)
        if plan.latency_s:
            await asyncio.sleep(plan.latency_s)
        rec = {"model": model, "key": key, "context": context_hash(messages), "outcome": fault, "billed": False,
               "prompt_tokens": 0, "completion_tokens": 0}
        if fault == "rate_limit":
            self._record(rec)
            headers = {"Retry-After": str(math.ceil(plan.retry_after_s)), "retry-after-ms": str(int(plan.retry_after_s * 1000))}
            return _error(429, "rate limited", "rate_limit_error", headers)
        if fault == "server_error":
            self._record(rec)
            return _error(500, "injected server error", "server_error")
        try:
            message, usage, finish = await run_in_threadpool(self._completion, model, messages, params)
        # a responder bug is the server's 500, not a crash
        except Exception as exc:
            self._record({**rec, "outcome": "responder_error"})
            return _error(500, f"responder failed: {type(exc).__name__}: {exc}", "server_error")
        rec.update(billed=True, prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"])
        self._record(rec)
        if fault == "timeout":
            await asyncio.sleep(plan.timeout_delay_s)
        payload = {
            "id": f"chatcmpl-{rec['n']}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage,
        }
        data = json.dumps(payload).encode()
        if fault == "disconnect":
            return _Dropped(data)
        return Response(data[: len(data) // 2] if fault == "malformed" else data, media_type="application/json")

    # -- request handling helpers (responders run in worker threads)

    def _plan(self, model: str) -> tuple[FaultPlan, str]:
        plan = self.model_faults.get(model, self.faults)
        with self._lock:
            queue = self._scripted.get(model)
            if queue:
                return plan, queue.popleft()
            u = self._rng.random()
            jitter = self._rng.uniform(0, plan.latency_jitter_s) if plan.latency_jitter_s else 0.0
        plan = dataclasses.replace(plan, latency_s=plan.latency_s + jitter)
        edge = 0.0
        for name, p in zip(FAULTS, (plan.p_rate_limit, plan.p_server_error, plan.p_malformed, plan.p_disconnect, plan.p_timeout)):
            edge += p
            if u < edge:
                return plan, name
        return plan, "ok"

    def _record(self, rec: dict) -> None:
        with self._lock:
            rec["n"] = len(self.log)
            self.log.append(rec)
            if self._log_file is not None:
                self._log_file.write(json.dumps(rec) + "\n")
                self._log_file.flush()

    def _prompt_tokens(self, messages: list[dict], params: dict) -> int:
        """Prompt tokens of a request: the responder's own count when it has one, else words + 4 per message."""
        if hasattr(self.responder, "prompt_tokens"):
            return self.responder.prompt_tokens(messages, params)
        return sum(
            self.count_tokens(str(m.get("content") or ""))
            + (self.count_tokens(json.dumps(m["tool_calls"])) if m.get("tool_calls") else 0)
            + 4
            for m in messages
        ) + (self.count_tokens(json.dumps(params["tools"])) if params.get("tools") else 0)

    def _completion(self, model: str, messages: list[dict], params: dict) -> tuple[dict, dict, str]:
        """(assistant message, usage, finish_reason) with completions cut at max_tokens."""
        out = self.responder(model, messages, params)
        message = {"role": "assistant", "content": out} if isinstance(out, str) else {"role": "assistant", **out}
        message.setdefault("content", "")
        usage = message.pop("usage", None)
        # the responder counted with its own tokenizer (and obeyed max_tokens)
        if usage is not None:
            finish = "length" if usage["completion_tokens"] >= int(params.get("max_tokens") or 1 << 30) else "stop"
            return message, {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}, finish
        text = message["content"] or ""
        calls_text = json.dumps(message.get("tool_calls")) if message.get("tool_calls") else ""
        completion = self.count_tokens(text) + (self.count_tokens(calls_text) if calls_text else 0)
        limit = int(params.get("max_tokens") or 1 << 30)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if completion > limit:
            words = text.split()[:limit]
            while words and self.count_tokens(" ".join(words)) > limit:
                words.pop()
            message = {"role": "assistant", "content": " ".join(words)}
            completion, finish = self.count_tokens(message["content"]), "length"
        prompt = self._prompt_tokens(messages, params)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return message, usage, finish


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error(404, f"no route {request.url.path}", "not_found")


class _Dropped(Response):
    """A 200 whose connection drops mid-body (billed, never delivered): headers announce the whole
    body, half is sent, and the app returns; uvicorn then closes the connection."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body[: len(self.body) // 2], "more_body": True})
