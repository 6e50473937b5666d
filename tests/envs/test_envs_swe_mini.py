"""SWE-style mini instances (envs/swe_mini.py): micro templates in the SWE-bench shape, graded by the SWE grader.

Each instance is a real git repository made on first use; its grade goes through the local bubblewrap sandbox
and the SWE grader with its negative-control canaries: the gold patch earns 1, the buggy base and a wrong fix 0,
and a module that rewrites pytest's reports at import (fixing nothing) is `forged_report`.
"""

from __future__ import annotations

import ast
import dataclasses
import json

import pytest

from composer_mesh.configs.sections.env import CodingConfig, EnvConfig, MicroVariant, SandboxConfig, ToolLoopConfig
from composer_mesh.envs.base import assistant
from composer_mesh.envs.factory import check_task, env_factory
from composer_mesh.envs.micro import templates
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.sandbox import Sandbox
from composer_mesh.envs.swe import patched_files
from composer_mesh.envs.swe_mini import TARGET, SweMiniTasks
from composer_mesh.envs.tool_format import edit_sites
from composer_mesh.envs.tool_loop import ToolLoopEnv
from composer_mesh.replay.reference_teacher import change_calls
from swe_shapes import BASE_CORE, FORGERIES

KNOBS = CodingConfig(namings=(2,), kinds=("arithmetic", "strings"), ops_per_kind=0, heldout_by="template",
                     heldout_fraction=0.2, validation_fraction=0.2)
# appended to the buggy module, it fixes nothing and makes every test pytest runs report passed
FORGED = FORGERIES["report_rewritten_at_import"].removeprefix(BASE_CORE)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return Sandbox(SandboxConfig(root_dir=str(tmp_path_factory.mktemp("swe-mini-sandbox")), wall_timeout_s=90.0))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    return SweMiniTasks(KNOBS, "train", "swe_mini", tmp_path_factory.mktemp("store"))


def grade(task, sandbox, files: dict[str, str]):
    """The SWE grade of the instance's starting tree with `files` written over it."""
    with task.workspace(sandbox) as ws:
        start = manifest(ws.path)
        for rel, text in files.items():
            (ws.path / rel).write_text(text)
        return task.grade(sandbox, ws, start)


def test_an_instance_has_the_swe_bench_shape(pool):
    task = pool.pick(0)
    assert task is pool.pick(0) and task.backend == "local" and task.source == "swe_mini"
    snapshot = task.snapshot()
    assert sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()) == \
        ["pkg/__init__.py", TARGET, "tests/test_m.py"]
    base = (snapshot / TARGET).read_text()
    assert base == task.stubbed_source
    # every function implemented (no stub), one of them buggy: the gold patch changes its body only
    assert "pass" not in ast.unparse(ast.parse(base)) and [s.name for s in edit_sites(task)] == [task.bug_function]
    fixed = task.reference_files()[TARGET]
    (bug,) = edit_sites(task)
    assert fixed == task.render({bug.name: bug.body}) and base == task.render({})
    # the issue states the failing call, what it returns and what is expected, and shows the module
    statement = task.problem_statement
    call, expected = statement.split(": ", 1)[1].split(" returns ", 1)[0], statement.split(", expected ", 1)[1]
    ns: dict = {}
    exec(base, ns)
    got = eval(call, ns)
    exec(fixed, ns)
    assert f"{call} returns {got!r}, expected {eval(call, ns)!r}." in statement and base in task.prompt()
    assert expected.startswith(repr(eval(call, ns)))
    # FAIL_TO_PASS: the buggy function's cases the bug fails; PASS_TO_PASS: the rest; the tests come from test_patch
    assert task.fail_to_pass and all(f"test_{bug.name}_" in t for t in task.fail_to_pass)
    hidden = patched_files(task.test_patch, snapshot)["tests/test_m.py"].decode()
    assert all(t.split("::")[1] in hidden for t in task.tests)
    assert not any(t.split("::")[1] in (snapshot / "tests/test_m.py").read_text() for t in task.fail_to_pass)


def test_the_swe_grader_pays_the_fix_only(pool, sandbox):
    task = pool.pick(1)
    fixed = task.reference_files()[TARGET]
    gold = grade(task, sandbox, {TARGET: fixed})
    assert gold.reward == 1.0 and gold.reason == "passed" and gold.passed == gold.total == len(task.tests)
    base = grade(task, sandbox, {})
    assert base.reward == 0.0 and base.passed == len(task.pass_to_pass) < base.total
    # code that rewrites pytest's reports at import and fixes nothing: the canaries catch it
    forged = grade(task, sandbox, {TARGET: task.stubbed_source + FORGED})
    assert forged.reward == 0.0 and forged.reason == "forged_report", forged


def test_failing_cases_and_the_reference_change_reach_the_teacher_only(pool, sandbox):
    """A failed tool-loop episode's info carries the failing node ids' test source and the fixed line; neither
    reaches the policy's messages or the workspace."""
    task = pool.pick(2)
    env = ToolLoopEnv(pool, sandbox, ToolLoopConfig(tools=("edit_file",), max_turns=2, check_edits="revert"))
    env.reset(seed=2)
    ws = env.ws.path
    end = env.step(assistant("Done."))
    assert end.done and end.reward == 0.0
    (bug,) = edit_sites(task)
    assert end.info["reference_change"] == f"--- {TARGET}\n    {bug.body[0]}"
    sources = end.info["failing_cases"].split("\n\n")
    assert len(sources) == len(task.fail_to_pass) and all(s.startswith(f"def test_{bug.name}_") for s in sources)
    assert all(bug.body[0] not in str(m["content"]) for m in env.state.messages) and not ws.exists()
    env.close()


def test_the_teachers_edit_fixes_it_in_the_tool_loop(pool, sandbox):
    """The local coding teachers read `target` and `stubbed_source` (mesh.responders): their edit_file call of the
    gold change, run in the tool loop, earns 1 through the SWE grader."""
    task = pool.pick(3)
    (call,) = change_calls({task.target: task.stubbed_source}, task.reference_files(), "edit_file")
    env = ToolLoopEnv(pool, sandbox, ToolLoopConfig(tools=("edit_file",), max_turns=3))
    env.reset(seed=3)
    first = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    end = env.step(assistant("Done."))
    env.close()
    assert first.messages[0]["content"] == f"edited {TARGET}" and json.loads(call["function"]["arguments"])["old"]
    assert end.reward == 1.0 and "failing_cases" not in end.info


def test_split_by_template_and_sources_by_name(tmp_path, sandbox):
    """Instances of a split come from that split's templates; `[[env.coding.variants]]` of shape swe is a source."""
    forced = dataclasses.replace(KNOBS, failing_visible_test=True)
    store = tmp_path / "store"
    for split in ("train", "validation", "heldout"):
        tasks = [SweMiniTasks(KNOBS, split, "swe_mini", store).pick(s) for s in range(4)]
        assert {t.name.split(":", 3)[3] for t in tasks} <= {t.id for t in templates(forced, split)}
        assert all(t.name.startswith(f"swe_mini:{split}:") for t in tasks)
    variant = MicroVariant(name="swe_mini", shape="swe", kinds=("arithmetic", "strings"), ops_per_kind=0,
                           heldout_by="template", validation_fraction=0.2)
    env = EnvConfig(task="coding", coding=CodingConfig(sources=("micro", "swe_mini"), variants=(variant,)),
                    sandbox=SandboxConfig(root_dir=str(tmp_path)))
    check_task(env)
    make = env_factory(env)
    seen = []
    for seed in range(4):
        loop = make("validation")
        loop.reset(seed=seed)
        seen.append(loop.task.source)
        loop.close()
    assert seen == ["swe_mini"] * 4  # micro carves no validation split here: the variant serves it alone
    train = make("train")
    train.reset(seed=1)
    assert train.task.source == "swe_mini" and train.task.name.startswith("swe_mini:train:0:")
    train.close()
