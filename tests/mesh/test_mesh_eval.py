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


class _Replies:
    """A policy that reads the note: with the hinted evaluation's note in its context it writes the task's reference
    edit, without it a wrong one, then closes (the engine's interface; the episodes, tool loop and grades are real)."""

    def __init__(self, tok, tasks) -> None:
        from composer_mesh.actors.episodes import ChatTokens

        self.tok, self.tasks, self.chat = tok, tasks, ChatTokens(tok)

    def generate(self, prompts, sampling):
        from composer_mesh.actors.hf_engine import Completion
        from composer_mesh.replay.reference_teacher import change_calls, near_miss

        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            task = next(t for t in self.tasks if t.stubbed_source in text)
            reference = task.reference_files()
            files = reference if "Here is a reference solution" in text else {p: near_miss(t) for p, t in reference.items()}
            (call,) = change_calls({task.target: task.stubbed_source}, files, "edit_file")
            turn = text.count("<|im_start|>assistant")
            reply = (f'<tool_call>\n{{"name": "edit_file", "arguments": {call["function"]["arguments"]}}}\n</tool_call>'
                     if turn == 1 else "Done.")
            tokens = self.chat.encode(reply) + [self.chat.end_id]
            out.append(Completion(tokens, [-0.5] * len(tokens), "stop"))
        return out


class _InProcess:
    """A generator actor's `generate` endpoint in this process (`mesh.evaluation` calls `gen.generate.call_one`);
    `calls` keeps each call's groups."""

    def __init__(self, runner, group_size: int) -> None:
        self.runner, self.group_size, self.generate, self.calls = runner, group_size, self, []

    def call_one(self, requests, sampling, group_size):
        groups = self.runner.run(list(requests), group_size or self.group_size, sampling, 0)
        self.calls.append(groups)
        return type("Done", (), {"get": lambda _: groups})()


def test_hinted_evaluation_puts_the_reference_note_before_the_first_reply(tiny_assets, tmp_path):
    """`EvalConfig.hinted` (`[trainer] eval_hinted`): the sampled set again, each episode with the task's reference
    as a user message after its prompt (`EpisodeRequest.hinted`, `Environment.add_note`); a policy that reads it
    passes every hinted episode and none without it: hint_gap 1, all-fail share 1 -> 0, pass@k 0."""
    from transformers import AutoTokenizer

    from composer_mesh.actors.episodes import EpisodeRunner
    from composer_mesh.actors.rollout import SamplingParams
    from composer_mesh.configs.sections.env import CodingConfig, SandboxConfig, ToolLoopConfig
    from composer_mesh.envs.coding import render_reference
    from composer_mesh.envs.micro import MicroTasks
    from composer_mesh.envs.sandbox import Sandbox
    from composer_mesh.envs.tool_loop import ToolLoopEnv
    from composer_mesh.mesh.evaluation import EvalConfig, evaluate
    from composer_mesh.replay.hints import reference_note

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.tokenizer_dir))
    sandbox = Sandbox(SandboxConfig(root_dir=str(tmp_path), wall_timeout_s=90.0))
    pool = MicroTasks(CodingConfig(), "heldout")
    loop = ToolLoopConfig(tools=("edit_file",), max_turns=3)
    runner = EpisodeRunner(_Replies(tok, [pool.pick(s) for s in range(3)]), tok,
                           lambda split: ToolLoopEnv(pool, sandbox, loop), max_turns=3, max_context_tokens=4096)
    gen = _InProcess(runner, 2)
    metrics = evaluate([gen], EvalConfig(samples=3, sampling=SamplingParams(max_new_tokens=256), hinted=True))
    assert metrics["eval/heldout_sampled_pass"] == 0.0 and metrics["eval/heldout_hinted_sampled_pass"] == 1.0
    assert metrics["eval/heldout_hint_gap"] == 1.0
    assert metrics["eval/heldout_all_fail_share"] == 1.0 and metrics["eval/heldout_pass_at_k"] == 0.0
    assert metrics["eval/heldout_hinted_all_fail_share"] == 0.0
    greedy, sampled, hinted = gen.calls
    for plain, noted in zip(sampled, hinted):
        for a, b in zip(plain.rollouts, noted.rollouts):
            task = pool.pick(a.seed)
            note = {"role": "user", "content": reference_note(render_reference(task.reference_files()))}
            assert b.messages[:2] == a.messages[:2] and b.messages[2] == note and note not in a.messages
            assert b.messages[3]["role"] == "assistant" and b.turn_spans[0][0] == 3
    # off by default: no hinted pass, no hint gap
    assert "eval/heldout_hint_gap" not in evaluate([_InProcess(runner, 2)], EvalConfig(samples=1))


def test_a_note_goes_before_the_first_reply_and_hinted_evaluation_needs_a_coding_task(tmp_path):
    from composer_mesh.configs.loader import ConfigError, load_config
    from composer_mesh.configs.sections.env import CodingConfig, SandboxConfig
    from composer_mesh.envs.base import assistant
    from composer_mesh.envs.micro import MicroTasks
    from composer_mesh.envs.sandbox import Sandbox
    from composer_mesh.envs.tool_loop import ToolLoopEnv

    env = ToolLoopEnv(MicroTasks(CodingConfig(), "train"), Sandbox(SandboxConfig(root_dir=str(tmp_path))))
    with pytest.raises(RuntimeError, match="after reset"):
        env.add_note("early")
    env.reset(seed=0)
    env.add_note("a note")
    assert env.state.messages[-1] == {"role": "user", "content": "a note"}
    env.step(assistant("Done."))
    with pytest.raises(RuntimeError, match="before the first step"):
        env.add_note("late")
    env.close()
    with pytest.raises(ConfigError, match="trainer.eval_hinted needs a coding task"):
        load_config(REPO / "configs" / "demo_cpu.toml", ["--trainer.eval_hinted=true"])
    hard = load_config(REPO / "configs" / "coding_hard_cpu.toml")
    assert hard.trainer.eval_hinted
    # the run's evaluation samples hinted when the recipe asks
    from composer_mesh.mesh.controller import ControllerConfig

    assert ControllerConfig.from_job(hard, steps=1, weight_dir="", state_dir="", replay=False).eval.hinted
    demo = load_config(REPO / "configs" / "demo_cpu.toml")
    assert not ControllerConfig.from_job(demo, steps=1, weight_dir="", state_dir="", replay=False).eval.hinted
