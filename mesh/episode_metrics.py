"""Per-step metrics of coding episodes: pass rate, turns, tool errors and sandbox violations by kind, grading time,
calls refused by the tool loop's cost bounds.

A coding task's last observation carries its grade in `info` (`passed`, `total`,
`grade_s`, `violations` as (kind, detail) pairs; the tool loop adds `grading_s`,
its checks and final grade together, and `calls_refused` by bound); the episode
loop copies it into `Rollout.info`. Tool errors are the rollout's error sites (each
a failed tool call or a failing test run, classified by `configs.records.ErrorKind`).
Rollouts without a grade (the demo task) add nothing, so non-coding runs log what
they logged before.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from composer_mesh.actors.rollout import Rollout


def graded(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """The rollouts that a coding task graded (their info has `total` and `grade_s`)."""
    return [r for r in rollouts if "total" in r.info and "grade_s" in r.info]


def passed(rollout: Rollout) -> bool:
    """Every hidden test passed and the grade found nothing wrong (reward 1)."""
    total = int(rollout.info.get("total", 0))
    return total > 0 and int(rollout.info.get("passed", 0)) == total and rollout.reward >= 1.0


def pass_rate(rollouts: Sequence[Rollout]) -> float:
    """Share of `rollouts` that passed (0 when there are none)."""
    return sum(passed(r) for r in rollouts) / max(1, len(rollouts))


def episode_metrics(rollouts: Sequence[Rollout], prefix: str = "coding/") -> dict[str, float]:
    """Pass rate, mean turns, tool errors, violations and calls refused (by bound) per kind (totals over the
    step), mean and max seconds of the final grade and of all the episode's grading (checks included, where the
    environment counts them) of the graded rollouts; {} when none was graded."""
    done = graded(rollouts)
    if not done:
        return {}
    n = len(done)
    errors = Counter(site.kind.value for r in done for site in r.error_sites)
    violations = Counter(str(v[0]) for r in done for v in r.info.get("violations", ()))
    refused: Counter[str] = Counter()
    for r in done:
        refused.update(r.info.get("calls_refused") or {})
    grade_s = [float(r.info["grade_s"]) for r in done]
    grading_s = [float(r.info.get("grading_s", r.info["grade_s"])) for r in done]
    out = {
        f"{prefix}pass_rate": pass_rate(done),
        f"{prefix}turns": sum(int(r.info.get("turns", len(r.turn_spans))) for r in done) / n,
        f"{prefix}multi_turn": sum(int(r.info.get("turns", len(r.turn_spans))) >= 2 for r in done) / n,
        f"{prefix}tool_errors": float(sum(errors.values())),
        f"{prefix}violations": float(sum(violations.values())),
        f"{prefix}grade_s_mean": sum(grade_s) / n,
        f"{prefix}grade_s_max": max(grade_s),
        f"{prefix}grading_s_mean": sum(grading_s) / n,
        f"{prefix}grading_s_max": max(grading_s),
        f"{prefix}calls_refused": float(sum(refused.values())),
    }
    out.update({f"{prefix}tool_errors/{k}": float(v) for k, v in sorted(errors.items())})
    out.update({f"{prefix}violations/{k}": float(v) for k, v in sorted(violations.items())})
    out.update({f"{prefix}calls_refused/{k}": float(v) for k, v in sorted(refused.items())})
    return out


def rollout_record(rollout: Rollout) -> dict[str, Any]:
    """One episode for `rollouts.jsonl`: its group and sample, reward, finish reason, policy version, the
    task and grade fields of its info, and its messages after the prompt (assistant turns and tool results)."""
    first = next((i for i, m in enumerate(rollout.messages) if m.get("role") == "assistant"), len(rollout.messages))
    info = {k: v for k, v in rollout.info.items() if isinstance(v, (str, int, float, bool)) or k == "violations"}
    return {
        "group": rollout.group_id, "sample": rollout.sample, "seed": rollout.seed, "reward": rollout.reward,
        "finish_reason": rollout.finish_reason, "policy_version": rollout.policy_version, "info": info,
        "turns": rollout.messages[first:],
    }


def all_fail_share(groups: Sequence[Sequence[Rollout]]) -> float:
    """Share of `groups` (a problem's samples each) none of whose rollouts passed (0 when there are none)."""
    return sum(not any(passed(r) for r in group) for group in groups) / max(1, len(groups))


def eval_pass_rates(greedy: Sequence[Rollout], sampled: Sequence[Sequence[Rollout]],
                    hinted: Sequence[Sequence[Rollout]] = ()) -> dict[str, Any]:
    """For coding tasks: the held-out pass rates (greedy, and sampled over every sample of every problem's group),
    the share of problems whose group all failed and pass@k (k = the group's size: at least one sample passed),
    the sampled episodes' metrics, and with `hinted` groups (the same problems with the reference as a note) their
    pass rate and all-fail share and `hint_gap`, the hinted sampled pass rate minus the unhinted one."""
    flat = [r for group in sampled for r in group]
    if not graded(greedy) and not graded(flat):
        return {}
    fail = all_fail_share(sampled)
    out = {"eval/heldout_greedy_pass": pass_rate(greedy), "eval/heldout_sampled_pass": pass_rate(flat),
           "eval/heldout_all_fail_share": fail, "eval/heldout_pass_at_k": 1.0 - fail,
           **episode_metrics(flat, prefix="eval/heldout_")}
    if hinted:
        with_note = pass_rate([r for group in hinted for r in group])
        out |= {"eval/heldout_hinted_sampled_pass": with_note, "eval/heldout_hinted_all_fail_share":
                all_fail_share(hinted), "eval/heldout_hint_gap": with_note - out["eval/heldout_sampled_pass"]}
    return out
