"""No silent no-op runs: a dropped group says why, a step that trained nothing says why, and so does `train`.

Real demo episodes from the HF engine: with a context budget smaller than the
prompt the runner samples nothing and warns per request; the drop-reason
accounting tells such groups (`prompt_too_long`) from groups dynamic sampling
dropped (`equal_rewards`) and stale ones, and the run's summary names the key
to change. End to end, `composer-mesh train` with every prompt too long exits
non-zero with one line naming the reason and `trainer.max_seq_len`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from composer_mesh.actors.rollout import EpisodeRequest, SamplingParams
from composer_mesh.configs.sections.loss import PolicyLossConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runner_for(tiny_assets):
    """`runner_for(max_context_tokens)`: an EpisodeRunner of the tiny model on the demo task."""
    from transformers import AutoTokenizer

    from composer_mesh.actors.episodes import EpisodeRunner
    from composer_mesh.actors.hf_engine import HFEngine
    from composer_mesh.envs.demo import DemoEnv

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.dense_dir))
    engine = HFEngine(tiny_assets.dense_dir, [tok.eos_token_id])
    return lambda budget: EpisodeRunner(engine, tok, lambda split: DemoEnv(split=split), max_turns=2,
                                        max_context_tokens=budget)


def test_drop_reasons_name_long_prompts_equal_rewards_and_stale(runner_for, caplog):
    from composer_mesh.mesh.packing import Drops, drop_reasons, explain_drops, prompt_too_long, select_rollouts

    sampling = SamplingParams(max_new_tokens=8, seed=1)
    fitting = runner_for(200).run([EpisodeRequest(0, 11), EpisodeRequest(1, 12)], 4, sampling, 0)
    with caplog.at_level(logging.WARNING, logger="composer_mesh.actors.episodes"):
        long = runner_for(16).run([EpisodeRequest(2, 13)], 4, sampling, 0)
    # the runner says so as it happens, once per request, with its length and the key
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "request 2 (seed 13" in warnings[0] and "trainer.max_seq_len 16" in warnings[0]
    assert all(prompt_too_long(r) and r.completion_tokens == 0 for r in long[0].rollouts)
    assert not any(prompt_too_long(r) for g in fitting for r in g.rollouts)
    prompt_tokens = len(long[0].rollouts[0].token_ids)
    assert prompt_tokens + 8 > 16

    # group 0 distinct rewards (kept), group 1 all equal (dynamic sampling), group 2 sampled nothing
    for g, rewards in zip(fitting, ([0.0, 0.2, 0.6, 0.0], [0.4, 0.4, 0.4, 0.4])):
        for r, x in zip(g.rollouts, rewards):
            r.reward = x
    groups = fitting + long
    selection = select_rollouts(groups, PolicyLossConfig())
    drops = drop_reasons(groups, selection, stale=3)
    assert drops.counts == {"prompt_too_long": 1, "equal_rewards": 1, "stale": 3}
    assert drops.longest_prompt == prompt_tokens
    assert drops.metrics() == {"rollouts/dropped_reason/prompt_too_long": 1.0,
                               "rollouts/dropped_reason/equal_rewards": 1.0, "rollouts/dropped_reason/stale": 3.0,
                               "rollouts/dropped_prompt_tokens": float(prompt_tokens)}
    line = explain_drops(drops, 16, 8)
    # most groups first; each reason with its count and the key to change
    assert line.index("stale: 3 groups") < line.index("prompt_too_long: 1 group ")
    assert f"a prompt of up to {prompt_tokens} tokens + generator.max_new_tokens 8 exceeds trainer.max_seq_len 16" in line
    assert "raise trainer.max_seq_len" in line and "loss.policy.dynamic_sampling" in line
    assert "\n" not in line

    # without dynamic sampling the equal-reward group stays in the policy channel; the long group does not: it
    # sampled nothing, so a step of long prompts alone trains nothing (and a run of them exits non-zero)
    no_dynamic = select_rollouts(groups, PolicyLossConfig(dynamic_sampling=False))
    assert no_dynamic.in_policy == [True] * 8 + [False] * 4 and no_dynamic.dropped_groups == 1
    assert select_rollouts(long, PolicyLossConfig(dynamic_sampling=False)).policy_rollouts == 0
    kept_all = drop_reasons(groups, no_dynamic, stale=0)
    assert kept_all.counts == {"prompt_too_long": 1, "equal_rewards": 0, "stale": 0}
    assert kept_all.metrics() == {"rollouts/dropped_reason/prompt_too_long": 1.0,
                                  "rollouts/dropped_prompt_tokens": float(prompt_tokens)}

    # a run's total from its metrics rows; a fitting step adds no keys
    fit = drop_reasons(fitting[:1], select_rollouts(fitting[:1], PolicyLossConfig()), stale=0)
    assert fit.metrics() == {}
    total = Drops.total([drops.metrics(), fit.metrics(), kept_all.metrics()])
    assert total == Drops({"prompt_too_long": 2, "equal_rewards": 1, "stale": 3}, prompt_tokens)


def test_controller_config_names_the_budget():
    """The controller's warnings name generator.max_new_tokens beside trainer.max_seq_len."""
    from composer_mesh.configs.loader import load_config
    from composer_mesh.mesh.controller import ControllerConfig

    job = load_config("demo_cpu.toml", {"trainer.max_seq_len": 16})
    cfg = ControllerConfig.from_job(job, steps=1, weight_dir="", state_dir="", replay=False)
    assert (cfg.max_seq_len, cfg.max_new_tokens) == (16, 24)


def test_summary_of_a_run_that_trained_nothing():
    from composer_mesh.configs.schema import JobConfig
    from composer_mesh.mesh.api import StepRecord, trained_summary

    def record(step: int, metrics: dict[str, float]) -> StepRecord:
        return StepRecord(step, metrics, 0.0, [], 0, 2, 0.1)

    job = JobConfig()
    dropped = {"skipped": 1.0, "rollouts/dropped_reason/prompt_too_long": 2.0, "rollouts/dropped_prompt_tokens": 40.0}
    summary = trained_summary([record(0, dict(dropped)), record(0, dict(dropped))], job)
    assert summary["trained_steps"] == 0 and summary["dropped_groups"] == {"prompt_too_long": 4}
    assert summary["untrained"].startswith("none of the 2 steps trained")
    assert "prompt_too_long: 4 groups" in summary["untrained"] and "trainer.max_seq_len" in summary["untrained"]
    assert "a prompt of up to 40 tokens" in summary["untrained"]

    trained = trained_summary([record(0, dict(dropped)), record(1, {"rollouts/dropped_reason/equal_rewards": 1.0})], job)
    assert trained == {"trained_steps": 1, "dropped_groups": {"prompt_too_long": 2, "equal_rewards": 1}}
    # a resumed run with nothing left to do is not a failure
    assert trained_summary([], job) == {"trained_steps": 0, "dropped_groups": {}}


@pytest.mark.slow
def test_train_exits_nonzero_when_every_prompt_is_too_long(tmp_path, tiny_assets):
    cache = tiny_assets.root.parents[1]  # the suite's asset cache: no rebuild in the child
    env = dict(os.environ, HF_HUB_OFFLINE="1", COMPOSER_MESH_CACHE=str(cache))
    cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", "configs/demo_cpu.toml",
           "--trainer.steps=2", "--trainer.max_seq_len=16", f"--job.output_dir={tmp_path}",
           "--trainer.prompts_per_step=2", "--trainer.eval_every=0", "--checkpoint.enabled=false",
           # no teacher replay: fewer processes to start
           "--mesh.replay_procs=0", "--loss.beta=0"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 3, out.stderr[-4000:]
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("error: none of the 2 steps trained") and "prompt_too_long" in error, out.stderr[-4000:]
    assert "raise trainer.max_seq_len" in error and "exceeds trainer.max_seq_len 16" in error
    # as it happened: each step's warning
    assert out.stderr.count("trained nothing: prompt_too_long: 2 groups") == 2, out.stderr[-4000:]
    assert "step 1 trained nothing" in out.stderr and "step 2 trained nothing" in out.stderr
    assert out.stderr.count("exceeds the context budget trainer.max_seq_len 16; no tokens sampled") == 4
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps_run"] == 2 and summary["trained_steps"] == 0 and summary["final_step"] == 0
    assert summary["dropped_groups"] == {"prompt_too_long": 4}
    assert json.loads((Path(summary["run_dir"]) / "summary.json").read_text())["untrained"] == error[len("error: "):]
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollouts/dropped_reason/prompt_too_long"] for r in rows] == [2.0, 2.0]
    assert all(r["skipped"] == 1.0 and r["rollouts/completion_tokens"] == 0.0 for r in rows)


def _message(record: logging.LogRecord) -> str:
    """A record's message without the `[actor=...] ` prefixes Monarch's log filter adds once it is installed (by an
    earlier test in the same process), so the test reads the same in any order."""
    return re.sub(r"^(\[actor=[^\]]*\] )+", "", record.getMessage())


def test_a_switched_on_channel_that_gets_nothing_is_named(caplog):
    """`mesh.channels.ChannelWatch`: a warning at every step while an on channel has had nothing, then the
    summary's `silent_channels` naming it, its key and why; a channel that got something, or is off, is not."""
    from composer_mesh.configs.loader import load_config
    from composer_mesh.mesh.api import StepRecord
    from composer_mesh.mesh.channels import ChannelWatch

    job = load_config("coding_cpu.toml", {"loss.alpha": 0.25, "loss.beta": 0.25,
                                          "loss.distill.targets": "all_fail_groups"})
    nothing = {"distill/hinted_tokens": 0.0, "distill/targeted": 0.0, "distill/hinted": 0.0,
               "preference/pairs_in_batch": 0.0}
    history = [StepRecord(s, dict(nothing), 0.0, [], 0, 2, 0.1) for s in (1, 2)]
    watch = ChannelWatch(job, replay=True)
    with caplog.at_level(logging.WARNING, logger="composer_mesh.mesh.channels"):
        for record in history:
            watch.step(record)
    warnings = [_message(r) for r in caplog.records]
    assert warnings == [f"step {s}: {name} has got nothing in {s} step{'s' * (s > 1)} so far"
                        for s in (1, 2) for name in ("channel 2 (hint distillation) (loss.alpha = 0.25)",
                                                     "channel 3 (preference pairs) (loss.beta = 0.25)")]
    replay = {"states_done": 6, "outcomes": {"no_consensus": 6}, "pairs_made": 0,
              "teacher_refusals": {"a": {"unknown task: x": 6}, "b": {"unknown task: x": 6}},
              "client": {"failures": {"server_error": 2}}}
    summary = watch.summary(history, replay)
    silent = summary["silent_channels"]
    assert silent["distill"] == ("channel 2 (hint distillation) is on (loss.alpha = 0.25) but got nothing in 2 steps: "
                                 "loss.distill.targets = 'all_fail_groups' let no rollout through (no group failed "
                                 "every sample)")
    assert silent["preference"].startswith("channel 3 (preference pairs) is on (loss.beta = 0.25) but got nothing in "
                                           "2 steps: 6 failed turns replayed (outcomes: no_consensus 6); teachers "
                                           "could not answer: a: unknown task: x 6, b: unknown task: x 6; teacher calls "
                                           "failed: server_error 2; 0 pairs made")
    assert summary["channels"]["preference"] == {"on": True, "got": 0.0, "counts": "preference/pairs_in_batch"}

    # a channel that got something at a step stops warning and is not silent; an off one is named off
    caplog.clear()
    fed = ChannelWatch(job, replay=False)
    with caplog.at_level(logging.WARNING, logger="composer_mesh.mesh.channels"):
        fed.step(history[0])
        fed.step(StepRecord(2, {**nothing, "distill/hinted_tokens": 12.0}, 0.0, [], 0, 2, 0.1))
        fed.step(StepRecord(3, dict(nothing), 0.0, [], 0, 2, 0.1))
    assert [_message(r) for r in caplog.records] == [
        "step 1: channel 2 (hint distillation) (loss.alpha = 0.25) has got nothing in 1 step so far"]
    quiet = fed.summary(history, None)
    assert "silent_channels" not in quiet and quiet["channels"]["distill"]["got"] == 12.0
    assert quiet["channels"]["preference"]["off"] == "mesh.replay_procs = 0 starts no replay actor"
    # a resumed run with nothing left to do is not a failure
    assert "silent_channels" not in ChannelWatch(job, replay=True).summary([], replay)


@pytest.mark.slow
def test_train_exits_nonzero_when_a_switched_on_channel_gets_nothing(tmp_path, tiny_assets):
    """The acceptance run: the coding recipe (micro tasks, the tiny model, 2 steps) with channels 2 and 3 on, its
    teachers pointed at a teacher server for another run's tasks (SWE-style instances of a local git repository),
    so that every state it is asked about is a task it does not know. Channel 3 gets no pair: the run warns at each
    step, exits 3 naming the channel, its key and why (the teachers' refusals, counted by reason), no server
    error; channel 2, which got its hinted tokens, is not named."""
    import importlib.util

    from composer_mesh.configs.sections.env import CodingConfig, EnvConfig, SandboxConfig, SweConfig
    from composer_mesh.mesh.responders import build_responder
    from composer_mesh.replay.reference_teacher import UNKNOWN_TASK
    from composer_mesh.replay.server import TeacherServer

    spec = importlib.util.spec_from_file_location("swe_shapes", REPO / "tests" / "envs" / "swe_shapes.py")
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    row = shapes.make_instance(tmp_path / "repos")
    (tmp_path / "instances.jsonl").write_text(json.dumps(row) + "\n")
    other = EnvConfig(task="coding", coding=CodingConfig(sources=("swe",)), sandbox=SandboxConfig(root_dir=str(tmp_path)),
                      swe=SweConfig(instances=str(tmp_path / "instances.jsonl"), repos_dir=str(tmp_path / "repos"),
                                    runtime="local"))
    cache = tiny_assets.root.parents[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", COMPOSER_MESH_CACHE=str(cache))
    with TeacherServer(build_responder("coding", noise=0.0, env=other)) as server:
        cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", "configs/coding_cpu.toml",
               "--trainer.steps=2", f"--job.output_dir={tmp_path / 'runs'}", "--trainer.prompts_per_step=2",
               "--generator.group_size=2", "--generator.max_new_tokens=16", "--generator.max_turns=1",
               "--env.tool_loop.max_turns=1", "--env.tool_loop.warm_start_steps=0", "--trainer.eval_every=0",
               "--checkpoint.enabled=false", "--loss.alpha=0.25", "--loss.beta=0.25", "--replay.traces=[]",
               "--replay.local_server.enabled=false", f"--teachers.base_url={server.url}"]
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        served = list(server.log)
    assert out.returncode == 3, out.stderr[-4000:]
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("error: channel 3 (preference pairs) is on (loss.beta = 0.25) but got nothing in 2 steps"), \
        out.stderr[-4000:]
    assert "teachers could not answer: " in error and UNKNOWN_TASK in error and "teacher calls failed: none" in error
    assert "channel 2" not in error and out.stderr.count("error: ") == 1
    # as it happened: each step's warning
    assert "step 1: channel 3 (preference pairs) (loss.beta = 0.25) has got nothing in 1 step so far" in out.stderr
    assert "step 2: channel 3 (preference pairs) (loss.beta = 0.25) has got nothing in 2 steps so far" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["trained_steps"] == 2 and "untrained" not in summary
    assert set(summary["silent_channels"]) == {"preference"}
    assert summary["silent_channels"]["preference"] == error[len("error: "):]
    assert summary["channels"]["distill"]["got"] > 0
    refusals = summary["replay"]["teacher_refusals"]
    # the recipe's tier-0 teachers a and b every time, its tie-breaker c where they disagreed
    why = f"{UNKNOWN_TASK} (the first 1024 train tasks of seed 0 scanned)"
    assert set(refusals) >= {"a", "b"} and all(set(r) == {why} for r in refusals.values())
    assert refusals["a"] == refusals["b"] == {why: summary["replay"]["states_done"]}
    # every request the teachers got was answered: no server error, nothing retried
    assert served and all(r["outcome"] == "ok" and r["billed"] for r in served), {r["outcome"] for r in served}
    assert summary["replay"]["client"]["failures"] == {} and summary["replay"]["client"]["retries"] == 0
    assert json.loads((Path(summary["run_dir"]) / "summary.json").read_text())["silent_channels"] == \
        summary["silent_channels"]
