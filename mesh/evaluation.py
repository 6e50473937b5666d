"""Held-out evaluation during training (as TRL's `eval_steps`, verl's validation).

Every `every` steps (and once before the first) the controller rolls out a
fixed set of `samples` problems from the environment's *held-out* split (or,
to choose settings without looking at it, its validation split: `split`) on its
generators, twice: greedy (temperature 0, one rollout per problem) and sampled
(the recipe's sampling, `group_size` rollouts per problem, one fixed seed, so
two evaluations differ only by the weights). The rollouts are never trained on,
never go to the teacher replay, and never touch the training request stream or
its sampling seeds: each `generate` call seeds its own sampler from the
`SamplingParams` it is given (actors/hf_engine.py), so a run trains the same
with evaluation on or off (tests/mesh/test_mesh_eval.py).

On coding tasks the sampled groups also give the share of problems none of
whose `group_size` samples passed (`all_fail_share`: where the policy gradient
has nothing to learn from) and pass@k. With `hinted` the sampled set is rolled
out a second time with the task's reference as a privileged note after each
prompt (`EpisodeRequest.hinted`), and `hint_gap` is the hinted sampled pass
rate minus the unhinted one: how much the policy reads a hint placed where the
hint channel places it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from composer_mesh.actors.rollout import EpisodeRequest, RolloutGroup, SamplingParams
from composer_mesh.mesh.episode_metrics import eval_pass_rates


@dataclass(frozen=True)
class EvalConfig:
    # controller steps between evaluations; 0 = off
    every: int = 0
    # held-out problems per evaluation (the same ones every time)
    samples: int = 8
    # the sampled evaluation's params (seed fixed for the run)
    sampling: SamplingParams = SamplingParams()
    # the environment split the problems come from; the metrics keep their `eval/heldout_*` names
    split: Literal["heldout", "validation"] = "heldout"
    # also sample the problems with the task's reference as a note after the prompt (hint_gap; coding tasks)
    hinted: bool = False


def heldout_requests(samples: int, split: Literal["heldout", "validation"] = "heldout",
                     hinted: bool = False) -> list[EpisodeRequest]:
    """The fixed evaluation set: problem seeds 0..samples-1 of `split` (the same for every job seed, so runs
    of different seeds are scored on the same problems); negative group ids, never a training group's."""
    return [EpisodeRequest(group_id=-(i + 1), seed=i, split=split, hinted=hinted) for i in range(samples)]


def _rollout(generators: Sequence[Any], requests: list[EpisodeRequest], sampling: SamplingParams,
             group_size: int | None) -> list[RolloutGroup]:
    """`requests` split evenly over `generators`, all called at once."""
    k = len(generators)
    calls, at = [], 0
    for i, gen in enumerate(generators):
        n = len(requests) // k + (1 if i < len(requests) % k else 0)
        if n:
            calls.append(gen.generate.call_one(requests[at : at + n], sampling, group_size))
            at += n
    return [g for call in calls for g in call.get()]


def evaluate(generators: Sequence[Any], cfg: EvalConfig) -> dict[str, float]:
    """Greedy and sampled mean reward on the held-out set with the generators' current weights (and, with
    `cfg.hinted`, the sampled pass rate with the reference as a note)."""
    start = time.perf_counter()
    requests = heldout_requests(cfg.samples, cfg.split)
    greedy = _rollout(generators, requests, dataclasses.replace(cfg.sampling, temperature=0.0), 1)
    sampled = _rollout(generators, requests, cfg.sampling, None)
    # the same problems and sampling seeds, each prompt followed by the note
    hinted = _rollout(generators, heldout_requests(cfg.samples, cfg.split, True), cfg.sampling, None) if cfg.hinted else []
    greedy_rollouts = [r for grp in greedy for r in grp.rollouts]
    sampled_rollouts = [r for grp in sampled for r in grp.rollouts]
    g = [r.reward for r in greedy_rollouts]
    s = [r.reward for r in sampled_rollouts]
    versions = {r.policy_version for grp in greedy + sampled + hinted for r in grp.rollouts}
    return {
        "eval/heldout_greedy": sum(g) / len(g),
        "eval/heldout_sampled": sum(s) / len(s),
        # reward 1 = solved (the demo's exact answer)
        "eval/heldout_sampled_solved": sum(x >= 1.0 for x in s) / len(s),
        "eval/policy_version": float(min(versions)),
        # coding tasks: pass rates (every hidden test passed), all-fail share and pass@k, the sampled episodes'
        # metrics, and the hinted pass rate and hint gap
        **eval_pass_rates(greedy_rollouts, [grp.rollouts for grp in sampled], [grp.rollouts for grp in hinted]),
        "eval/seconds": time.perf_counter() - start,
    }
