"""A step's hints (channel 2, and RLSD's teacher): which rollouts get one, and what the hint shows.

`HintMaker.make(groups)` hints the first failure site of each targeted rollout (`mesh.packing.make_hint`):
`[loss.distill] targets = "failed"` targets every rollout (as before the key existed: a hint needs a failure
site), `"all_fail_groups"` only the rollouts of groups where no episode solved the task
(`mesh.outcomes.solved`), where the policy gradient has nothing to learn from. With
`hint_kind = "reference_prefix"` each group first updates its task's revealed share (more lines after a group
that failed every sample, fewer after one with a pass; `replay.hints.ReferencePrefixHintGenerator`), then
its rollouts are hinted with it. The shares are the controller's state (`state_dict`, carried through its
state checkpoint), so a resumed run reveals what the original would have.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from composer_mesh.actors.episodes import ChatTokens
from composer_mesh.actors.rollout import RolloutGroup
from composer_mesh.mesh.outcomes import solved, task_key
from composer_mesh.mesh.packing import RolloutHint, make_hint
from composer_mesh.replay.hints import ReferencePrefixHintGenerator


class HintMaker:
    """Hints for a step's groups from `hinter` (a `replay.hints.HintGenerator`), for the rollouts `targets`
    selects; `metrics()` after `make` says what the step hinted."""

    def __init__(self, hinter: Any, chat: ChatTokens, targets: Literal["failed", "all_fail_groups"] = "failed") -> None:
        self.hinter, self.chat, self.targets = hinter, chat, targets
        self._counts: dict[str, float] = {}

    def make(self, groups: Sequence[RolloutGroup]) -> dict[int, RolloutHint]:
        """Rollout index (in the step's order: groups' rollouts one after the other) → its hint."""
        adaptive = isinstance(self.hinter, ReferencePrefixHintGenerator)
        fallbacks = getattr(self.hinter, "fallbacks", 0)
        hints: dict[int, RolloutHint] = {}
        at, targeted = 0, 0
        for group in groups:
            passed = any(solved(r) for r in group.rollouts)
            if adaptive and group.rollouts:
                self.hinter.observe(task_key(group.rollouts[0]), passed)
            if self.targets == "failed" or not passed:
                for k, rollout in enumerate(group.rollouts):
                    hinter = self.hinter.for_task(task_key(rollout)) if adaptive else self.hinter
                    targeted += 1
                    if (hint := make_hint(self.chat, rollout, hinter)) is not None:
                        hints[at + k] = hint
            at += len(group.rollouts)
        self._counts = {"distill/targeted": float(targeted),
                        "distill/hint_fallbacks": float(getattr(self.hinter, "fallbacks", 0) - fallbacks)}
        return hints

    def metrics(self) -> dict[str, float]:
        """The last `make`'s rollouts the targets let through and hints that fell back to feedback."""
        return dict(self._counts)

    def state_dict(self) -> dict[str, Any]:
        return {"reveal": self.hinter.state_dict()} if isinstance(self.hinter, ReferencePrefixHintGenerator) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.hinter, ReferencePrefixHintGenerator) and "reveal" in state:
            self.hinter.load_state_dict(state["reveal"])
