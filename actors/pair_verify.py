"""Verified pairs: the run's environment grades a pair's two actions from the pair's state.

A pair made from the run's own rollouts carries its episode's env seed and split.
`action_score` rebuilds that episode: `reset(seed)`, the context's assistant
actions stepped again (the environment's answers must reproduce the context,
else the state cannot be rebuilt), the candidate action stepped, and, when the
environment has not scored it yet, the episode closed as the tool loop closes
it (a message without tool calls, which grades the workspace). `PairVerifier`
keeps a pair only when score(chosen) > score(rejected); with `require_pass`
(`[replay] semi_online`) only when the chosen action also passes (score ≥ 1: a
first-turn state's answer solves the task), and never an unverifiable one. Each
action runs in a fresh environment, closed after it (workspaces are freed).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Literal, Sequence

from composer_mesh.actors.episodes import student_action
from composer_mesh.envs.base import Environment
from composer_mesh.envs.tool_format import CLOSING
from composer_mesh.replay.pairs import PreferencePair

log = logging.getLogger(__name__)

Verdict = Literal["verified", "refuted", "unverifiable", "chosen_failed"]
# chosen_failed: above the rejected action, but the grader does not pass it (counted only with require_pass)
VERDICTS: tuple[Verdict, ...] = ("verified", "refuted", "unverifiable", "chosen_failed")
# the score of an answer that passes (rewards are in [0, 1])
PASS = 1.0


def _same_message(a: dict, b: dict) -> bool:
    return a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")


def action_score(make_env: Callable[[str], Environment], seed: int, split: str, context: Sequence[dict],
                 action: dict) -> float | None:
    """The environment's reward for `action` taken after `context` in episode `seed` of `split`;
    None when the episode cannot be rebuilt (its answers differ from the context, or it ended)
    or gives no reward."""
    env = make_env(split)
    try:
        start = env.reset(seed=seed).messages
        if len(context) < len(start) or not all(_same_message(a, b) for a, b in zip(start, context)):
            return None
        for message in context[len(start):]:
            if message.get("role") != "assistant":
                continue
            if env.state.done:
                return None
            env.step(message)
        replayed = env.state.messages
        if env.state.done or len(replayed) != len(context) or not all(map(_same_message, replayed, context)):
            return None
        obs = env.step(student_action(action))
        if not obs.done and obs.reward is None:
            obs = env.step({"role": "assistant", "content": CLOSING})
        return None if obs.reward is None else float(obs.reward)
    finally:
        env.close()


class PairVerifier:
    """Verdicts on pairs with the run's environments (`make_env(split)`, built on first use);
    `counts` holds verified / refuted / unverifiable (/ chosen_failed); `require_pass`: keep only verified pairs
    whose chosen action passes."""

    def __init__(self, make_factory: Callable[[], Callable[[str], Environment]], require_pass: bool = False) -> None:
        self._make_factory = make_factory
        self._factory: Callable[[str], Environment] | None = None
        self.require_pass = require_pass
        self.counts: Counter[str] = Counter()

    def verdict(self, pair: PreferencePair) -> Verdict:
        if pair.env_seed is None:
            return "unverifiable"
        if self._factory is None:
            self._factory = self._make_factory()
        try:
            chosen = action_score(self._factory, pair.env_seed, pair.env_split, pair.context, pair.chosen)
            rejected = action_score(self._factory, pair.env_seed, pair.env_split, pair.context, pair.rejected)
        except Exception as exc:  # an environment failure keeps the pair, as an unverified one
            log.warning("pair %s#%d: the environment could not score it: %r", pair.trace_id, pair.step, exc)
            return "unverifiable"
        if chosen is None or rejected is None:
            return "unverifiable"
        if chosen <= rejected:
            return "refuted"
        return "chosen_failed" if self.require_pass and chosen < PASS else "verified"

    def keep(self, pair: PreferencePair) -> bool:
        """Count the pair's verdict; False when the environment refutes it (`require_pass`: unless verified)."""
        v = self.verdict(pair)
        self.counts[v] += 1
        return v == "verified" if self.require_pass else v != "refuted"
