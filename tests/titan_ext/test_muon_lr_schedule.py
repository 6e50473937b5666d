"""`[optimizer]` warmup / decay knobs: the LR each optimizer step runs at, against numbers worked out by hand.

The section docs promise: warmup step s runs at lr·(s + 1) / warmup_steps;
decay_ratio = 0 keeps the LR constant after warmup; decay_ratio = none decays
right after warmup (one more step at lr first); the decay ends at min_lr_factor
after the last step. The expected lists below are those rules evaluated by
hand, not TorchTitan's formula re-typed.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from composer_mesh.configs.sections.optimizer import OptimizerConfig
from composer_mesh.titan_ext.optimizer import build_lr_scheduler, build_optimizer


def _lrs(cfg: OptimizerConfig, steps: int, run: int | None = None) -> list[float]:
    """The LR of each of `run` (default `steps`) optimizer steps of a `steps`-step schedule, read before the
    step as the trainer runs them."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, cfg, training_steps=steps)
    lrs = []
    for _ in range(run or steps):
        lrs.append(opt.param_groups[0]["lr"])
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return lrs


CASES = {
    # 5 steps, 2 warmup, decay none: 1/2, 2/2, one more at lr, then linear over the 3
    # remaining "decay steps" (the third one would be after the run): 2/3, 1/3.
    "warmup2_none_linear": (dict(warmup_steps=2), 5, [0.5, 1.0, 1.0, 2 / 3, 1 / 3]),
    # decay_ratio = 0: constant after warmup.
    "warmup2_zero": (dict(warmup_steps=2, decay_ratio=0.0), 5, [0.5, 1.0, 1.0, 1.0, 1.0]),
    # 4 warmup steps start at lr/4, not lr/5.
    "warmup4_zero": (dict(warmup_steps=4, decay_ratio=0.0), 6, [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]),
    # No warmup, decay none over 4 steps: step 0 at lr, then 3/4, 2/4, 1/4 (0 after the run).
    "nowarmup_none": (dict(), 4, [1.0, 0.75, 0.5, 0.25]),
    # 10 steps, 2 warmup, last 40% (4 steps) cosine down to 0.1: at lr through step 6, then
    # progress 1/4, 2/4, 3/4 -> 0.1 + 0.9 * (1 + cos(pi * p)) / 2.
    "wsd_cosine_min": (
        dict(warmup_steps=2, decay_ratio=0.4, decay_type="cosine", min_lr_factor=0.1), 10,
        [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
         0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * (1 - math.sqrt(0.5)) / 2],
    ),
    # sqrt decay: 1 - sqrt(progress), 8 steps, last 50% (4 steps), no warmup.
    "wsd_sqrt": (dict(decay_ratio=0.5, decay_type="sqrt"), 8,
                 [1.0, 1.0, 1.0, 1.0, 1.0, 1 - math.sqrt(0.25), 1 - math.sqrt(0.5), 1 - math.sqrt(0.75)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lr_per_step_matches_the_documented_schedule(name):
    knobs, steps, factors = CASES[name]
    cfg = OptimizerConfig(name="adamw", lr=0.02, **knobs)
    assert _lrs(cfg, steps) == pytest.approx([0.02 * f for f in factors], rel=1e-12, abs=0)


def test_decay_none_is_not_constant_and_zero_is():
    """The two settings the docs distinguish really differ (the knob once claimed none = constant)."""
    none = _lrs(OptimizerConfig(name="adamw", lr=1.0, warmup_steps=1), 6)
    zero = _lrs(OptimizerConfig(name="adamw", lr=1.0, warmup_steps=1, decay_ratio=0.0), 6)
    assert zero == [1.0] * 6
    assert none[:2] == [1.0, 1.0] and all(a > b for a, b in zip(none[1:], none[2:]))


@pytest.mark.parametrize("name", ["nowarmup_none", "wsd_cosine_min", "warmup2_none_linear"])
def test_past_the_last_step_the_lr_holds_its_floor(name):
    """An optimizer stepped beyond `trainer.steps` (an actor driven directly, a longer loop) stays at
    min_lr_factor; TorchTitan's linear decay alone went negative there (1 - progress), ascending the gradient."""
    knobs, steps, factors = CASES[name]
    cfg = OptimizerConfig(name="adamw", lr=0.02, **knobs)
    floor = knobs.get("min_lr_factor", 0.0)
    assert _lrs(cfg, steps, run=steps + 4) == pytest.approx([0.02 * f for f in factors] + [0.02 * floor] * 4,
                                                            rel=1e-12, abs=0)


def test_schedule_state_round_trips_through_a_checkpoint():
    """The scheduler a resumed trainer builds continues the schedule where the saved one stopped."""
    cfg = OptimizerConfig(name="adamw", lr=1.0, warmup_steps=2, decay_ratio=0.5)
    model = nn.Linear(4, 4)
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, cfg, training_steps=8)
    for _ in range(5):
        opt.step()
        sched.step()
    resumed_opt = build_optimizer(nn.Linear(4, 4), cfg)
    resumed = build_lr_scheduler(resumed_opt, cfg, training_steps=8)
    resumed_opt.load_state_dict(opt.state_dict())  # a checkpoint holds both (the param groups' current lr)
    resumed.load_state_dict(sched.state_dict())
    lrs = []
    for _ in range(5):
        lrs.append(resumed_opt.param_groups[0]["lr"])
        resumed_opt.step()
        resumed.step()
    assert lrs == pytest.approx(_lrs(cfg, 8, run=10)[5:], rel=1e-12, abs=0)
