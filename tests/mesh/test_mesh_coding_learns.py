"""The README's main job learns: `composer-mesh train configs/coding_cpu.toml`, seeded, as shipped.

Real Monarch processes (trainer, generator, replay), the sandboxed micro coding
tasks in the tool loop (each edit checked by the visible tests, a failing one
undone), the local coding teachers, the warm-started tiny base. The held-out
pass rate (hidden tests; templates never trained on) must rise by
`HELDOUT_MARGIN` from step 0, sampled, and greedy must not fall
(docs/coding.md has the three-seed table this margin comes from and what the
gain is made of). Every step must train all three channels, the episodes must
be multi-turn tool loops, the hints must come from real test failures in the
sandbox, and the grader's violations must be counted.
"""

from __future__ import annotations

import pytest

from test_mesh_train import heldout_gain, train_shipped

# one 30-step coding run: 337 s in the full suite on a 2-core box (docs/coding.md, eighth round); loaded boxes take longer
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

STEPS = 30
# held-out sampled pass-rate gain, step 0 -> 30, on the clipped warm start built on a fixed thread count
# (docs/coding.md, "Eleventh round", a CPU with AVX-512 and AMX units): seeds 0-2 +0.109, +0.359, +0.031
# (+0.167 +- 0.171). This test runs seed 0, whose figures repeat on one CPU type; the margin is half its
# gain, so a recipe that stops learning fails. Another CPU type builds another base (the same section).
HELDOUT_MARGIN = 0.05


def test_coding_recipe_pass_rate_rises_with_three_live_channels(tmp_path, tiny_assets):
    summary, rows = train_shipped(tmp_path, "coding_cpu", STEPS, tiny_assets.root.parents[1], timeout=2300)
    assert heldout_gain(summary, "eval/heldout_sampled_pass") >= HELDOUT_MARGIN, summary["heldout"]
    assert heldout_gain(summary, "eval/heldout_greedy_pass") >= 0, summary["heldout"]

    for r in rows:
        # all three channels carried loss on every step
        assert r["rollouts/policy"] > 0 and r["policy/tokens"] > 0
        assert r["distill/hinted"] > 0 and r["distill/loss"] > 0 and r["distill/tokens"] > 0
        assert r["preference/pairs"] > 0 and r["preference/loss"] > 0
        # the hints' error sites are the sandbox's real verdicts on the policy's edits (failing visible tests)
        assert r["coding/tool_errors/test_failure"] > 0
        # the grader's refusals are counted (none expected from this policy)
        assert "coding/violations" in r and r["coding/violations"] >= 0
    # tool loops of more than one turn: an edit, its verdict, then another edit or the closing message
    assert sum(r["coding/turns"] for r in rows) / STEPS >= 2 and min(r["coding/multi_turn"] for r in rows) > 0.5
    # the teachers answered the run's failed states and some of their answers became pairs
    assert summary["replay"]["outcomes"]["pair"] > 0
