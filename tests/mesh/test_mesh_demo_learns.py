"""The README's main job learns: a shortened, seeded `composer-mesh train configs/demo_cpu.toml`.

Real Monarch processes (trainer, generator), the local teacher server, the
warm-started tiny base model. Over the run the sampled reward on *held-out*
problems (never drawn for training) must rise by `HELDOUT_MARGIN_SHORT` from
step 0, and the mean training reward of the last 20% of steps must exceed that
of the first 20% by `MARGIN_SHORT` (docs/application.md states the full run's
margins, how they were measured over seeds and what the gain is made of), and
every step must train all three channels: policy (groups with unequal rewards; a
non-zero surrogate on at least half the steps),
hint distillation (non-zero loss) and DPO against the frozen reference
(non-zero loss that moves away from log 2). The episodes must be multi-turn
(a second attempt after feedback) and the teachers must disagree (the
tie-breaking teacher asked on some states, some states without a pair).
"""

from __future__ import annotations

import math

import pytest

from test_mesh_train import heldout_gain, train_shipped

pytestmark = pytest.mark.slow

STEPS = 30
MARGIN_SHORT = 0.02  # reward units (0 malformed .. 1 exact); see docs/application.md
# held-out sampled reward, step 0 -> STEPS: over seeds 0-4 with both samplers (torch.multinomial before
# 2026-11-27, inverse CDF since) +0.083 +- 0.052, seed 0 now +0.060 (docs/application.md); below mean - 1 sd,
# so a recipe that stops learning fails, and one seed's draw does not decide
HELDOUT_MARGIN_SHORT = 0.03


def test_debug_recipe_reward_rises_with_three_live_channels(tmp_path, tiny_assets):
    summary, rows = train_shipped(tmp_path, "demo_cpu", STEPS, tiny_assets.root.parents[1], timeout=1200)
    assert heldout_gain(summary, "eval/heldout_sampled") >= HELDOUT_MARGIN_SHORT, summary["heldout"]

    k = STEPS // 5
    first = sum(r["reward/mean"] for r in rows[:k]) / k
    last = sum(r["reward/mean"] for r in rows[-k:]) / k
    assert last - first >= MARGIN_SHORT, (first, last, [round(r["reward/mean"], 3) for r in rows])

    for r in rows:
        # the policy channel trains every step; its surrogate −Σ Â·ρ·w / N can be 0 on a step whose
        # groups' answers have equal lengths (advantages sum to 0 per group, ρ ≈ 1), its gradient is not
        assert r["rollouts/policy"] > 0 and r["policy/tokens"] > 0 and math.isfinite(r["policy/loss"])
        assert r["distill/loss"] > 0 and r["distill/tokens"] > 0
        assert r["preference/loss"] > 0 and r["preference/pairs"] > 0
    live_policy = sum(abs(r["policy/loss"]) > 1e-6 for r in rows)
    assert live_policy >= STEPS // 2, [r["policy/loss"] for r in rows]
    # frozen π_ref: once the policy has moved, the DPO loss is no longer log 2 at every step
    assert max(abs(r["preference/loss"] - math.log(2)) for r in rows[1:]) > 1e-2

    # multi-turn: failed first attempts get the environment's feedback and a second attempt
    assert all(1 <= r["rollouts/turns"] <= 2 for r in rows) and max(r["rollouts/turns"] for r in rows) > 1
    # the teachers disagree: the tie-breaker (tier 1) is asked only where a and b differ, and some
    # failed turns yield no pair (no majority, or a majority for the student's own answer)
    replay = summary["replay"]
    answered, outcomes = replay["client"]["answered"], replay["outcomes"]
    assert 0 < answered["c"] < min(answered["a"], answered["b"]), answered
    assert 0 < outcomes["pair"] < sum(outcomes.values()), outcomes
