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


VARIANTS = '''
[env]
task = "coding"
[env.coding]
sources = ["micro", "chain", "fix"]
namings = [2]
heldout_by = "surface"
heldout_fraction = 0.3
[[env.coding.variants]]
name = "chain"
statements_per_body = 2
kinds = ["arithmetic", "strings"]
ops_per_kind = 0
validation_fraction = 0.25
[[env.coding.variants]]
name = "fix"
failing_visible_test = true
heldout_by = "template"
'''


def test_variants_are_named_sources_of_overridden_micro_knobs():
    """`[[env.coding.variants]]`: each a micro source whose unset keys keep [env.coding]'s; `sources` names them, the
    union alternates over them, each splits by its own template hash, and validation is the union of the sources
    that carve one."""
    env = loads_config(VARIANTS).env
    chain, fix = env.coding.variant("chain"), env.coding.variant("fix")
    assert (chain.statements_per_body, chain.kinds, chain.namings, chain.validation_fraction) == \
        (2, ("arithmetic", "strings"), (2,), 0.25)
    assert fix.failing_visible_test and fix.statements_per_body == 1 and env.coding.variant("micro").variants == ()
    check_task(env)
    make = env_factory(env)
    loop = make("train")
    seen = []
    for seed in range(6):
        loop.reset(seed=seed)
        seen.append(loop.task.source)
        assert loop.task.name.startswith(f"{loop.task.source}:train:{seed // 3}:")
    loop.close()
    assert seen == ["micro", "chain", "fix"] * 2
    validation = make("validation")
    validation.reset(seed=5)
    assert validation.task.source == "chain" and validation.task.name.startswith("chain:validation:5:")
    validation.close()


def test_variant_errors_name_the_key():
    for table, message in (('name = "micro"', r"env.coding.variants\[0\].name = 'micro'"),
                           ('statements_per_body = 2', r"env.coding.variants\[0\].name = ''"),
                           ('name = "x"\nvalidation_fraction = 0.9', r"env.coding.variants\[0\].heldout_fraction"),
                           ('name = "x"\nshape = "git"', "env.coding.variants.0.shape")):
        with pytest.raises(ValueError, match=message):
            loads_config(f'[env]\ntask = "coding"\n[[env.coding.variants]]\n{table}\n')
    with pytest.raises(ValueError, match=r"env.coding.variants\[1\].name = 'x'"):
        loads_config('[env]\ntask = "coding"\n[[env.coding.variants]]\nname = "x"\n[[env.coding.variants]]\nname = "x"\n')
    with pytest.raises(ValueError, match=r"env.coding.sources: unknown source\(s\) \['chian'\]"):
        check_task(loads_config(VARIANTS.replace('"chain", "fix"]', '"chian", "fix"]')).env)
    with pytest.raises(ValueError, match="env.coding.kinds"):
        check_task(loads_config(VARIANTS.replace('kinds = ["arithmetic", "strings"]', 'kinds = ["poetry"]')).env)
    with pytest.raises(ValueError, match="env.tool_loop.warm_start_note_formats"):
        loads_config('[env.tool_loop]\nwarm_start_note_formats = ["reference", "essay"]\n')
