"""The TOML config system: validation errors name the key, includes, overrides, round trip."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from composer_mesh.configs.loader import ConfigError, dump_config, load_config, loads_config, list_recipes
from composer_mesh.configs.schema import JobConfig

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# (id, recipe text, overrides, words the error must contain)
INVALID = [
    ("unknown-section", "[trainr]\nsteps = 3\n", (), ["trainr", "trainer"]),
    ("unknown-key-typo", "[trainer]\nstepz = 3\n", (), ["trainer.stepz", "steps"]),
    ("unknown-key-far", "[trainer]\nqqqq = 3\n", (), ["trainer.qqqq", "valid keys"]),
    ("typo-generator", "[generator]\ntemprature = 0.5\n", (), ["generator.temprature", "temperature"]),
    ("wrong-type-int", '[trainer]\nsteps = "ten"\n', (), ["trainer.steps", "int", "ten"]),
    ("bool-for-int", "[trainer]\nsteps = true\n", (), ["trainer.steps", "int", "True"]),
    ("float-for-int", "[trainer]\nsteps = 2.5\n", (), ["trainer.steps", "int", "2.5"]),
    ("wrong-type-bool", '[metrics]\njsonl = "yes"\n', (), ["metrics.jsonl", "bool"]),
    ("wrong-type-float", '[generator]\ntemperature = "hot"\n', (), ["generator.temperature", "float"]),
    ("wrong-type-str", "[job]\nname = 5\n", (), ["job.name", "str"]),
    ("section-not-table", "trainer = 5\n", (), ["trainer", "table"]),
    ("out-of-range-ge", "[trainer]\nsteps = 0\n", (), ["trainer.steps", ">= 1", "0"]),
    ("out-of-range-le", "[generator]\ntop_p = 1.5\n", (), ["generator.top_p", "<= 1", "1.5"]),
    ("out-of-range-gt", "[generator]\ntop_p = 0.0\n", (), ["generator.top_p", "> 0"]),
    ("out-of-range-lt", "[diloco]\nouter_momentum = 1.0\n", (), ["diloco.outer_momentum", "< 1"]),
    ("bad-choice", '[trainer]\nmode = "turbo"\n', (), ["trainer.mode", "sync", "turbo"]),
    ("bad-choice-mesh", '[mesh]\nbackend = "yarn"\n', (), ["mesh.backend", "slurm"]),
    ("override-unknown", "", ("--trainer.stepz=3",), ["override", "trainer.stepz", "steps"]),
    ("override-wrong-type", "", ("--trainer.steps=abc",), ["override", "trainer.steps", "int"]),
    ("override-range", "", ("--parallelism.ep=0",), ["override", "parallelism.ep", ">= 1"]),
    ("override-malformed", "", ("--trainer.steps",), ["trainer.steps", "--section.key=value"]),
    ("bad-toml", "[trainer\nsteps = 3\n", (), ["invalid TOML"]),
    ("bad-include-missing", 'base = "nope.toml"\n', (), ["base", "nope.toml", "does not exist"]),
    ("bad-include-type", "base = 3\n", (), ["base", "expected a file name"]),
    ("secret-env-missing", '[teachers]\napi_key_env = "COMPOSER_MESH_TEST_UNSET_KEY"\n', (),
     ["teachers.api_key_env", "COMPOSER_MESH_TEST_UNSET_KEY", "not set"]),
    ("secret-env-missing-nested", '[[teachers.models]]\nname = "a"\napi_key_env = "COMPOSER_MESH_TEST_UNSET_KEY"\n', (),
     ["teachers.models.0.api_key_env", "not set"]),
    ("array-of-tables-typo", '[[teachers.models]]\nnmae = "a"\n', (), ["teachers.models.0.nmae", "name"]),
]


@pytest.mark.parametrize("name,text,overrides,words", INVALID, ids=[row[0] for row in INVALID])
def test_invalid_config_names_the_key(tmp_path, name, text, overrides, words):
    path = _write(tmp_path, f"{name}.toml", text)
    with pytest.raises(ConfigError) as exc:
        load_config(path, overrides)
    msg = str(exc.value)
    for word in words:
        assert word in msg, f"{word!r} not in error: {msg}"
    if "override" not in name and name != "bad-toml":
        assert str(path) in msg, f"error should name the file: {msg}"


def test_secret_values_are_refused_without_echoing_them(tmp_path):
    """A key pasted where an env-var *name* belongs is an error that does not repeat the key."""
    secret = "sk-or-v1-0123456789abcdef"
    path = _write(tmp_path, "leak.toml", f'[teachers]\napi_key_env = "{secret}"\n')
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "teachers.api_key_env" in str(exc.value) and "name" in str(exc.value)
    assert secret not in str(exc.value)


def test_secret_env_present_loads_and_dump_holds_only_the_name(tmp_path):
    path = _write(tmp_path, "ok.toml", '[teachers]\napi_key_env = "COMPOSER_MESH_TEST_KEY"\n')
    cfg = load_config(path, environ={"COMPOSER_MESH_TEST_KEY": "sk-secret-value"})
    assert cfg.teachers.api_key_env == "COMPOSER_MESH_TEST_KEY"
    assert "sk-secret-value" not in dump_config(cfg)


def test_include_cycle_is_an_error(tmp_path):
    _write(tmp_path, "a.toml", 'base = "b.toml"\n')
    _write(tmp_path, "b.toml", 'base = "a.toml"\n')
    with pytest.raises(ConfigError, match="include cycle a.toml -> b.toml -> a.toml"):
        load_config(tmp_path / "a.toml")


def test_precedence_defaults_base_file_override(tmp_path):
    _write(tmp_path, "base.toml", "[trainer]\nsteps = 7\nprompts_per_step = 3\nmicrobatches = 2\n[job]\nname = 'from-base'\n")
    child = _write(tmp_path, "child.toml", 'base = "base.toml"\n[trainer]\nsteps = 11\nprompts_per_step = 5\n')
    cfg = load_config(child, ["--trainer.steps=13"])
    assert cfg.trainer.steps == 13  # CLI beats file
    assert cfg.trainer.prompts_per_step == 5  # file beats base
    assert cfg.trainer.microbatches == 2  # base beats defaults
    assert cfg.job.name == "from-base"
    assert cfg.trainer.max_seq_len == JobConfig().trainer.max_seq_len  # untouched default


def test_errors_name_the_file_that_set_the_bad_value(tmp_path):
    _write(tmp_path, "base.toml", "[trainer]\nsteps = -4\n")
    child = _write(tmp_path, "child.toml", 'base = "base.toml"\n[job]\nname = "x"\n')
    with pytest.raises(ConfigError) as exc:
        load_config(child)
    assert str(tmp_path / "base.toml") in str(exc.value) and "trainer.steps" in str(exc.value)


def test_override_values_are_typed_by_the_schema():
    cfg = load_config(None, ["--generator.temperature=1", "--metrics.jsonl=false", "--job.name=run 7", "--job.seed=3"])
    assert cfg.generator.temperature == 1.0 and isinstance(cfg.generator.temperature, float)
    assert cfg.metrics.jsonl is False
    assert cfg.job.name == "run 7"
    assert cfg.job.seed == 3


@pytest.mark.parametrize("recipe", list_recipes())
def test_shipped_recipes_load_dump_load_identical(recipe):
    cfg = load_config(f"configs/{recipe}")
    text = dump_config(cfg)
    again = loads_config(text)
    assert again == cfg
    assert dump_config(again) == text


def test_round_trip_with_non_defaults_everywhere():
    """Change one field of every section, dump, reload: nothing is lost."""
    cfg = load_config(
        None,
        ["--job.seed=9", "--parallelism.ep=2", "--trainer.mode=async", "--trainer.max_staleness=2",
         "--generator.top_k=5", "--diloco.enabled=true", "--mesh.placement=colocated",
         "--checkpoint.keep_last=4", "--metrics.plot=false"],
    )
    assert loads_config(dump_config(cfg)) == cfg


def test_config_is_frozen():
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.steps = 3  # type: ignore[misc]


def test_cli_config_show_prints_resolved_and_exits_2_on_error(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "composer_mesh.mesh.cli", "config", "show", "configs/demo_cpu.toml", "--trainer.steps=3"],
        cwd=REPO, capture_output=True, text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert loads_config(ok.stdout).trainer.steps == 3
    bad = subprocess.run(
        [sys.executable, "-m", "composer_mesh.mesh.cli", "config", "show", "configs/demo_cpu.toml", "--trainer.stepz=3"],
        cwd=REPO, capture_output=True, text=True,
    )
    assert bad.returncode == 2 and "did you mean 'steps'" in bad.stderr


def test_reference_doc_is_generated_from_schema():
    """docs/configuration.md is the output of `composer-mesh config reference` (regenerate it when the schema changes)."""
    from composer_mesh.configs.reference import render_reference

    assert (REPO / "docs" / "configuration.md").read_text() == render_reference()


# TRL GRPOConfig (trl 1.16) and TrainingArguments defaults, transcribed from their source.
TRL_GRPO_DEFAULTS = {
    "num_generations": 8, "max_completion_length": 512, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "learning_rate": 1e-6, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
    "warmup_steps": 0, "max_grad_norm": 1.0, "beta": 0.0, "epsilon": 0.2, "epsilon_high": None,
    "scale_rewards": "group", "loss_type": "dapo", "num_iterations": 1, "mask_truncated_completions": False,
}


def test_grpo_recipe_is_trl_defaults():
    """configs/grpo.toml maps field for field onto TRL GRPOTrainer's defaults (and the installed TRL agrees)."""
    job = load_config(REPO / "configs" / "grpo.toml")
    g, o, p = job.generator, job.optimizer, job.loss.policy
    ours = {
        "num_generations": g.group_size, "max_completion_length": g.max_new_tokens, "temperature": g.temperature,
        "top_p": g.top_p, "top_k": g.top_k, "learning_rate": o.lr, "weight_decay": o.weight_decay,
        "adam_beta1": o.betas[0], "adam_beta2": o.betas[1], "adam_epsilon": o.eps, "warmup_steps": o.warmup_steps,
        "max_grad_norm": job.trainer.grad_clip, "beta": job.loss.beta, "epsilon": p.eps_low,
        "epsilon_high": None if p.eps_high == p.eps_low else p.eps_high, "scale_rewards": p.adv_scale,
        "loss_type": p.kind, "num_iterations": 1 if job.trainer.mode == "sync" else None,
        "mask_truncated_completions": p.overlong_max_len > 0,
    }
    assert ours == TRL_GRPO_DEFAULTS
    assert o.name == "adamw" and o.decay_type == "linear" and o.min_lr_factor == 0.0 and p.tis_cap is None
    assert p.adv_eps == 1e-4 and not p.dynamic_sampling and job.loss.alpha == 0.0
    try:
        from trl import GRPOConfig
    except ImportError:  # the bench extra is not installed: the transcription above stands
        return
    live = GRPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False)
    assert {k: getattr(live, k) for k in TRL_GRPO_DEFAULTS} == TRL_GRPO_DEFAULTS


def test_generator_tensor_parallelism_needs_the_vllm_engine():
    cfg = load_config(None, ["--generator.engine=vllm", "--generator.tensor_parallel_size=2"])
    assert cfg.generator.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"generator.tensor_parallel_size = 2 needs generator.engine = 'vllm'"):
        load_config(None, ["--generator.engine=hf", "--generator.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="generator.tensor_parallel_size"):
        load_config(None, ["--generator.tensor_parallel_size=0"])


def test_typed_overrides_are_validated_like_recipe_values():
    cfg = load_config(None, {"generator.temperature": 1, "metrics.jsonl": False, "job.name": "run 7",
                             "job.python_path": ["a", "b"], "loss.policy.tis_cap": None})
    assert cfg.generator.temperature == 1.0 and isinstance(cfg.generator.temperature, float)
    assert (cfg.metrics.jsonl, cfg.job.name, cfg.job.python_path) == (False, "run 7", ("a", "b"))
    assert cfg.loss.policy.tis_cap is None
    assert load_config(None, {"trainer.steps": 13}) == load_config(None, ["--trainer.steps=13"])
    for overrides, words in (({"trainer.steps": "many"}, r"override: key 'trainer\.steps': expected int"),
                             ({"trainer.steps": -1}, r"override: key 'trainer\.steps': expected a value >= "),
                             ({"trainer.stepz": 3}, r"trainer\.stepz.*did you mean 'steps'"),
                             ({"steps": 3}, r"override 'steps': expected --section\.key=value")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, overrides)


def test_validation_split_needs_a_task_that_carves_one():
    """`[trainer] eval_split = "validation"` is for choosing settings without the held-out split: the loader
    refuses it, naming the key, where the task has no validation split (none carved, or a task kind without
    one), and the evaluation then reads that split."""
    with pytest.raises(ConfigError, match=r"needs env\.demo\.validation_fraction > 0"):
        load_config("configs/demo_cpu.toml", ["--trainer.eval_split=validation"])
    with pytest.raises(ConfigError, match=r"needs env\.coding\.validation_fraction > 0"):
        load_config("configs/coding_cpu.toml", ["--trainer.eval_split=validation"])
    with pytest.raises(ConfigError, match=r"eval_split = 'validation' needs env\.task = 'demo' or 'coding'"):
        load_config("configs/coding_cpu.toml", ["--trainer.eval_split=validation", "--env.coding.validation_fraction=0.2",
                                                "--env.coding.sources=[\"repos\"]", "--env.tool_loop.check_edits=off"])
    with pytest.raises(ConfigError, match=r"leaves no train split"):
        load_config("configs/demo_cpu.toml", ["--env.demo.validation_fraction=0.8"])
    cfg = load_config("configs/demo_cpu.toml", ["--trainer.eval_split=validation", "--env.demo.validation_fraction=0.2"])
    from composer_mesh.mesh.controller import ControllerConfig

    loop = ControllerConfig.from_job(cfg, steps=1, weight_dir="", state_dir="", replay=False)
    assert cfg.trainer.eval_split == "validation" and loop.eval.split == "validation"
