"""Held-out evaluation in `composer-mesh train` (mesh.evaluation): logged, and invisible to training.

Two shortened demo_cpu runs from the same seed, one with `trainer.eval_every = 1`
and one with evaluation off, must train bitwise the same: every logged training
metric (losses, grad norm, rewards, token counts) and the replay actor's status
equal, the final checkpoints' weights equal. The run with evaluation logs
greedy and sampled held-out reward at every step (metrics.jsonl, TensorBoard,
plot), and its summary holds the before/after pair. The evaluation set is on
the held-out split and disjoint from the training problems.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_mesh_train import RECIPE, REPO, train

STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_assets):
    """summary per eval_every in (1, 0): the same recipe and seed, checkpoint after the last step."""
    out = {}
    for every in (1, 0):
        tmp = tmp_path_factory.mktemp(f"eval{every}")
        recipe = tmp / "demo.toml"
        text = RECIPE.format(repo=REPO, out=tmp / "runs").replace("[trainer]\n", f"[trainer]\neval_every = {every}\n")
        recipe.write_text(text.replace("every_steps = 2", f"every_steps = {STEPS}"))
        out[every] = train(recipe, STEPS, tiny_assets.root.parents[1])
    return out


def _rows(summary: dict) -> list[dict]:
    return [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]


def _trained(row: dict) -> dict:
    """A row's training figures: without evaluation and wall-clock times."""
    return {k: v for k, v in row.items() if not k.startswith(("eval/", "time/")) and k != "seconds"}


@pytest.mark.slow
def test_eval_does_not_change_training(runs):
    on, off = _rows(runs[1]), _rows(runs[0])
    assert [r["step"] for r in on] == [r["step"] for r in off] == list(range(1, STEPS + 1))
    for a, b in zip(on, off):
        assert not any(k.startswith("eval/") for k in b)
        assert _trained(a) == _trained(b)  # bitwise: floats compared exactly
    assert runs[1]["replay"] == runs[0]["replay"]  # no evaluation rollout reached the teachers
    ckpts = [Path(runs[every]["run_dir"]) / "checkpoints" / f"step-{STEPS:08d}" for every in (1, 0)]
    shards = [sorted(c.glob("*.distcp")) for c in ckpts]  # weights and optimizer state (torch.distributed.checkpoint)
    assert shards[0] and [p.name for p in shards[0]] == [p.name for p in shards[1]]
    assert [p.read_bytes() for p in shards[0]] == [p.read_bytes() for p in shards[1]]
    # step and schedule; not "rng": the trainer process's global torch RNG is never seeded nor drawn by a train
    # step (it differs between any two runs), and the evaluation runs in the generator's process anyway
    extras = [torch.load(c / "trainer_rank0.pt", weights_only=False) for c in ckpts]
    _assert_same(extras[0]["state"], extras[1]["state"])
    assert extras[0]["step"] == extras[1]["step"] == STEPS


def _assert_same(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.slow
def test_eval_is_logged_everywhere(runs):
    summary = runs[1]
    rows = _rows(summary)
    for r in rows:
        for k in ("eval/heldout_greedy", "eval/heldout_sampled", "eval/heldout_sampled_solved"):
            assert 0.0 <= r[k] <= 1.0, (k, r)
        assert r["eval/policy_version"] == r["step"]  # sync mode: the weights just trained
    before, after = summary["heldout"]["before"], summary["heldout"]["after"]
    assert before["step"] == 0 and after["step"] == STEPS
    assert after["eval/heldout_greedy"] == rows[-1]["eval/heldout_greedy"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(summary["run_dir"]) / "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("eval/heldout_greedy")]
    assert sorted(steps) == list(range(0, STEPS + 1))
    assert Path(summary["plot"]).stat().st_size > 0
    # the plot's held-out curves start at the step-0 baseline and end at the last evaluation
    heldout = json.loads(Path(summary["plot"]).with_suffix(".json").read_text())[1]
    for label in ("greedy", "sampled"):
        points = heldout["series"][label]
        assert points[0] == [0, before[f"eval/heldout_{label}"]] and points[-1] == [STEPS, after[f"eval/heldout_{label}"]]
        assert [p[0] for p in points] == list(range(0, STEPS + 1))


def test_eval_set_is_heldout_and_disjoint_from_training():
    from composer_mesh.configs.sections.env import DemoTaskConfig
    from composer_mesh.envs.demo import make_problem, split_of
    from composer_mesh.mesh.evaluation import heldout_requests

    for cfg in (DemoTaskConfig(), DemoTaskConfig(max_operand=4), DemoTaskConfig(ops=("add", "reverse"))):
        requests = heldout_requests(16)
        assert all(r.split == "heldout" and r.group_id < 0 for r in requests)
        evaluated = {make_problem(r.seed, cfg, r.split).text for r in requests}
        trained = {make_problem(s * 1_000_003 + i, cfg).text for s in range(3) for i in range(200)}
        assert evaluated and not evaluated & trained
        assert all(split_of(make_problem(r.seed, cfg, r.split), cfg) == "heldout" for r in requests)


def test_validation_evaluation_draws_the_validation_split_through_the_env_factory():
    """`[trainer] eval_split = "validation"`: the requests name the split and the run's environment factory
    serves its problems, disjoint from both the problems trained on and the held-out ones."""
    from composer_mesh.configs.loader import load_config
    from composer_mesh.envs.demo import split_of
    from composer_mesh.envs.factory import env_factory
    from composer_mesh.mesh.evaluation import heldout_requests

    job = load_config(REPO / "configs" / "demo_cpu.toml",
                      ["--trainer.eval_split=validation", "--env.demo.validation_fraction=0.2"])
    make = env_factory(job.env)
    requests = heldout_requests(16, job.trainer.eval_split)
    assert all(r.split == "validation" and r.group_id < 0 for r in requests)

    def problems(split: str, seeds: range) -> set:
        out = set()
        for seed in seeds:
            env = make(split)
            env.reset(seed)
            out.add(env.problem)
        return out

    validation = problems("validation", range(16))
    trained, held = problems("train", range(400)), problems("heldout", range(400))
    assert validation and validation.isdisjoint(trained) and validation.isdisjoint(held)
    assert all(split_of(p, job.env.demo) == "validation" for p in validation)
