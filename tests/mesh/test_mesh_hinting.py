"""Which rollouts get a hint and what it shows (`mesh.hinting.HintMaker`), on real demo rollouts of the tiny model.

- `targets = "failed"` is the loop before the key existed: `make_hint` on every rollout.
- `targets = "all_fail_groups"` hints only the rollouts of groups where no episode solved the task.
- `hint_kind = "reference_prefix"`: each group first moves its task's share (+step after an all-fail group,
  −step after one with a pass), then its rollouts show ceil(share · n) of the n lines the reference writes; the
  shares survive a state round trip.
- The group pass-rate bound of channel 3 (`mesh.outcomes.replay_rollouts`).
"""

from __future__ import annotations

import math

import pytest

from composer_mesh.configs.sections.loss import DistillLossConfig
from composer_mesh.configs.sections.teachers import TeachersConfig

CHANGE = "--- m.py\n    a = x + 1\n    b = a * 2\n    c = b - 3\n    d = c * c\n    return d"


@pytest.fixture(scope="module")
def episodes(demo_rollouts):
    """Three groups of three; group 1 has one solved episode (reward 1), the others none."""
    groups, chat, _ = demo_rollouts([31, 32, 33], 3, 5, ([0.0, 0.2, 0.0], [1.0, 0.0, 0.4], [0.0, 0.0, 0.1]))
    return groups, chat


def _generator(kind: str, **keys):
    from composer_mesh.replay.hints import make_hint_generator

    return make_hint_generator(DistillLossConfig(hint_kind=kind, **keys), TeachersConfig())


def test_failed_targets_are_the_loop_before_the_key(episodes):
    from composer_mesh.mesh.hinting import HintMaker
    from composer_mesh.mesh.packing import make_hint

    groups, chat = episodes
    rollouts = [r for g in groups for r in g.rollouts]
    before = {i: h for i, r in enumerate(rollouts) if (h := make_hint(chat, r, _generator("template"))) is not None}
    maker = HintMaker(_generator("template"), chat, "failed")
    assert maker.make(groups) == before and len(before) >= 8  # the demo's wrong answers are error sites
    assert maker.metrics() == {"distill/targeted": 9.0, "distill/hint_fallbacks": 0.0}


def test_all_fail_groups_hint_only_groups_without_a_pass(episodes):
    from composer_mesh.mesh.hinting import HintMaker
    from composer_mesh.mesh.outcomes import group_pass_rate, solved

    groups, chat = episodes
    assert [group_pass_rate(g) for g in groups] == [0.0, pytest.approx(1 / 3), 0.0]
    assert solved(groups[1].rollouts[0]) and not solved(groups[1].rollouts[2])  # reward 0.4 is not a pass
    maker = HintMaker(_generator("template"), chat, "all_fail_groups")
    hints = maker.make(groups)
    assert hints and set(hints) <= {0, 1, 2, 6, 7, 8}  # group 1's rollouts are 3, 4, 5
    assert maker.metrics()["distill/targeted"] == 6.0
    everything = HintMaker(_generator("template"), chat, "failed").make(groups)
    assert {i: h for i, h in everything.items() if i not in (3, 4, 5)} == hints


def test_reference_prefix_shares_follow_each_tasks_groups(episodes):
    import dataclasses

    from composer_mesh.mesh.hinting import HintMaker
    from composer_mesh.replay.hints import change_note

    groups, chat = episodes
    # groups 0 and 2 are one task, group 1 another; every episode knows the lines its reference writes
    named = []
    for g, task in zip(groups, ("t", "u", "t")):
        rollouts = [dataclasses.replace(r, info={**r.info, "task": task, "reference_change": CHANGE})
                    for r in g.rollouts]
        named.append(dataclasses.replace(g, rollouts=rollouts))
    maker = HintMaker(_generator("reference_prefix", hint_reveal_start=0.5, hint_reveal_step=0.25), chat)
    hints = maker.make(named)
    n = 5  # written lines of CHANGE
    shown = {0: 0.75, 1: 0.25, 2: 1.0}  # t: all fail (0.5 → 0.75); u: a pass (→ 0.25); t again: all fail (→ 1.0)
    for i, hint in hints.items():
        assert hint.text == change_note(CHANGE, math.ceil(shown[i // 3] * n)), i
    assert {i // 3 for i in hints} == {0, 1, 2}
    # the shares are the controller's state: a maker restored from it goes on where this one is
    state = maker.state_dict()
    assert state == {"reveal": {"t": 1.0, "u": 0.25}}
    restored = HintMaker(_generator("reference_prefix", hint_reveal_start=0.5, hint_reveal_step=0.25), chat)
    restored.load_state_dict(state)
    fresh = HintMaker(_generator("reference_prefix", hint_reveal_start=0.5, hint_reveal_step=0.25), chat)
    assert restored.make(named[1:]) != fresh.make(named[1:])
    assert restored.state_dict() == {"reveal": {"t": 1.0, "u": 0.0}}


def test_replay_states_come_from_failed_rollouts_of_hard_groups(episodes):
    from composer_mesh.mesh.outcomes import replay_rollouts

    groups, _ = episodes
    everything = [r for g in groups for r in g.rollouts]
    assert replay_rollouts(groups, None) == everything  # no bound: every rollout, as before the key
    hard = replay_rollouts(groups, 0.125)
    assert hard == groups[0].rollouts + groups[2].rollouts
    # a bound the one-in-three group meets: its unsolved rollouts join, its solved one does not
    assert replay_rollouts(groups, 0.5) == groups[0].rollouts + groups[1].rollouts[1:] + groups[2].rollouts
