"""Every shipped recipe (`configs/*.toml`) trains one step on CPU through `composer-mesh train`.

The recipes are discovered, so a new one is covered without editing this file.
Each runs in this process through the CLI's `train` command (the real launch
path: recipe + overrides -> `mesh.api.Run` -> local process meshes) with the
overrides a CPU box needs, derived from the recipe itself (`cpu_overrides`):
only keys that name GPUs, model weights, clusters or a user's data change —
a tiny model of the recipe's kind (dense or MoE), the HF engine, a local mesh
of one process per role, the fixture repository, SWE instances and Claude
Code trace in place of the user's paths, teachers on the loopback teacher
server — and the sizes shrink to one short step (a recipe training the policy
channel alone keeps its equal-reward groups, or one short step trains nothing).
Everything else is the recipe as shipped, so a key that rots (renamed, removed,
refused, or a combination the loop no longer runs) fails here, naming the recipe.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from composer_mesh.configs.loader import list_recipes, load_config
from composer_mesh.configs.schema import JobConfig
from composer_mesh.mesh.cli import main

REPO = Path(__file__).resolve().parents[2]
# a vendored repository with a passing pytest suite (feature-deletion tasks)
FIXTURE_REPO = REPO / "tests" / "envs" / "fixtures" / "minicalc"
# a frozen Claude Code session (trace replay, channel 3)
FIXTURE_TRACE = REPO / "tests" / "replay" / "fixtures" / "claude_session.jsonl"
# the hidden test of the SWE instance (minicalc's `^` multiplies at the base commit)
POWER_TEST = "from minicalc import evaluate\n\n\ndef test_power():\n    assert evaluate(\"2 ^ 3\") == 8.0\n"
# per channel, the metric counting what it trains on in a step (hinted rollouts: at least one failure site each)
MATERIAL = {"policy": "rollouts/policy", "distill": "distill/hinted", "preference": "preference/pairs_in_batch"}
# the tiny model's context (titan_ext.tiny.TINY_MAX_SEQ_LEN): a recipe's longer sequences are cut to it
TINY_CONTEXT = 4096


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def swe_fixture(root: Path) -> Path:
    """instances.jsonl with one SWE-Gym row over a git copy of minicalc (under root/repos) whose `^` multiplies:
    the gold patch restores `**`, the test_patch adds the hidden test, PASS_TO_PASS keeps a visible test."""
    repo = root / "repos" / "acme__minicalc"
    shutil.copytree(FIXTURE_REPO, repo)
    source = repo / "minicalc" / "evaluate.py"
    fixed = source.read_text()
    source.write_text(fixed.replace("return lhs**rhs", "return lhs * rhs"))
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    source.write_text(fixed)
    (repo / "tests" / "test_power.py").write_text(POWER_TEST)
    _git(repo, "add", "-N", "tests/test_power.py")
    patch, test_patch = _git(repo, "diff", "--", "minicalc"), _git(repo, "diff", "--", "tests")
    # back to the base commit (the intent-to-add hidden test goes too)
    _git(repo, "reset", "-q", "--hard")
    row = {"instance_id": "acme__minicalc-1", "repo": "acme/minicalc", "base_commit": base, "patch": patch,
           "test_patch": test_patch, "problem_statement": "evaluate('2 ^ 3') returns 6.0; `^` must be the power.",
           "FAIL_TO_PASS": ["tests/test_power.py::test_power"], "PASS_TO_PASS": ["tests/test_evaluate.py::test_variables"],
           "docker_image": "localhost/composer-mesh-swe:bookworm"}
    path = root / "instances.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def swe_instances(tmp_path_factory) -> Path:
    return swe_fixture(tmp_path_factory.mktemp("swe"))


def _tiny_model(job: JobConfig, cache: Path) -> dict[str, Any]:
    """A recipe's named model or weights -> the tiny flavour of the same kind (MoE when it shards experts)."""
    model = job.model
    overrides: dict[str, Any] = {"model.assets_cache_dir": str(cache)}
    if model.registry_flavour() not in ("tiny", "tiny_moe"):
        overrides.update({"model.flavour": "tiny_moe" if job.parallelism.ep > 1 else "tiny", "model.hf_path": "",
                          "model.tokenizer_path": ""})
    if model.device == "cuda":
        overrides["model.device"] = "cpu"
    if model.attention in ("flex", "varlen"):
        # both are CUDA kernels; auto = masked SDPA on CPU
        overrides["model.attention"] = "auto"
    return overrides


def _local_mesh(job: JobConfig) -> dict[str, Any]:
    """A cluster recipe -> one host of local processes, one per role; GPU sharding degrees -> 1."""
    mesh, par = job.mesh, job.parallelism
    overrides: dict[str, Any] = {}
    if mesh.backend != "local":
        overrides.update({"mesh.backend": "local", "mesh.hosts": 1})
    for key in ("trainer_procs", "generator_procs"):
        if getattr(mesh, key) > 1:
            overrides[f"mesh.{key}"] = 1
    if mesh.replay_procs > 1:
        overrides["mesh.replay_procs"] = 1
    if par.dp_replicate != 1:
        overrides["parallelism.dp_replicate"] = 1
    if par.dp_shard not in (1, -1):
        overrides["parallelism.dp_shard"] = -1
    if par.ep > 1:
        overrides["parallelism.ep"] = 1
    if job.generator.engine != "hf":
        overrides["generator.engine"] = "hf"
    if job.generator.tensor_parallel_size > 1:
        overrides["generator.tensor_parallel_size"] = 1
    return overrides


def live_channels(job: JobConfig) -> dict[str, bool]:
    """Per channel, whether `job` trains it (channel 3 also needs a replay actor)."""
    return {"policy": job.loss.policy_weight > 0, "distill": job.loss.alpha > 0,
            "preference": job.loss.beta > 0 and job.mesh.replay_procs > 0}


def _one_short_step(job: JobConfig) -> dict[str, Any]:
    """One step of two prompts (one per DiLoCo group at least), groups of two, short turns, a short warm start."""
    trainer, gen = job.trainer, job.generator
    prompts = max(min(trainer.prompts_per_step, 2), job.diloco.replica_groups if job.diloco.enabled else 1)
    overrides: dict[str, Any] = {
        "trainer.steps": 1, "trainer.prompts_per_step": prompts, "trainer.microbatches": 1,
        "trainer.max_seq_len": min(trainer.max_seq_len, TINY_CONTEXT),
        "generator.group_size": min(gen.group_size, 2), "generator.max_new_tokens": min(gen.max_new_tokens, 16),
        "generator.max_turns": min(gen.max_turns, 2),
        "env.tool_loop.max_turns": min(job.env.tool_loop.max_turns, 2), "metrics.rollouts_every": 1,
    }
    if trainer.eval_every > 0:
        overrides["trainer.eval_samples"] = min(trainer.eval_samples, 2)
    # the policy channel alone (the main job): one short step of a briefly warm-started base gives every group one
    # reward (truncated edits score 0), which DAPO's dynamic sampling drops, so nothing would reach the trainer (exit
    # 3, "no step trained"); kept, such groups train with advantage 0 and the trainer's whole step runs
    live = live_channels(job)
    if not (live["distill"] or live["preference"]) and job.loss.policy.dynamic_sampling:
        overrides["loss.policy.dynamic_sampling"] = False
    # the warm start's path runs; its length is the recipe's learning, not what this test checks
    if job.env.tool_loop.warm_start_steps > 0:
        overrides["env.tool_loop.warm_start_steps"] = min(job.env.tool_loop.warm_start_steps, 8)
    return overrides


def _missing(paths: Any) -> bool:
    """Some of a recipe's data paths (relative ones from the repository root) are not on this box: placeholders
    a user edits, which the suite's fixtures stand in for; data shipped with the repository stays."""
    return any(not (REPO / p).exists() for p in ([paths] if isinstance(paths, str) else paths) if p)


def _fixture_data(job: JobConfig, swe_instances: Path) -> dict[str, Any]:
    """A user's data paths -> the suite's fixtures (repository, SWE instance, trace), few tasks; SWE rows
    run in the local sandbox instead of their container images."""
    overrides: dict[str, Any] = {}
    fd, swe = job.env.feature_deletion, job.env.swe
    if _missing(fd.repos):
        overrides.update({"env.feature_deletion.repos": [str(FIXTURE_REPO)],
                          "env.feature_deletion.max_tasks": min(fd.max_tasks, 2)})
    if _missing(swe.instances) or _missing(swe.repos_dir):
        overrides.update({"env.swe.instances": str(swe_instances), "env.swe.repos_dir": str(swe_instances.parent / "repos")})
    if swe.instances and swe.runtime != "local":
        overrides["env.swe.runtime"] = "local"
    if _missing(job.env.sandbox.root_dir):
        overrides["env.sandbox.root_dir"] = ""
    if _missing(job.replay.traces):
        overrides["replay.traces"] = [str(FIXTURE_TRACE)]
    return overrides


def _loopback_teachers(job: JobConfig) -> dict[str, Any]:
    """Channel 3 against remote teachers -> the same teachers (names, tiers, prices) on the local server."""
    if not (job.loss.beta > 0 and job.mesh.replay_procs > 0) or job.replay.local_server.enabled:
        return {}
    models = [dataclasses.asdict(dataclasses.replace(t, base_url="", api_key_env="")) for t in job.teachers.models]
    return {"replay.local_server.enabled": True, "replay.local_server.responder": "consensus",
            "teachers.api_key_env": "", "teachers.models": models}


def cpu_overrides(job: JobConfig, out: Path, cache: Path, swe_instances: Path) -> dict[str, Any]:
    """The dotted keys a CPU box changes in `job` (derived from the recipe), for one short step under `out`."""
    return {"job.output_dir": str(out), **_tiny_model(job, cache), **_local_mesh(job), **_one_short_step(job),
            **_fixture_data(job, swe_instances), **_loopback_teachers(job)}


def toml_literal(value: Any) -> str:
    """`value` as the TOML literal a `--section.key=value` override takes (inline arrays and tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if value is None:
        return '"none"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML literal for {type(value).__name__}")


def train_one_step(recipe: str, overrides: dict[str, Any], capsys) -> dict[str, Any]:
    """`composer-mesh train --no-resume --no-progress configs/<recipe> --k=v ...` here; its summary."""
    items = [f"--{key}={toml_literal(value)}" for key, value in overrides.items()]
    rc = main(["train", "--no-resume", "--no-progress", "--debug", str(REPO / "configs" / recipe), *items])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, f"{recipe}: train exited {rc}"
    return json.loads(out[-1])


def test_toml_literal_round_trips_through_the_override_parser():
    """What `train_one_step` passes is what the loader reads back (arrays of tables included)."""
    value = {"teachers.models": [{"name": "a", "price_in_per_mtok": 1.0, "max_tokens": 16, "base_url": ""}],
             "replay.traces": ["/x/y z.jsonl"], "trainer.steps": 1, "replay.local_server.enabled": True}
    job = load_config(None, [f"--{k}={toml_literal(v)}" for k, v in value.items()])
    assert job.teachers.models[0].name == "a" and job.teachers.models[0].max_tokens == 16
    assert job.replay.traces == ("/x/y z.jsonl",) and job.trainer.steps == 1 and job.replay.local_server.enabled


@pytest.mark.parametrize("recipe", list_recipes())
def test_cpu_overrides_name_only_existing_keys(recipe, tmp_path, swe_instances):
    """The derived overrides load on top of the recipe (a key they name that the schema lost fails here)."""
    job = load_config(REPO / "configs" / recipe)
    overrides = cpu_overrides(job, tmp_path, tmp_path / "assets", swe_instances)
    cpu = load_config(REPO / "configs" / recipe, overrides)
    assert cpu.model.device in ("auto", "cpu") and cpu.mesh.backend == "local" and cpu.generator.engine == "hf"
    assert cpu.trainer.steps == 1 and cpu.model.registry_flavour() in ("tiny", "tiny_moe")
    # every data path the run reads is on this box
    for paths in (cpu.env.feature_deletion.repos, cpu.env.swe.instances, cpu.env.swe.repos_dir, cpu.replay.traces):
        assert not _missing(paths), (recipe, paths)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list_recipes())
def test_recipe_trains_one_step_on_cpu(recipe, tmp_path, tiny_assets, swe_instances, capsys, monkeypatch):
    # a recipe's relative paths (shipped data) are from the repository root, as `composer-mesh` is run
    monkeypatch.chdir(REPO)
    job = load_config(REPO / "configs" / recipe)
    overrides = cpu_overrides(job, tmp_path / "runs", tiny_assets.root.parent, swe_instances)
    summary = train_one_step(recipe, overrides, capsys)
    assert summary["final_step"] == 1 and summary["steps_run"] == 1 and summary["trained_steps"] == 1, summary
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    [row] = [r for r in rows if r["step"] == 1]
    assert math.isfinite(row["loss"]), row
    # the step's episodes as rollouts.jsonl has them: one line each, its reward the one the step's mean was of
    episodes = [json.loads(line) for line in (Path(summary["run_dir"]) / "rollouts.jsonl").read_text().splitlines()]
    per_step = overrides["trainer.prompts_per_step"] * overrides["generator.group_size"]
    assert len(episodes) == per_step, (recipe, len(episodes))
    assert {e["step"] for e in episodes} == {1} and all(e["turns"][0]["role"] == "assistant" for e in episodes)
    assert abs(sum(e["reward"] for e in episodes) / len(episodes) - row["reward/mean"]) < 1e-6, recipe
    channels = live_channels(job)
    for name, enabled in channels.items():
        material = row.get(MATERIAL[name], 0.0)
        if not enabled:
            assert material == 0 and f"{name}/loss" not in row, (recipe, name, row)
        elif material > 0:
            # a channel with material this step carried loss
            loss = row.get(f"{name}/loss", math.nan)
            assert math.isfinite(loss) and (name == "policy" or loss > 0), (recipe, name, row)
    if channels["preference"]:
        # frozen traces and the run's own failed turns gave the teachers states to disagree on
        assert row["preference/pairs"] > 0, (recipe, row)


def test_swe_fixture_is_a_real_instance(swe_instances, tmp_path):
    """The row the suite substitutes grades as SWE-Gym does: gold patch 1, no patch 0 (the hidden test fails)."""
    from composer_mesh.configs.sections.env import SandboxConfig, SweConfig
    from composer_mesh.envs.sandbox import Sandbox
    from composer_mesh.envs.swe import load_instances

    config = SweConfig(instances=str(swe_instances), repos_dir=str(swe_instances.parent / "repos"), runtime="local")
    [task] = load_instances(config, tmp_path / "store")
    sandbox = Sandbox(SandboxConfig(root_dir=str(tmp_path), wall_timeout_s=30.0))
    gold, empty = task.grade_patch(sandbox, task.patch), task.grade_patch(sandbox, "")
    assert (gold.reward, gold.passed, gold.total) == (1.0, 2, 2), gold
    assert (empty.reward, empty.passed, empty.total) == (0.0, 1, 2), empty
