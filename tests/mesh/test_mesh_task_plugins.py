"""Task plugins end to end: `composer-mesh train` from a TOML file only, with user code on `[job] python_path`.

1. A JSONL prompt dataset (standard format, extra columns) and two TRL-style reward
   functions with weights: the generator process calls them with TRL's keywords,
   in file order, and the step's reward mean is their weighted sum.
2. A multi-turn plugin environment (`[env] task = "plugin"`, kwargs table): episodes
   take several turns and training runs.

The user modules live in a temporary folder that is *not* on the test's PYTHONPATH:
only `job.python_path` makes them importable in the actor processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

COMMON = """
base = "{repo}/configs/demo_cpu.toml"

[job]
output_dir = "{out}"
python_path = ["{plugins}"]

[trainer]
prompts_per_step = 2
mode = "sync"
eval_every = 0  # training only: the rewards' call log and the env's splits are asserted (tests/mesh/test_mesh_eval.py)

[generator]
group_size = 4
max_new_tokens = 6
max_turns = {max_turns}

[checkpoint]
enabled = false

[mesh]
replay_procs = 0

[loss]
# these environments report no failure sites, so channel 2 would get nothing (and the run exit 3: mesh.channels)
alpha = 0.0
"""

REWARDS = '''
import json, os
from pathlib import Path

LOG = Path(__file__).with_name("calls.jsonl")

def exact(completions, prompts, answer, **kwargs):
    """TRL standard format: strings in, one float per completion."""
    with LOG.open("a") as f:
        for p, c, a in zip(prompts, completions, answer):
            f.write(json.dumps({"pid": os.getpid(), "prompt": p, "completion": c, "answer": a,
                                "keys": sorted(kwargs)}) + "\\n")
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

def length(completions, **kwargs):
    """None for empty completions (skipped by the weighted sum), else a score that differs within a group."""
    return [None if not c else len(c) % 10 / 10 for c in completions]
'''

ENV_PLUGIN = '''
import json, os
from pathlib import Path

from composer_mesh.envs.base import Environment, Observation

LOG = Path(__file__).with_name("episodes.jsonl")

class Guess(Environment):
    """Guess a digit; after a wrong guess the env says higher/lower; reward falls with distance
    (no digit: a small reward by reply length, so that a group's rewards differ)."""

    def __init__(self, split, max_guesses, target_offset):
        super().__init__()
        self.split, self.max_guesses, self.offset = split, max_guesses, target_offset

    def _start(self, seed):
        self.target, self.guesses = (seed + self.offset) % 10, 0
        return Observation([{"role": "user", "content": "Guess my digit 0-9."}])

    def _answer(self, action, turn):
        self.guesses += 1
        digits = [ch for ch in action["content"] if ch.isdigit()]
        guess = int(digits[0]) if digits else -10
        reward = max(0.0, 1.0 - abs(guess - self.target) / 10) if digits else len(action["content"]) % 5 / 10
        done = guess == self.target or self.guesses >= self.max_guesses
        if done:
            with LOG.open("a") as f:
                f.write(json.dumps({"pid": os.getpid(), "split": self.split, "guesses": self.guesses}) + "\\n")
        hint = [] if done else [{"role": "user", "content": "higher" if guess < self.target else "lower"}]
        return Observation(hint, reward=reward, done=done)

def make_env(split, **kwargs):
    return Guess(split, **kwargs)
'''


def _train(tmp_path: Path, name: str, extra: str, max_turns: int, cache: Path) -> tuple[dict, Path]:
    recipe = tmp_path / f"{name}.toml"
    plugins = tmp_path / "plugins"
    recipe.write_text(COMMON.format(repo=REPO, out=tmp_path / "runs", plugins=plugins, max_turns=max_turns) + extra)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", COMPOSER_MESH_CACHE=str(cache))
    cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", str(recipe), "--trainer.steps=2",
           f"--job.name={name}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


@pytest.mark.slow
def test_jsonl_dataset_and_trl_rewards_train_from_toml(tmp_path, tiny_assets):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "my_rewards.py").write_text(REWARDS)
    data = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"Say {w}.", "answer": w, "level": i} for i, w in enumerate(["cat", "dog", "sun", "sky", "red"] * 2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    extra = textwrap.dedent(f"""
        [env]
        task = "dataset"

        [env.dataset]
        train_file = "{data}"
        rewards = ["my_rewards:exact", "my_rewards:length"]
        reward_weights = [1.0, 0.5]
        """)
    summary, rows = _train(tmp_path, "dataset", extra, 1, tiny_assets.root.parents[1])
    assert summary["steps_run"] == 2
    calls = [json.loads(line) for line in (plugins / "calls.jsonl").read_text().splitlines()]
    assert {c["pid"] for c in calls}.isdisjoint({os.getpid()})  # called in the generator, not here
    assert all(c["keys"] == ["level"] for c in calls)  # every column but the prompt, by its name
    # sequential order, job.seed = 0: group i is row i; 2 steps x 2 prompts x 4 samples
    per_step = [sorted(c["prompt"] for c in calls[i:i + 8]) for i in (0, 8)]
    assert per_step == [sorted(r["prompt"] for r in lines[i:i + 2] for _ in range(4)) for i in (0, 2)]
    expected = [(1.0 if c["answer"] in c["completion"] else 0.0)
                + (0.5 * (len(c["completion"]) % 10 / 10) if c["completion"] else 0.0) for c in calls]
    means = [sum(expected[i:i + 8]) / 8 for i in (0, 8)]  # TRL: weighted sum, None skipped
    got = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(got) == 2 and all(abs(g - m) < 1e-6 for g, m in zip(got, means)), (got, means)


@pytest.mark.slow
def test_multi_turn_plugin_env_trains_from_toml(tmp_path, tiny_assets):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "guess_env.py").write_text(ENV_PLUGIN)
    extra = textwrap.dedent("""
        [env]
        task = "plugin"

        [env.plugin]
        entry_point = "guess_env:make_env"
        kwargs = { max_guesses = 3, target_offset = 7 }
        """)
    summary, rows = _train(tmp_path, "plugin", extra, 3, tiny_assets.root.parents[1])
    assert summary["steps_run"] == 2 and summary["final_step"] >= 1
    episodes = [json.loads(line) for line in (plugins / "episodes.jsonl").read_text().splitlines()]
    assert {e["pid"] for e in episodes}.isdisjoint({os.getpid()})  # the env ran in the generator process
    assert {e["split"] for e in episodes} == {"train"} and len(episodes) >= 16
    assert max(e["guesses"] for e in episodes) > 1  # feedback turns happened
    assert any("loss" in r for r in rows)


@pytest.mark.slow
def test_actor_failure_prints_one_line(tmp_path, tiny_assets):
    """A reward function raising inside the generator: exit 1, one `error:` line naming the actor and the
    function, no traceback (the controller's checks pass: rewards are only called in the generator)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "bad_rewards.py").write_text("def explode(completions, **kwargs):\n    raise KeyError('no_such_column')\n")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    recipe = tmp_path / "bad.toml"
    recipe.write_text(COMMON.format(repo=REPO, out=tmp_path / "runs", plugins=plugins, max_turns=1) + textwrap.dedent(f"""
        [env]
        task = "dataset"

        [env.dataset]
        train_file = "{data}"
        rewards = ["bad_rewards:explode"]
        """))
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", COMPOSER_MESH_CACHE=str(tiny_assets.root.parents[1]))
    cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", str(recipe), "--trainer.steps=1"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: generator actor: EnvironmentFault: reward function 'bad_rewards:explode' raised KeyError"), last
    assert "(at envs/dataset.py:" in last
    assert "Traceback" not in out.stderr.split("error: generator actor")[-1]


def test_heldout_evaluation_without_heldout_rows_is_refused(tmp_path):
    """`eval_every > 0` on a dataset with neither heldout_file nor heldout_fraction would score training rows as
    held-out: the loader refuses the recipe (so `config show` does too), naming the keys; and eval with DiLoCo."""
    from composer_mesh.configs.loader import ConfigError, load_config
    from composer_mesh.mesh.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}.", "answer": w}) + "\n" for w in ("cat", "dog", "sun")))
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "my_rewards.py").write_text(REWARDS)
    recipe = tmp_path / "r.toml"
    recipe.write_text(COMMON.format(repo=REPO, out=tmp_path / "runs", plugins=tmp_path / "plugins", max_turns=1)
                      + f'\n[env]\ntask = "dataset"\n\n[env.dataset]\ntrain_file = "{data}"\n'
                        'rewards = ["my_rewards:exact"]\n')
    with pytest.raises(ConfigError, match=r"eval_every > 0 needs held-out rows.*env\.dataset\.heldout_file"):
        load_config(recipe, ["--trainer.eval_every=5"])
    assert main(["train", str(recipe), "--trainer.eval_every=5"]) == 2
    assert not (tmp_path / "runs").exists()  # refused before the run directory or any actor
    assert load_config(recipe, ["--trainer.eval_every=5", "--env.dataset.heldout_fraction=0.34"]).trainer.eval_every == 5
    with pytest.raises(ConfigError, match=r"eval_every > 0 is not supported with diloco\.enabled"):
        load_config(REPO / "configs" / "diloco_cpu.toml", ["--trainer.eval_every=5"])
