"""A switched-on auxiliary channel that gets nothing is never silent.

Channel 2 (hint distillation, `[loss] alpha > 0`, or RLSD) is on from the first step; it gets something when
a step packs hinted tokens (`distill/hinted_tokens`). Channel 3 (preference pairs, `[loss] beta > 0`) is on
when the run has a replay actor (`[mesh] replay_procs > 0`; without one the channel is named off, with the
key); it gets something when a step trains on a pair (`preference/pairs_in_batch`). `ChannelWatch.step`
warns at every step while an on channel has had nothing, and `summary` gives summary.json's `channels` (per
channel: on, why off, what it got) and, when a run's steps ended with an on channel that got nothing,
`silent_channels`: one line per such channel naming it, its key and why (the hints' targets and failure sites;
the replay's outcomes and the teachers' refusals and errors). `composer-mesh train` then exits 3, as for a run
that trained nothing.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from composer_mesh.configs.schema import JobConfig
from composer_mesh.mesh.controller import StepRecord

logger = logging.getLogger(__name__)

# what each channel counts, per step's metrics row
GOT = {"distill": "distill/hinted_tokens", "preference": "preference/pairs_in_batch"}
NAMES = {"distill": "channel 2 (hint distillation)", "preference": "channel 3 (preference pairs)"}


def _count_line(counts: dict[str, Any]) -> str:
    """`a 3, b 1` from a {name: count} mapping (most first, then by name), or `none`."""
    items = sorted(((int(v), str(k)) for k, v in counts.items() if v), key=lambda nk: (-nk[0], nk[1]))
    return ", ".join(f"{k} {n}" for n, k in items) or "none"


class ChannelWatch:
    """Per-step accounting of what channels 2 and 3 got in a run (`replay`: whether a replay actor runs)."""

    def __init__(self, job: JobConfig, replay: bool) -> None:
        loss = job.loss
        self.keys = {"distill": f"loss.alpha = {loss.alpha}" + (" with loss.distill.rlsd" if loss.distill.rlsd else ""),
                     "preference": f"loss.beta = {loss.beta}"}
        self.off: dict[str, str] = {}
        if not (loss.alpha > 0 or loss.distill.rlsd):
            self.off["distill"] = "loss.alpha = 0"
        if loss.beta <= 0:
            self.off["preference"] = "loss.beta = 0"
        elif not replay:
            self.off["preference"] = "mesh.replay_procs = 0 starts no replay actor"
        self.targets = loss.distill.targets
        self.got = {name: 0.0 for name in GOT}
        self.steps = 0
        self.rollouts = {"targeted": 0.0, "hinted": 0.0}

    def on(self, channel: str) -> bool:
        return channel not in self.off

    def step(self, record: StepRecord) -> None:
        """Count the step's hinted tokens and pairs; warn for each on channel that has had none so far."""
        self.steps += 1
        for name, key in GOT.items():
            self.got[name] += float(record.metrics.get(key, 0.0))
        self.rollouts["targeted"] += float(record.metrics.get("distill/targeted", 0.0))
        self.rollouts["hinted"] += float(record.metrics.get("distill/hinted", 0.0))
        for name in GOT:
            if self.on(name) and not self.got[name]:
                logger.warning("step %d: %s (%s) has got nothing in %d step%s so far", record.step, NAMES[name],
                               self.keys[name], self.steps, "s" * (self.steps != 1))

    def _why_distill(self) -> str:
        targeted, hinted = int(self.rollouts["targeted"]), int(self.rollouts["hinted"])
        if not targeted:
            return (f"loss.distill.targets = {self.targets!r} let no rollout through"
                    + (" (no group failed every sample)" if self.targets == "all_fail_groups" else ""))
        if not hinted:
            return (f"none of the {targeted} targeted rollouts had a failure site in a sampled turn (a failed tool "
                    "call or a failed grade) to hint")
        return f"{hinted} rollouts were hinted, but none of their hinted turns had a sampled token"

    @staticmethod
    def _why_preference(replay: dict[str, Any] | None) -> str:
        if replay is None:
            return "no replay status"
        refusals = {f"{teacher}: {why}": n for teacher, reasons in replay.get("teacher_refusals", {}).items()
                    for why, n in reasons.items()}
        failures = replay.get("client", {}).get("failures", {})
        parts = [f"{replay.get('states_done', 0)} failed turns replayed (outcomes: "
                 f"{_count_line(replay.get('outcomes', {}))})",
                 f"teachers could not answer: {_count_line(refusals)}",
                 f"teacher calls failed: {_count_line(failures)}",
                 f"{replay.get('pairs_made', 0)} pairs made (refuted {replay.get('pairs_refuted', 0)}, "
                 f"unverifiable {replay.get('pairs_unverifiable', 0)}, chosen not passing "
                 f"{replay.get('pairs_chosen_failed', 0)})"]
        return "; ".join(parts)

    def summary(self, history: Sequence[StepRecord], replay: dict[str, Any] | None) -> dict[str, Any]:
        """summary.json's `channels` and, when steps ran and an on channel got nothing, `silent_channels`."""
        channels = {name: {"on": self.on(name), **({"off": self.off[name]} if not self.on(name) else {}),
                           "got": self.got[name], "counts": GOT[name]} for name in GOT}
        out: dict[str, Any] = {"channels": channels}
        silent = {}
        for name in GOT:
            if history and self.on(name) and not self.got[name]:
                why = self._why_distill() if name == "distill" else self._why_preference(replay)
                silent[name] = (f"{NAMES[name]} is on ({self.keys[name]}) but got nothing in {len(history)} "
                                f"steps: {why}")
        if silent:
            out["silent_channels"] = silent
        return out
