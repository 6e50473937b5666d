"""`[replay]`: which frozen traces to replay, how to gate, vote and normalize.

Traces become per-step states; gated states go to the teachers of `[teachers]`;
agreement of at least `min_agree` teachers against the recorded action becomes a
preference pair; the pairs go through a data-juicer recipe into the dataset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from composer_mesh.configs.fields import option

# Who answers on the local teacher server (`mesh.responders.build_responder`).
RESPONDERS = ("consensus", "echo", "solver", "hf", "coding")
# `[replay] semi_online`'s default group pass-rate bound: prompts the student solves at most 1 in 8 times
SEMI_ONLINE_PASS_RATE = 0.125


@dataclass(frozen=True)
class GatingConfig:
    """Value-of-information gating on the student's uncertainty, and tiered escalation."""

    enabled: bool = option(False, doc="ask teachers only where the student is uncertain")
    scorer: Literal["hf"] = option("hf", doc="uncertainty scorer offline: a local HF model", choices=("hf",))
    scorer_model: str = option("", doc="local HF model directory for the offline scorer")
    min_entropy: float = option(0.5, doc="query when mean token entropy (nats) of the action is at least this", ge=0.0)
    max_margin: float = option(0.2, doc="query when the smallest top-2 probability margin is at most this", ge=0.0, le=1.0)
    tiered: bool = option(True, doc="ask low tiers first; ask higher tiers only on disagreement")


@dataclass(frozen=True)
class LocalServerConfig:
    """The local OpenAI-compatible teacher server the replay command may start itself."""

    enabled: bool = option(False, doc="start `serve-teachers` in-process for this run")
    host: str = option("127.0.0.1", doc="loopback address to bind")
    port: int = option(0, doc="port (0 = any free port; teachers.base_url is then rewritten)", ge=0, le=65535)
    responder: Literal["consensus", "echo", "solver", "hf", "coding"] = option(
        "consensus",
        doc="who answers: a deterministic consensus responder, echo, the demo-task solver, a local HF model, or "
        "coding teachers (the run's coding tasks' reference solutions as write_file calls)",
        choices=RESPONDERS,
    )
    noise: float = option(
        0.2, doc="consensus / solver / coding responders: chance a model departs from the shared (solver, coding: "
        "exact) answer",
        ge=0.0, le=1.0,
    )
    model_dir: str = option("", doc="local HF model directory for responder = hf")
    latency_s: float = option(0.0, doc="injected latency per request", ge=0.0)
    request_log: str = option("", doc="JSONL file where the server logs every request it answers")


@dataclass(frozen=True)
class ReplayConfig:
    """Trace replay: inputs, voting, output."""

    traces: tuple[str, ...] = option((), doc="trace files (JSONL) to replay; a directory stands for its *.jsonl files")
    trace_format: Literal["auto", "claude_code", "openai"] = option(
        "auto", doc="trace format; auto decides per file", choices=("auto", "claude_code", "openai")
    )
    output_dir: str = option("outputs/replay", doc="dataset, summary and cache go here")
    max_states: int = option(0, doc="replay at most this many states (0 = all)", ge=0)
    max_context_messages: int = option(0, doc="keep only the last N context messages (0 = all)", ge=0)
    min_agree: int = option(2, doc="teachers that must agree against the student for a pair", ge=1)
    strategy: Literal["plurality", "weighted"] = option(
        "plurality", doc="how the winning teacher action is chosen", choices=("plurality", "weighted")
    )
    min_weight_fraction: float = option(
        0.5, doc="weighted strategy: winner's share of the voting weight must exceed this", ge=0.0, le=1.0
    )
    equivalence: Literal["tool_call", "text"] = option(
        "tool_call",
        doc="action equality: tool calls by name + canonical arguments (text when neither calls a tool), or normalised text",
        choices=("tool_call", "text"),
    )
    concurrency: int = option(8, doc="states replayed at once", ge=1)
    verify_pairs: bool = option(
        True,
        doc="keep a pair from the run's own rollouts only if the run's environment scores its chosen action above "
        "the rejected one (frozen-trace pairs are unverifiable and kept)",
    )
    semi_online: bool = option(
        False,
        doc="pairs only from this step's own failed rollouts, replayed for the step that trains on them (no working "
        "ahead), chosen only when the grader passes it (reward 1); needs verify_pairs and no traces",
    )
    max_group_pass_rate: float | None = option(
        None,
        doc="states only from groups whose pass rate is at most this (the failed rollouts of hard prompts); "
        "unset: 1/8 with semi_online, every group otherwise",
        ge=0.0, le=1.0,
    )
    recipe: str = option("default", doc="data-juicer recipe: a name in replay/recipes or a YAML path")
    gating: GatingConfig = option(default_factory=GatingConfig, doc="uncertainty gating")
    local_server: LocalServerConfig = option(default_factory=LocalServerConfig, doc="local teacher server")

    def __post_init__(self) -> None:
        if self.semi_online and not self.verify_pairs:
            raise ValueError("replay.semi_online keeps only pairs whose chosen action the grader passes: it needs "
                             "replay.verify_pairs = true")
        if self.semi_online and self.traces:
            raise ValueError("replay.semi_online replays only this step's own failures: frozen replay.traces would "
                             "never be replayed (set replay.traces = [])")

    @property
    def group_pass_limit(self) -> float | None:
        """The pass rate a group's failed rollouts need at most to be replayed (None: every group)."""
        if self.max_group_pass_rate is not None:
            return self.max_group_pass_rate
        return SEMI_ONLINE_PASS_RATE if self.semi_online else None
