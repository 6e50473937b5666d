"""The README's main job: `composer-mesh train configs/coding_cpu.toml`, seeded, as shipped; and with channels 2
and 3 switched on, all three train in the sandbox.

Real Monarch processes (trainer, generator, and replay where channel 3 is on), the
sandboxed micro coding tasks in the tool loop (each edit checked by the visible
tests, a failing one undone), the shipped CPU-independent base. As shipped the
recipe trains the policy channel alone (docs/recipe.md, "The coding task, nine
seeds"). On the pinned base (2026-12-07) its held-out pass rate does not rise over
30 steps (docs/coding.md, "Known limits"), so this test guards what the run must
keep: the tool-call format and a held-out pass rate within `HELDOUT_DROP` of step
0, every step trained by the policy channel alone, real multi-turn episodes. With
`--loss.alpha/--loss.beta` set, every step must train all three channels, the hints
must come from real test failures in the sandbox and the local coding teachers'
answers must become pairs.
"""

from __future__ import annotations

import pytest

from test_mesh_train import heldout_gain, train_shipped

# one 30-step coding run: 140-340 s on a 2-core box (docs/coding.md, docs/recipe.md); loaded boxes take longer
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

STEPS = 30
# held-out pass rate, step 0 -> 30, of the policy channel alone on the shipped pinned base (this 2-core AVX2 box,
# seeds 0-2): sampled 0.547 -> 0.578, 0.625 -> 0.578, 0.781 -> 0.688 (-0.036 +- 0.063), greedy 0.500 -> 0.438 each
# (one task of 16 is 0.0625). The recipe learned on the earlier per-CPU bases (+0.239 +- 0.109 sampled over nine
# seeds on an AMX box, +0.094 for seed 0 on CI's AVX-512 box) and is not re-tuned for this one yet. A run that
# loses the format or the tasks falls by more than this; the RL steps run on the CPU's own kernels, so the figures
# move between CPU types.
HELDOUT_DROP = 0.15
# channels 2 and 3 at the weights docs/recipe.md measured them at (benchmarks/ablation.py's coding task)
CHANNELS = ("--loss.alpha=0.25", "--loss.beta=0.25")
CHANNEL_STEPS = 3


def test_coding_recipe_trains_as_shipped_and_keeps_its_held_out_pass_rate(tmp_path, tiny_assets):
    summary, rows = train_shipped(tmp_path, "coding_cpu", STEPS, tiny_assets.root.parents[1], timeout=2300)
    assert summary["heldout"]["before"]["step"] == 0 and summary["heldout"]["after"]["step"] >= STEPS - 2
    assert heldout_gain(summary, "eval/heldout_sampled_pass") >= -HELDOUT_DROP, summary["heldout"]
    assert heldout_gain(summary, "eval/heldout_greedy_pass") >= -HELDOUT_DROP, summary["heldout"]
    assert summary["heldout"]["after"]["eval/heldout_sampled_pass"] >= 0.25, summary["heldout"]  # the agent still works

    for r in rows:
        assert r["rollouts/policy"] > 0 and r["policy/tokens"] > 0
        # channels 2 and 3 off as shipped: nothing hinted, no pair, no distillation or preference loss
        assert r.get("distill/hinted", 0) == 0 and "distill/loss" not in r, r
        assert r.get("preference/pairs_in_batch", 0) == 0 and "preference/loss" not in r, r
        # the grader's refusals are counted (none expected from this policy)
        assert "coding/violations" in r and r["coding/violations"] >= 0
    # no replay actor, so no teacher was asked and nothing was spent
    assert summary["replay"] is None
    # the sandbox's verdicts on the policy's edits: failing visible tests, each undone
    assert sum(r["coding/tool_errors/test_failure"] for r in rows) > 0
    # tool loops of more than one turn: an edit, its verdict, then another edit or the closing message
    assert sum(r["coding/turns"] for r in rows) / STEPS >= 2 and min(r["coding/multi_turn"] for r in rows) > 0.5


def test_coding_recipe_trains_three_live_channels(tmp_path, tiny_assets):
    summary, rows = train_shipped(tmp_path, "coding_cpu", CHANNEL_STEPS, tiny_assets.root.parents[1], timeout=1200,
                                  overrides=(*CHANNELS, "--trainer.eval_every=0"))
    for r in rows:
        # all three channels carried loss on every step
        assert r["rollouts/policy"] > 0 and r["policy/tokens"] > 0
        assert r["distill/hinted"] > 0 and r["distill/loss"] > 0 and r["distill/tokens"] > 0
        assert r["preference/pairs"] > 0 and r["preference/loss"] > 0
        # the hints' error sites are the sandbox's real verdicts on the policy's edits (failing visible tests)
        assert r["coding/tool_errors/test_failure"] > 0
    # the teachers answered the run's failed states, some answers became pairs, within the budget
    assert summary["replay"]["outcomes"]["pair"] > 0
    assert 0 < summary["replay"]["spend_usd"] <= 0.5
