"""`TeacherReplayActor`: preference pairs from teachers, over `replay/`, streamed to the controller.

States to replay come from frozen trace files (`[replay] traces`) and from the
run itself: each failed assistant turn of a rollout becomes a state (context =
the messages before it, action = what the student did). `next_pairs(n)` asks
the teachers about queued states (tier by tier, cache, budget and retries of
`replay.teachers`; votes of `replay.pairs`) until it has `n` pairs or runs out
of states; `status()` reports budget, spend, outcomes and queue sizes.
With `[replay] verify_pairs` a pair from the run's rollouts is kept only if the
run's environment scores its chosen action above its rejected one
(`actors.pair_verify`, here in the replay process); the verdicts are counted.
A teacher reply that says why it could not answer (its `refusal`) is counted by
teacher and reason (`status()["teacher_refusals"]`).

Semi-online (`[replay] semi_online`): `add_rollouts` replaces what is queued and
ready with the step's own failures (what it drops is counted as expired), nothing
works ahead, and a pair is kept only when the grader passes its chosen action
(`PairVerifier(require_pass=True)`): the next `next_pairs` replays, for the
step that trains on them, the states of that step's rollouts.
`snapshot()` / `restore()` carry the in-memory part (queued states, ready
pairs, counters) through the controller's state checkpoint, so a respawned
actor or a resumed run continues where the saved step left; the response cache
and budget ledger persist on disk themselves (`replay.cache`).

Working ahead: `work_ahead(n)` starts, in the background, the replay the next
`next_pairs(n)` would do on the states queued now, so the teachers and the pair
verification run while the generators sample and the trainer steps. Every
other endpoint first waits for it (`_settle`), so what is replayed, and in what
order, depends only on the calls made, never on timing: a run replays the same
states with or without working ahead, save for states the queue's bound evicts.
The controller works ahead right after saving its state, and again after
restoring one, so a resumed run does what the original did. Not with gating:
the gate scores states with the trainer's weights, which change under it.

Gating with the trainer's own policy: when `[replay.gating] enabled`, a state
is sent to teachers only if the current policy is uncertain about its recorded
action — mean token entropy from `TrainerActor.score` ≥ `min_entropy`. (The
trainer's score gives entropies, not top-2 margins, so `max_margin` does not
apply on this path; the offline `HFScorer` uses both.)

The teacher client, its budget and its HTTP connections live on one event loop
in a thread owned by the actor, so they persist across endpoint calls.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import torch
from monarch.actor import Actor, endpoint

from composer_mesh.actors.episodes import ChatTokens
from composer_mesh.actors.pair_verify import VERDICTS, PairVerifier
from composer_mesh.actors.rollout import Rollout, failure_sites
from composer_mesh.configs.sections.env import EnvConfig
from composer_mesh.configs.sections.replay import ReplayConfig
from composer_mesh.configs.sections.teachers import TeachersConfig
from composer_mesh.envs.factory import env_factory
from composer_mesh.envs.plugin import add_python_path
from composer_mesh.replay.cache import ResponseCache
from composer_mesh.replay.gating import Uncertainty, VOIGate
from composer_mesh.replay.pairs import PreferencePair
from composer_mesh.replay.pipeline import group_refusals, load_states, replay_states
from composer_mesh.replay.teachers import TeacherClient
from composer_mesh.replay.traces import TraceState


@dataclass(frozen=True)
class ReplaySpec:
    replay: ReplayConfig
    teachers: TeachersConfig
    # needed for gating with the trainer's policy
    tokenizer_dir: str = ""
    # states waiting for teachers; the oldest are dropped beyond it
    max_queue: int = 4096
    # the run's [env]: verifies pairs from its rollouts (`replay.verify_pairs`); None = no verification
    env: EnvConfig | None = None
    # [job] python_path: where task plugins are imported from
    python_path: tuple[str, ...] = ()


def rollout_states(rollout: Rollout) -> list[TraceState]:
    """One state per failed assistant turn of a rollout (`actors.rollout.failure_sites`)."""
    states = []
    for k, site in enumerate(failure_sites(rollout)):
        if rollout.messages[site.turn].get("role") != "assistant":
            continue
        states.append(TraceState(
            trace_id=f"rollout:{rollout.group_id}:{rollout.sample}:v{rollout.policy_version}",
            step=k, context=tuple(rollout.messages[: site.turn]), action=dict(rollout.messages[site.turn]),
            env_seed=rollout.seed, env_split=rollout.split,
        ))
    return states


class TrainerScorer:
    """Uncertainty of the trainer's current policy on a state's recorded action."""

    def __init__(self, trainer: Any, chat: ChatTokens) -> None:
        self.trainer, self.chat = trainer, chat

    def __call__(self, state: TraceState) -> Uncertainty:
        # lazy: start-up time; the trainer's modules (TorchTitan) load only when gating scores with the trainer
        from composer_mesh.actors.trainer import ScoreBatch

        prompt, action = self.chat.prompt_and_action(list(state.context), state.action)
        ids = list(prompt) + list(action)
        labels = torch.full((1, len(ids)), -100)
        labels[0, len(prompt) - 1 : len(ids) - 1] = torch.tensor(action)
        batch = ScoreBatch(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), labels)
        result = next(iter(self.trainer.score.call(batch).get().values()))
        entropy = float(result.entropy_NS.sum() / result.tokens_N.sum().clamp(min=1))
        return Uncertainty(entropy=entropy, margin=1.0)  # margin is not measured on this path


@dataclass
class ReplaySnapshot:
    """The replay actor's in-memory state between calls."""

    queue: list[TraceState]
    ready: list[PreferencePair]
    outcomes: dict[str, int]
    states_done: int
    pairs_made: int
    # verified / refuted / unverifiable pairs (`actors.pair_verify`)
    verification: dict[str, int] = field(default_factory=dict)
    # (teacher, reason) -> replies that said why the teacher could not answer
    refusals: dict[tuple[str, str], int] = field(default_factory=dict)
    # semi-online: states and pairs of earlier steps dropped when a step's own arrived
    expired: dict[str, int] = field(default_factory=dict)


class TeacherReplayActor(Actor):
    """Endpoints: add_states, add_rollouts, next_pairs, work_ahead, status, info, snapshot, restore,
    set_trainer."""

    def __init__(self, spec: ReplaySpec, trainer: Any = None) -> None:
        self.spec = spec
        out = Path(spec.replay.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.cache = ResponseCache(spec.teachers.cache_path or out / "cache.jsonl")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="teacher-replay", daemon=True)
        self.thread.start()
        self.client = self._on_loop(self._make_client(TeacherClient))
        self.gate = None
        if spec.replay.gating.enabled:
            if trainer is None or not spec.tokenizer_dir:
                raise ValueError("replay.gating.enabled in the application needs the trainer mesh and a tokenizer")
            # lazy: start-up time; the replay process loads transformers only when it gates
            from transformers import AutoTokenizer

            self.scorer = TrainerScorer(trainer, ChatTokens(AutoTokenizer.from_pretrained(spec.tokenizer_dir)))
            self.gate = VOIGate(spec.replay.gating, self.scorer)
        self.queue: deque[TraceState] = deque(load_states(spec.replay)[0] if spec.replay.traces else [],
                                              maxlen=spec.max_queue)
        self.ready: deque[PreferencePair] = deque()
        self.outcomes: Counter[str] = Counter()
        self.refusals: Counter[tuple[str, str]] = Counter()
        self.expired: Counter[str] = Counter()
        self.states_done = 0
        self.pairs_made = 0
        self.verifier = None
        if spec.replay.verify_pairs and spec.env is not None:
            add_python_path(spec.python_path)
            self.verifier = PairVerifier(partial(env_factory, spec.env), require_pass=spec.replay.semi_online)
        self.ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="replay-ahead")
        self.ahead: Future | None = None

    async def _make_client(self, cls: Any) -> Any:  # built on the loop that will use it
        return cls(self.spec.teachers, self.cache)

    def _on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _settle(self) -> None:
        """Wait for the work started by `work_ahead` (re-raising what it raised)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.result()

    @endpoint
    def add_states(self, states: Sequence[TraceState]) -> int:
        """Queue states for replay; returns the queue length."""
        self._settle()
        self.queue.extend(states)
        return len(self.queue)

    @endpoint
    def add_rollouts(self, rollouts: Sequence[Rollout]) -> int:
        """Queue the failed turns of rollouts (semi-online: instead of what was queued and ready); returns the
        queue length."""
        self._settle()
        if self.spec.replay.semi_online:
            self.expired.update(states=len(self.queue), pairs=len(self.ready))
            self.queue.clear()
            self.ready.clear()
        for r in rollouts:
            self.queue.extend(rollout_states(r))
        return len(self.queue)

    @endpoint
    def next_pairs(self, n: int) -> list[PreferencePair]:
        """Up to `n` pairs: from those ready, then by replaying queued states (a chunk at a time)."""
        self._settle()
        self._fill(n)
        return [self.ready.popleft() for _ in range(min(n, len(self.ready)))]

    @endpoint
    def work_ahead(self, n: int) -> bool:
        """Start filling the ready pairs up to `n` in the background; False (nothing started) with gating, or
        semi-online (the next step's pairs come from its own rollouts, not queued yet)."""
        self._settle()
        if self.gate is not None or self.spec.replay.semi_online:
            return False
        self.ahead = self.ahead_pool.submit(self._fill, n)
        return True

    def _fill(self, n: int) -> None:
        """Replay queued states, a chunk at a time, until `n` pairs are ready or no state is left (semi-online,
        where pairs left over expire at the next step, a chunk is at most the pairs still missing)."""
        while len(self.ready) < n and self.queue:
            size = min(self.spec.replay.concurrency, len(self.queue))
            if self.spec.replay.semi_online:
                size = min(size, n - len(self.ready))
            chunk = [self.queue.popleft() for _ in range(size)]
            results = self._on_loop(replay_states(chunk, self.client, self.spec.replay, gate=self.gate))
            for r in results:
                self.outcomes[r.outcome] += 1
                self.refusals.update((x["teacher"], x["reason"]) for x in r.refusals)
                if r.pair is not None:
                    self.pairs_made += 1
                    if self.verifier is None or self.verifier.keep(r.pair):
                        self.ready.append(r.pair)
            self.states_done += len(chunk)

    @endpoint
    def info(self) -> dict:
        return {"pid": os.getpid()}

    @endpoint
    def snapshot(self) -> ReplaySnapshot:
        self._settle()
        return ReplaySnapshot(list(self.queue), list(self.ready), dict(self.outcomes), self.states_done,
                              self.pairs_made, dict(self.verifier.counts) if self.verifier is not None else {},
                              dict(self.refusals), dict(self.expired))

    @endpoint
    def restore(self, snap: ReplaySnapshot) -> int:
        """Replace the in-memory state with `snap`; returns the queue length."""
        self._settle()
        self.queue = deque(snap.queue, maxlen=self.spec.max_queue)
        self.ready = deque(snap.ready)
        self.outcomes = Counter(snap.outcomes)
        self.states_done, self.pairs_made = snap.states_done, snap.pairs_made
        # a snapshot saved before refusals and expiry were counted has neither
        self.refusals = Counter(getattr(snap, "refusals", {}))
        self.expired = Counter(getattr(snap, "expired", {}))
        if self.verifier is not None:
            # a snapshot saved before pairs were verified has no counts
            self.verifier.counts = Counter(getattr(snap, "verification", {}))
        return len(self.queue)

    @endpoint
    def set_trainer(self, trainer: Any) -> None:
        """Score with a restarted trainer mesh (gating)."""
        self._settle()
        if self.gate is not None:
            self.scorer.trainer = trainer

    @endpoint
    def status(self) -> dict:
        self._settle()
        budget = self.client.budget
        return {
            "budget_usd": budget.cap_usd, "spend_usd": budget.spent_usd, "left_usd": budget.cap_usd - budget.spent_usd,
            "budget_refusals": budget.refusals, "queued_states": len(self.queue), "states_done": self.states_done,
            "pairs_made": self.pairs_made, "pairs_ready": len(self.ready), "outcomes": dict(self.outcomes),
            "client": self.client.stats.as_dict(), "teacher_refusals": group_refusals(self.refusals),
            "states_expired": self.expired["states"], "pairs_expired": self.expired["pairs"], **self._verification(),
        }

    def _verification(self) -> dict[str, int]:
        """pairs_verified / pairs_refuted / pairs_unverifiable: the environment's verdicts (refuted pairs
        are dropped); a pair made while verification is off counts as unverifiable."""
        counts = self.verifier.counts if self.verifier is not None else Counter({"unverifiable": self.pairs_made})
        return {f"pairs_{v}": counts.get(v, 0) for v in VERDICTS}
