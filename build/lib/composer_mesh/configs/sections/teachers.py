"""`[teachers]`: the external teacher models and how the client talks to them.

Each teacher is an OpenAI-compatible `/v1/chat/completions` endpoint (OpenRouter,
a vLLM server, the local `serve-teachers` server). Prices turn returned usage
into USD; the budget caps total spend across all teachers of one replay run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher model (one `[[teachers.models]]` table)."""

    name: str = option("", doc="unique teacher name (cache key, votes, provenance)")
    model: str = option("", doc="model id sent in the request body")
    base_url: str = option("", doc="endpoint root ending in /v1; empty = teachers.base_url")
    api_key_env: str = option(
        "", doc="environment variable holding this teacher's API key (empty = teachers.api_key_env)",
        secret_env=True,
    )
    price_in_per_mtok: float = option(0.0, doc="USD per million prompt tokens", ge=0.0)
    price_out_per_mtok: float = option(0.0, doc="USD per million completion tokens", ge=0.0)
    max_concurrency: int = option(4, doc="requests in flight to this teacher at once", ge=1)
    tier: int = option(0, doc="escalation tier: lower tiers are asked first", ge=0)
    weight: float = option(1.0, doc="vote weight for weighted consensus", gt=0.0)
    max_tokens: int = option(512, doc="max completion tokens (also the worst case the budget reserves)", ge=1)
    temperature: float = option(0.0, doc="sampling temperature", ge=0.0)
    max_context_tokens: int = option(
        0, doc="context length (prompt + max_tokens); 0 = ask the server's /v1/models (max_model_len), none = no limit",
        ge=0,
    )


@dataclass(frozen=True)
class TeachersConfig:
    """Client settings shared by all teachers, the budget and the response cache."""

    models: tuple[TeacherSpec, ...] = option((), doc="the teachers ([[teachers.models]] tables)")
    base_url: str = option("http://127.0.0.1:8765/v1", doc="default endpoint root for teachers without one")
    api_key_env: str = option("", doc="default environment variable holding the API key", secret_env=True)
    budget_usd: float = option(1.0, doc="hard cap on total spend of one run (USD)", ge=0.0)
    connect_timeout_s: float = option(5.0, doc="TCP connect timeout", gt=0.0)
    read_timeout_s: float = option(120.0, doc="time to wait for a response", gt=0.0)
    max_retries: int = option(4, doc="retries after the first attempt on 429/5xx/connection errors", ge=0)
    backoff_base_s: float = option(0.5, doc="first backoff delay; doubles each retry (full jitter)", ge=0.0)
    backoff_max_s: float = option(30.0, doc="cap on one backoff delay, Retry-After included", ge=0.0)
    prompt_tokens_per_byte: float = option(
        1.0, doc="upper bound on prompt tokens per UTF-8 byte of the request (budget worst case)", gt=0.0
    )
    prompt_tokens_overhead: int = option(
        16, doc="extra prompt tokens reserved per message (chat template markup)", ge=0
    )
    context_overflow: Literal["trim", "skip"] = option(
        "trim", doc="a state too long for a teacher: drop its oldest messages until it fits, or skip it",
        choices=("trim", "skip"),
    )
    stop_after_client_errors: int = option(
        3, doc="stop a teacher whose first N calls all fail with the same client error (0 = never)", ge=0
    )
    cache_path: str = option("", doc="response cache file (JSONL); empty = <replay.output_dir>/cache.jsonl")
