"""`[env] task = "coding"`: the tool loop over the union of `[env.coding] sources`, and its config errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_mesh.configs.loader import loads_config
from composer_mesh.configs.sections.env import CodingConfig, EnvConfig, FeatureDeletionConfig, ToolLoopConfig
from composer_mesh.envs.factory import build_env, check_task, env_factory
from composer_mesh.envs.tool_loop import ToolLoopEnv

FIXTURES = Path(__file__).parent / "fixtures"


def test_coding_task_interleaves_micro_and_every_repository(task_store):
    fd = FeatureDeletionConfig(repos=(str(FIXTURES / "textkit"), str(FIXTURES / "minicalc")), max_tasks=1)
    config = EnvConfig(task="coding", coding=CodingConfig(sources=("micro", "repos")), feature_deletion=fd)
    make = env_factory(config, store=task_store)
    env = make("train")
    assert isinstance(env, ToolLoopEnv)
    seen = []
    for seed in range(4):
        env.reset(seed=seed)
        seen.append((env.task.source, env.task.name.split(":")[0]))
    env.close()
    assert [s for s, _ in seen] == ["micro", "repos", "micro", "repos"]
    assert {name for s, name in seen if s == "repos"} == {"textkit", "minicalc"}
    assert make("heldout").tasks.pick(0).name.startswith("micro:heldout:")


def test_coding_sources_errors_name_the_key():
    with pytest.raises(ValueError, match="env.coding.sources is empty"):
        build_env(EnvConfig(task="coding", coding=CodingConfig(sources=())))
    with pytest.raises(ValueError, match=r"env.coding.sources: unknown source\(s\) \['nope'\]"):
        build_env(EnvConfig(task="coding", coding=CodingConfig(sources=("micro", "nope"))))
    with pytest.raises(ValueError, match="env.feature_deletion.repos"):
        build_env(EnvConfig(task="coding", coding=CodingConfig(sources=("repos",))))
    with pytest.raises(ValueError, match="env.coding.heldout_fraction"):
        build_env(EnvConfig(task="coding", coding=CodingConfig(heldout_fraction=0.0)), "heldout")


def test_check_task_refuses_a_bad_coding_section_before_any_actor_starts():
    """The launcher's cheap pre-flight: every error names its key, and nothing is generated or graded."""
    check_task(EnvConfig(task="coding"))
    bad = {
        "env.coding.sources is empty": CodingConfig(sources=()),
        r"env.coding.sources: unknown source\(s\) \['nope'\]": CodingConfig(sources=("nope",)),
        "needs env.feature_deletion.repos": CodingConfig(sources=("micro", "repos")),
        "env.coding.heldout_fraction": CodingConfig(heldout_fraction=0.0),
        "env.coding.kinds": CodingConfig(kinds=("sorting",)),
    }
    for message, coding in bad.items():
        with pytest.raises(ValueError, match=message):
            check_task(EnvConfig(task="coding", coding=coding))
    with pytest.raises(ValueError, match="env.tool_loop.tools"):
        check_task(EnvConfig(task="coding", tool_loop=ToolLoopConfig(tools=("edit_file", "grep"))))


def test_coding_keys_load_from_toml():
    cfg = loads_config(
        '[env]\ntask = "coding"\n[env.coding]\nsources = ["micro", "repos"]\nkinds = ["lists", "dicts"]\n'
        'failing_visible_test = true\n[env.feature_deletion]\nrepos = ["a", "b"]\n[env.tool_loop]\ntools = ["edit_file"]\n'
    )
    env = cfg.env
    assert env.task == "coding" and env.coding.sources == ("micro", "repos") and env.coding.kinds == ("lists", "dicts")
    assert env.feature_deletion.repos == ("a", "b") and env.tool_loop.tools == ("edit_file",)
    assert env.coding.failing_visible_test and env.coding.functions_per_task == 1
