"""Durable response cache and spend journal for paid teacher calls (one append-only JSONL).

Three record kinds, each one line written with write + flush + fsync:
- `intent`  before a request is sent: key, attempt id, worst-case cost;
- `result`  when the attempt ends: attempt id, cost charged, and for a success
  the response (the response is on disk before the caller sees it);
- nothing else. A run killed at any point leaves at most a truncated last line
  (skipped on load) and intents with no result (requests in flight at the kill).

On load the cache serves every stored response (a restarted run repeats no
call whose response was received) and reports the journal's spend: settled
costs plus the worst case of each unresolved intent, since whether those were
billed is unknowable. A restarted run starts its budget from that figure.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# journal amounts are integer nano-USD: sums are exact
NANO = 1_000_000_000


def canonical_json(obj: Any) -> str:
    """Stable JSON text for hashing (sorted keys, no whitespace)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def context_hash(messages: list[dict]) -> str:
    """sha256 of the messages' canonical JSON (the local server logs the same hash)."""
    return hashlib.sha256(canonical_json(messages).encode()).hexdigest()


def request_key(teacher: str, model: str, params: dict, messages: list[dict]) -> str:
    """Cache key: sha256 over (teacher, model, params, sha256 of the context)."""
    context = context_hash(messages)
    material = canonical_json({"teacher": teacher, "model": model, "params": params, "context": context})
    return hashlib.sha256(material.encode()).hexdigest()


@dataclass(frozen=True)
class CachedResponse:
    key: str
    teacher: str
    model: str
    message: dict
    usage: dict
    cost_nusd: int


class ResponseCache:
    """Append-only cache + journal. Thread-safe (the async client writes from worker
    threads so disk flushes never stall its event loop); one run at a time holds it
    (an exclusive flock, released by the OS even on SIGKILL)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._responses: dict[str, CachedResponse] = {}
        self._open_intents: dict[str, int] = {}  # attempt id -> worst nano-USD
        # spend recorded by earlier runs (see module doc)
        self.prior_spend_nusd = 0
        # requests in flight when an earlier run died
        self.unresolved_at_load = 0
        self.corrupt_lines = 0
        self._lock = threading.Lock()
        self._file = open(self.path, "ab")
        # two live runs sharing one cache could both buy the same response
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise RuntimeError(f"response cache {self.path} is in use by another run") from None
        self._load()
        if self._file.tell() and not self.path.read_bytes().endswith(b"\n"):
            # never glue onto a line a killed run left unterminated
            self._file.write(b"\n")
        self._seq = 0
        self._run = os.urandom(6).hex()

    def _load(self) -> None:
        settled = 0
        for line in self.path.read_bytes().split(b"\n"):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                kind = rec["kind"]
                if kind == "intent":
                    self._open_intents[rec["attempt"]] = int(rec["worst_nusd"])
                elif kind == "result":
                    self._open_intents.pop(rec["attempt"], None)
                    settled += int(rec["cost_nusd"])
                    if rec.get("message") is not None:
                        self._responses[rec["key"]] = CachedResponse(
                            rec["key"], rec["teacher"], rec["model"], rec["message"], rec["usage"], int(rec["cost_nusd"])
                        )
            except (ValueError, KeyError, TypeError):
                self.corrupt_lines += 1  # a line cut by a kill mid-write
        self.unresolved_at_load = len(self._open_intents)
        self.prior_spend_nusd = settled + sum(self._open_intents.values())
        self._open_intents.clear()

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, key: str) -> CachedResponse | None:
        return self._responses.get(key)

    def _append(self, rec: dict) -> None:
        data = (canonical_json(rec) + "\n").encode()
        with self._lock:
            self._file.write(data)
            self._file.flush()  # from here a SIGKILL cannot lose the line
            fd = self._file.fileno()
        # outside the lock: concurrent writers share the disk flush
        os.fsync(fd)

    def intent(self, key: str, teacher: str, worst_nusd: int, context: str = "") -> str:
        """Journal a request about to be sent (context: hash of its messages); returns its attempt id."""
        with self._lock:
            self._seq += 1
            attempt = f"{self._run}-{self._seq}"
        self._append(
            {"kind": "intent", "attempt": attempt, "key": key, "teacher": teacher, "worst_nusd": worst_nusd, "context": context}
        )
        return attempt

    def result(
        self,
        attempt: str,
        key: str,
        teacher: str,
        model: str,
        cost_nusd: int,
        message: dict | None = None,
        usage: dict | None = None,
        error: str | None = None,
    ) -> None:
        """Journal how an attempt ended; a success (message given) becomes servable."""
        rec = {
            "kind": "result", "attempt": attempt, "key": key, "teacher": teacher, "model": model,
            "cost_nusd": cost_nusd, "message": message, "usage": usage, "error": error,
        }
        self._append(rec)
        if message is not None:
            self._responses[key] = CachedResponse(key, teacher, model, message, usage or {}, cost_nusd)

    def close(self) -> None:
        with self._lock:
            self._file.close()
