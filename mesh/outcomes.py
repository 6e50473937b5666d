"""Did an episode solve its task, and how often did a prompt's group: what decides where channels 2 and 3 learn.

A graded coding episode solved its task when every hidden test passed (`mesh.episode_metrics.passed`); an
episode without a grade (the demo, plugin environments) when its reward reached 1. Hints on all-fail groups
(`[loss.distill] targets`) and the replay's group pass-rate bound (`[replay] max_group_pass_rate`) read these.
"""

from __future__ import annotations

from typing import Sequence

from composer_mesh.actors.rollout import Rollout, RolloutGroup
from composer_mesh.mesh.episode_metrics import passed


def solved(rollout: Rollout) -> bool:
    """Every hidden test passed (a graded episode), or reward 1 (one without a grade)."""
    return passed(rollout) if "total" in rollout.info else rollout.reward >= 1.0


def group_pass_rate(group: RolloutGroup) -> float:
    """The share of the group's episodes that solved the task (0 for an empty group)."""
    return sum(solved(r) for r in group.rollouts) / max(1, len(group.rollouts))


def task_key(rollout: Rollout) -> str:
    """What names the rollout's task across steps: the coding task's name, else its split and seed."""
    return str(rollout.info.get("task") or f"{rollout.split}:{rollout.seed}")


def replay_rollouts(groups: Sequence[RolloutGroup], pass_limit: float | None) -> list[Rollout]:
    """The rollouts whose failed turns go to the teachers (channel 3): every rollout (`pass_limit` None), or the
    unsolved ones of groups whose pass rate is at most `pass_limit` (`[replay] max_group_pass_rate`)."""
    if pass_limit is None:
        return [r for g in groups for r in g.rollouts]
    return [r for g in groups if group_pass_rate(g) <= pass_limit for r in g.rollouts if not solved(r)]
