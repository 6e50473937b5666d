"""Async client for teacher models behind OpenAI-compatible `/v1/chat/completions`.

One `TeacherClient` serves all teachers of a `TeachersConfig` (OpenRouter, vLLM,
the local `serve-teachers` server: anything with that endpoint). Per call:
cache lookup → per-teacher concurrency slot → budget reservation of the worst
case → journal intent → POST → settle the budget to the billed cost → journal
the result (the response is on disk before it is returned).

Failures: 429 / 5xx / connection errors / timeouts / malformed bodies are
retried with exponential backoff and full jitter (Retry-After and
retry-after-ms honoured); other 4xx end at once. A call that still fails comes
back as a `TeacherReply` with a structured `TeacherError`, never an exception.
Billing: 429 and 5xx are assumed free; a timeout, dropped connection or
malformed 200 body may have been billed, so it is charged its worst case.
Context: each teacher's context length (its `max_context_tokens`, else the
server's `/v1/models` `max_model_len`) is learnt once; a request whose prompt
bound + max_tokens exceeds it is trimmed (oldest messages first) or skipped
before anything is reserved or sent, and a server's context-length 400 is a
`context_length` skip, not a failure. A teacher whose first
`stop_after_client_errors` calls all fail with the same client error (a wrong
model name, a missing server flag) is stopped with that message; until that
is settled its calls go one at a time.
API keys are read from environment variables and never appear in errors or logs.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import math
import os
import random
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import certifi
import httpx

from composer_mesh.configs.sections.teachers import TeacherSpec, TeachersConfig
from composer_mesh.replay.budget import Budget, BudgetExceeded, cost_nusd
from composer_mesh.replay.cache import NANO, ResponseCache, canonical_json, context_hash, request_key

_WIRE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
_RETRYABLE_STATUS = (429, 500, 502, 503, 504, 529)
# kinds that are not failures: nothing was sent (or a free refusal) because of the budget or the context length
SKIPS = ("budget", "context_length")
_CONTEXT_400 = ("maximum context length", "context_length_exceeded", "context length")


@dataclass(frozen=True)
class TeacherError:
    """Why a call produced no response. kind: rate_limited, server_error, timeout,
    connection, disconnect, malformed, client_error, stopped (see SKIPS for the rest)."""

    kind: str
    message: str
    status: int | None = None


@dataclass(frozen=True)
class TeacherReply:
    """One teacher's answer to one context (or why there is none)."""

    teacher: str
    model: str
    message: dict | None
    usage: dict = field(default_factory=dict)
    cost_usd: float = 0.0
    cached: bool = False
    attempts: int = 0
    error: TeacherError | None = None


@dataclass
class ClientStats:
    requests: int = 0  # HTTP attempts sent
    cache_hits: int = 0
    retries: int = 0
    # teacher -> replies received (tiers above 0: escalations)
    answered: Counter = field(default_factory=Counter)
    # requests sent with their oldest messages dropped to fit the context
    trimmed: int = 0
    failures: Counter = field(default_factory=Counter)
    # teacher -> tokens (None: unknown, no limit)
    context_limits: dict = field(default_factory=dict)
    # teacher -> the client error that stopped it
    stopped: dict = field(default_factory=dict)

    @property
    def successes(self) -> int:
        return sum(self.answered.values())

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "successes": self.successes, "failures": dict(self.failures),
                "answered": dict(self.answered)}


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process (building one per client is slow)."""
    return ssl.create_default_context(cafile=certifi.where())


def wire_messages(messages: list[dict]) -> list[dict]:
    """Messages with only the keys the OpenAI API accepts (drops reasoning, is_error, ...)."""
    return [{k: m[k] for k in _WIRE_KEYS if k in m and m[k] is not None} for m in messages]


def tool_specs(names: tuple[str, ...] | list[str]) -> list[dict]:
    """Function-tool declarations for tools known only by name (free-form arguments)."""
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]


def retry_after_s(headers: httpx.Headers) -> float | None:
    """Server-requested delay: retry-after-ms, else Retry-After (seconds or HTTP date)."""
    if "retry-after-ms" in headers:
        try:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


class TeacherClient:
    """Chat completions for the teachers of `cfg`, with cache, budget and retries.

    cache: the durable response cache (None: no caching, e.g. benchmarks);
    budget: shared spend cap (default: `cfg.budget_usd`, starting from the
    cache's recorded prior spend); sleep/seed: the backoff clock and jitter.
    """

    def __init__(
        self,
        cfg: TeachersConfig,
        cache: ResponseCache | None = None,
        budget: Budget | None = None,
        *,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        seed: int = 0,
    ) -> None:
        self.cfg = cfg
        self.teachers: dict[str, TeacherSpec] = {t.name: t for t in cfg.models}
        if len(self.teachers) != len(cfg.models) or "" in self.teachers:
            raise ValueError("teacher names must be unique and non-empty")
        self.cache = cache
        self.budget = budget or Budget(cfg.budget_usd, cache.prior_spend_nusd if cache else 0)
        self.stats = ClientStats()
        self._sleep = sleep
        self._rng = random.Random(seed)
        self._secrets: dict[str, str] = {}
        self._http: dict[str, httpx.AsyncClient] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._limit_locks: dict[str, asyncio.Lock] = {}
        # teacher -> its first client errors; None: settled
        self._first_errors: dict[str, list[str] | None] = {}
        self._deciding_locks: dict[str, asyncio.Lock] = {}
        for spec in cfg.models:
            env = spec.api_key_env or cfg.api_key_env
            if env and env not in os.environ:
                raise ValueError(f"teacher {spec.name!r}: environment variable {env} is not set")
            self._secrets[spec.name] = os.environ.get(env, "") if env else ""

    def __repr__(self) -> str:  # never show keys
        return f"TeacherClient(teachers={list(self.teachers)}, budget=${self.budget.cap_usd})"

    def base_url(self, spec: TeacherSpec) -> str:
        return (spec.base_url or self.cfg.base_url).rstrip("/")

    def _client(self, spec: TeacherSpec) -> httpx.AsyncClient:
        url = self.base_url(spec)
        if url not in self._http:
            limit = sum(t.max_concurrency for t in self.cfg.models)
            self._http[url] = httpx.AsyncClient(
                timeout=httpx.Timeout(self.cfg.read_timeout_s, connect=self.cfg.connect_timeout_s, pool=None),
                limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
                verify=_tls_context(),
            )
        return self._http[url]

    def _slot(self, name: str) -> asyncio.Semaphore:
        if name not in self._slots:
            self._slots[name] = asyncio.Semaphore(self.teachers[name].max_concurrency)
        return self._slots[name]

    def prompt_bound(self, messages: list[dict], tools: list[dict] | None) -> int:
        """Bound on the prompt's tokens: request bytes × tokens/byte + per-message markup."""
        nbytes = len(canonical_json({"messages": messages, "tools": tools}).encode())
        return math.ceil(nbytes * self.cfg.prompt_tokens_per_byte) + self.cfg.prompt_tokens_overhead * (len(messages) + 1)

    def worst_case_nusd(self, spec: TeacherSpec, body: dict) -> int:
        """Upper bound on the call's cost: the prompt bound in, and max_tokens out."""
        prompt = self.prompt_bound(body["messages"], body.get("tools"))
        return cost_nusd(prompt, spec.max_tokens, spec.price_in_per_mtok, spec.price_out_per_mtok)

    async def context_limit(self, spec: TeacherSpec) -> int | None:
        """The teacher's context length: its config key, else `/v1/models` `max_model_len` (asked once)."""
        if spec.max_context_tokens:
            return spec.max_context_tokens
        async with self._limit_locks.setdefault(spec.name, asyncio.Lock()):
            if spec.name not in self.stats.context_limits:
                self.stats.context_limits[spec.name] = await self._served_max_len(spec)
        return self.stats.context_limits[spec.name]

    async def _served_max_len(self, spec: TeacherSpec) -> int | None:
        headers = {"Authorization": f"Bearer {self._secrets[spec.name]}"} if self._secrets[spec.name] else {}
        try:
            resp = await self._client(spec).get(f"{self.base_url(spec)}/models", headers=headers)
            models = resp.json()["data"] if resp.status_code == 200 else []
            entry = next((m for m in models if isinstance(m, dict) and m.get("id") == spec.model), {})
            return int(entry["max_model_len"]) if entry.get("max_model_len") else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            # no such route or no such field: the server's own 400 is the fallback
            return None

    def fit(self, spec: TeacherSpec, messages: list[dict], tools: list[dict] | None, limit: int | None) -> list[dict] | None:
        """`messages` within the context limit: as they are, trimmed (oldest non-system messages first,
        never starting at a tool result), or None when they cannot fit or trimming is off."""
        if limit is None or self.prompt_bound(messages, tools) + spec.max_tokens <= limit:
            return messages
        if self.cfg.context_overflow == "skip":
            return None
        head = 1 if messages and messages[0].get("role") == "system" else 0
        rest = messages[head:]
        while len(rest) > 1:
            rest = rest[1:]
            while len(rest) > 1 and rest[0].get("role") == "tool":  # a tool result needs its call
                rest = rest[1:]
            if self.prompt_bound(messages[:head] + rest, tools) + spec.max_tokens <= limit:
                self.stats.trimmed += 1
                return messages[:head] + rest
        return None

    def _deciding(self, name: str) -> bool:
        """Whether the stop rule is still open for this teacher (its calls so far: all client errors, fewer than N)."""
        errors = self._first_errors.get(name, [])
        return bool(self.cfg.stop_after_client_errors) and errors is not None and name not in self.stats.stopped

    def _note_outcome(self, name: str, error: TeacherError | None) -> None:
        """Stop a teacher whose first N calls all failed with the same client error; any other
        answer or failure of the server (skips aside) settles it for good."""
        n = self.cfg.stop_after_client_errors
        errors = self._first_errors.setdefault(name, [])
        if not n or errors is None or name in self.stats.stopped or (error is not None and error.kind in SKIPS):
            return
        if error is None or error.kind != "client_error":
            self._first_errors[name] = None
            return
        errors.append(error.message)
        if len(errors) >= n:
            if len(set(errors[:n])) == 1:
                self.stats.stopped[name] = errors[0]
            self._first_errors[name] = None

    def _redact(self, text: str) -> str:
        for secret in self._secrets.values():
            if secret:
                text = text.replace(secret, "***")
        return text

    def _backoff(self, attempt: int, server_delay: float | None) -> float:
        jitter = self._rng.uniform(0.0, min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2**attempt))
        return max(server_delay, jitter) if server_delay is not None else jitter

    async def complete(self, teacher: str, messages: list[dict], tools: list[dict] | None = None) -> TeacherReply:
        """The teacher's next assistant message for `messages` (cached, budgeted, retried)."""
        # one call at a time until the stop rule is settled: no burst of refusals
        if self._deciding(teacher):
            lock = self._deciding_locks.setdefault(teacher, asyncio.Lock())
            await lock.acquire()
            try:
                if self._deciding(teacher):
                    return await self._complete(teacher, messages, tools)
            finally:
                # settled while this call waited: it goes on concurrently
                lock.release()
        return await self._complete(teacher, messages, tools)

    async def _complete(self, teacher: str, messages: list[dict], tools: list[dict] | None) -> TeacherReply:
        spec = self.teachers[teacher]
        if teacher in self.stats.stopped:
            self.stats.failures["stopped"] += 1
            return TeacherReply(teacher, spec.model, None, error=TeacherError(
                "stopped", f"teacher stopped after {self.cfg.stop_after_client_errors} identical client errors: "
                f"{self.stats.stopped[teacher]}"))
        wire = self.fit(spec, wire_messages(messages), tools, await self.context_limit(spec))
        if wire is None:
            self.stats.failures["context_length"] += 1
            limit = self.stats.context_limits.get(teacher) or spec.max_context_tokens
            return TeacherReply(teacher, spec.model, None, error=TeacherError(
                "context_length", f"prompt bound {self.prompt_bound(wire_messages(messages), tools)} + max_tokens "
                f"{spec.max_tokens} exceeds the context length {limit}"))
        body: dict[str, Any] = {
            "model": spec.model,
            "messages": wire,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
        }
        if tools:
            body["tools"] = tools
        params = {k: body[k] for k in ("max_tokens", "temperature", "tools") if k in body}
        key = request_key(spec.name, spec.model, params, body["messages"])
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            self.stats.cache_hits += 1
            self._note_outcome(teacher, None)  # it answered in an earlier run
            return TeacherReply(teacher, spec.model, hit.message, hit.usage, hit.cost_nusd / NANO, cached=True)
        worst = self.worst_case_nusd(spec, body)
        error: TeacherError | None = None
        sent = 0
        async with self._slot(teacher):
            for attempt in range(self.cfg.max_retries + 1):
                try:
                    await self.budget.reserve(worst)
                except BudgetExceeded as exc:
                    error = TeacherError("budget", str(exc))
                    break
                self.stats.retries += attempt > 0
                sent += 1
                reply, error, delay = await self._attempt(spec, body, key, worst, attempt + 1)
                if reply is not None:
                    self.stats.answered[teacher] += 1
                    self._note_outcome(teacher, None)
                    return reply
                if error.kind in ("client_error", "context_length") or attempt == self.cfg.max_retries:
                    break
                await self._sleep(self._backoff(attempt, delay))
        self.stats.failures[error.kind] += 1
        self._note_outcome(teacher, error)
        return TeacherReply(teacher, spec.model, None, attempts=sent, error=error)

    async def _attempt(
        self, spec: TeacherSpec, body: dict, key: str, worst: int, attempt: int
    ) -> tuple[TeacherReply | None, TeacherError | None, float | None]:
        """One HTTP attempt under a held reservation; always settles it and journals the outcome."""
        journal = None
        if self.cache is not None:  # durable before the request leaves
            journal = await asyncio.to_thread(self.cache.intent, key, spec.name, worst, context_hash(body["messages"]))
        headers = {"Authorization": f"Bearer {self._secrets[spec.name]}"} if self._secrets[spec.name] else {}
        charged, error, delay, reply = 0, None, None, None
        self.stats.requests += 1
        try:
            resp = await self._client(spec).post(f"{self.base_url(spec)}/chat/completions", json=body, headers=headers)
        except httpx.TimeoutException as exc:
            charged, error = (0, TeacherError("connection", f"connect timeout: {exc!r}")) if isinstance(
                exc, httpx.ConnectTimeout
            ) else (worst, TeacherError("timeout", f"no response within {self.cfg.read_timeout_s}s"))
        except httpx.ConnectError as exc:
            error = TeacherError("connection", self._redact(f"cannot connect: {exc}"))
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            charged, error = worst, TeacherError("disconnect", self._redact(f"connection dropped: {exc!r}"))
        else:
            if resp.status_code == 200:
                reply, error, charged = self._parse(spec, resp, worst, attempt)
            else:
                text = self._redact(resp.text[:300])
                kind = "rate_limited" if resp.status_code == 429 else (
                    "server_error" if resp.status_code in _RETRYABLE_STATUS or resp.status_code >= 500 else "client_error"
                )
                if kind == "client_error" and any(m in text for m in _CONTEXT_400):
                    # the server's own count: a free refusal, skipped
                    kind = "context_length"
                error = TeacherError(kind, f"HTTP {resp.status_code}: {text}", resp.status_code)
                delay = retry_after_s(resp.headers) if kind != "client_error" else None
        # durable before the caller sees the response
        if journal is not None:
            if reply is not None:
                await asyncio.to_thread(self.cache.result, journal, key, spec.name, spec.model, charged, reply.message, reply.usage)
            else:
                await asyncio.to_thread(
                    self.cache.result, journal, key, spec.name, spec.model, charged, error=f"{error.kind}: {error.message}"
                )
        await self.budget.settle(worst, charged)
        return reply, error, delay

    def _parse(
        self, spec: TeacherSpec, resp: httpx.Response, worst: int, attempt: int
    ) -> tuple[TeacherReply | None, TeacherError | None, int]:
        """(reply, error, cost charged) of a 200 response; malformed bodies are charged the worst case."""
        try:
            data = resp.json()
            raw = data["choices"][0]["message"]
            message = {"role": "assistant", "content": raw.get("content") or ""}
            if raw.get("tool_calls"):
                message["tool_calls"] = list(raw["tool_calls"])
            # why the model did not answer (OpenAI's field), kept for the replay's accounting
            if raw.get("refusal"):
                message["refusal"] = str(raw["refusal"])
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return None, TeacherError("malformed", f"unparseable 200 body: {self._redact(resp.text[:120])!r}"), worst
        usage = data.get("usage") or {}
        try:
            charged = cost_nusd(
                int(usage["prompt_tokens"]), int(usage["completion_tokens"]), spec.price_in_per_mtok, spec.price_out_per_mtok
            )
        except (KeyError, TypeError, ValueError):
            # no usage reported: assume the worst we allowed
            charged = worst
        usage = {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens")}
        return TeacherReply(spec.name, spec.model, message, usage, charged / NANO, attempts=attempt), None, charged

    async def aclose(self) -> None:
        for client in self._http.values():
            await client.aclose()
        self._http.clear()


class SyncTeacherClient:
    """A `TeacherClient` on its own event-loop thread, for blocking callers (hint generation)."""

    def __init__(self, cfg: TeachersConfig, cache: ResponseCache | None = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="teacher-client", daemon=True)
        self._thread.start()
        self.client = TeacherClient(cfg, cache, **kwargs)

    def complete(self, teacher: str, messages: list[dict], tools: list[dict] | None = None) -> TeacherReply:
        return asyncio.run_coroutine_threadsafe(self.client.complete(teacher, messages, tools), self._loop).result()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
