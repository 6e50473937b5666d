"""The multi-turn tool loop: tool results, error sites with the right kinds, hints from replay/, safeguards."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from composer_mesh.configs.records import ErrorKind
from composer_mesh.envs.base import assistant
from composer_mesh.envs.safeguards import (
    MAX_SCAN_CHARS, change_violations, diff_tree, is_test_path, manifest, scan_source,
)
from composer_mesh.envs.tree import MAX_DEPTH, TreeTooDeep
from composer_mesh.envs.tool_loop import TOOLS, ToolLoopEnv


LEXER = "minicalc/lexer.py"
LEXER_SOURCE = (Path(__file__).parent / "fixtures" / "minicalc" / LEXER).read_text()


@pytest.fixture(scope="module")
def env(repo_tasks, sandbox):
    """A minicalc task whose visible tests include the lexer's (so a broken lexer fails `run_tests`)."""
    task = next(t for t in repo_tasks["minicalc"] if "tests/test_lexer.py" not in t.hidden_tests)
    e = ToolLoopEnv([task], sandbox)
    yield e
    e.close()


@pytest.fixture(scope="module")
def episode(env):
    """A short episode that trips every kind of tool error, then repairs the code (run once)."""
    env.reset(seed=0)
    task = env.task
    outside = os.path.relpath("/etc/hostname", env.ws.path)
    broken = task.stubbed_source + "\ndef oops(:\n"
    steps = [
        assistant(tool_calls=[("list_dir", {}), ("read_file", {"path": "missing.py"})]),           # FILE_NOT_FOUND
        assistant(tool_calls=[("read_file", {"path": outside})]),                                  # PERMISSION
        assistant(tool_calls=[("frobnicate", {"x": 1})]),                                          # BAD_TOOL_CALL
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c9", "type": "function", "function": {"name": "read_file", "arguments": "{not json"}}]},
        assistant(tool_calls=[("shell", {"command": "rm -rf ."})]),                                # COMMAND_NOT_FOUND
        assistant(tool_calls=[("write_file", {"path": LEXER, "content": LEXER_SOURCE.replace("return tokens", "return tokens[:1]")}),
                              ("run_tests", {})]),                                                 # TEST_FAILURE
        assistant(tool_calls=[("write_file", {"path": task.target, "content": broken}), ("run_tests", {})]),  # SYNTAX
        assistant(tool_calls=[("shell", {"command": "python -c 'while True: pass'"})]),            # TIMEOUT
        assistant(tool_calls=[("write_file", {"path": task.target, "content": task.original_source()}),
                              ("write_file", {"path": LEXER, "content": LEXER_SOURCE}), ("run_tests", {})]),
        assistant("The feature is back."),
    ]
    observations = [env.step(a) for a in steps]
    return list(env.state.messages), list(env.state.error_sites), observations


def test_tool_errors_become_error_sites_and_episode_is_graded(episode):
    messages, sites, observations = episode
    kinds = [[s.kind for s in o.error_sites] for o in observations]
    assert kinds == [
        [ErrorKind.FILE_NOT_FOUND], [ErrorKind.PERMISSION], [ErrorKind.BAD_TOOL_CALL], [ErrorKind.BAD_TOOL_CALL],
        [ErrorKind.COMMAND_NOT_FOUND], [ErrorKind.TEST_FAILURE], [ErrorKind.SYNTAX], [ErrorKind.TIMEOUT], [], [],
    ]
    for site in sites:
        assert messages[site.turn]["role"] == "assistant"
        names = [c["function"]["name"] for c in messages[site.turn]["tool_calls"]]
        assert site.tool in names
        results = [m["content"] for m in messages[site.turn + 1 :] if m["role"] == "tool"]
        assert any(site.message[:40] in r for r in results)
        # privileged feedback: the tool's whole result (the model saw it in the tool message, `message` is its head)
        assert site.feedback.startswith(site.message) and any(site.feedback in r for r in results)
    # every tool call got exactly one tool message with its id
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            ids = [c["id"] for c in m["tool_calls"]]
            assert [t["tool_call_id"] for t in messages[i + 1 : i + 1 + len(ids)]] == ids
    final = observations[-1]
    assert final.done and final.reward == 1.0 and final.info["reason"] == "passed"


def test_error_sites_become_hints_through_replay(episode):
    """Integration: the sites the loop produces go through replay/'s hint pipeline unchanged."""
    from composer_mesh.replay.hints import TemplateHintGenerator, insert_hint

    messages, sites, _ = episode
    generator = TemplateHintGenerator()
    assert len(sites) == 8
    for site in sites:
        hint = generator.hint(site, messages)
        assert hint.strip()
        ctx = insert_hint(messages, site, hint)
        assert ctx.messages[ctx.hint_index] == {"role": "user", "content": hint}
        # the hint sits right after all tool results of the failed call
        assert all(m["role"] == "tool" for m in ctx.messages[site.turn + 1 : ctx.hint_index])
        assert ctx.messages[: ctx.hint_index] == messages[: ctx.hint_index]
        assert ctx.messages[ctx.hint_index + 1 :] == messages[ctx.hint_index :]
    hints = {s.kind: generator.hint(s, messages) for s in sites}
    assert len(set(hints.values())) == len(hints)  # kinds map to different hints


def test_a_failed_episode_hands_the_teacher_its_privileged_context(env):
    """Hidden tests failed: the episode's info carries their output and the task's reference for the hint
    teacher (`failure_sites` puts them on the site); the policy's messages hold neither, and the workspace the
    agent worked in never held the hidden tests or the reference."""
    from composer_mesh.actors.rollout import Rollout, failure_sites
    from composer_mesh.envs.coding import render_reference

    first = env.reset(seed=0)
    task, ws = env.task, env.ws.path
    listing = sorted(str(p.relative_to(ws)) for p in ws.rglob("*") if p.is_file())
    obs = env.step(assistant("I am done."))
    assert obs.done and obs.reward < 1.0 and obs.error_sites == []
    reference = render_reference(task.reference_files())
    assert obs.info["reference"] == reference and task.original_source().rstrip() in reference
    assert obs.info["feedback"].strip()
    assert not any(h in listing for h in task.hidden_tests)
    messages = list(env.state.messages)
    rollout = Rollout(0, 0, 0, [1, 2], 1, [False, True], [0.0, 0.0], messages, [0] * len(messages),
                      [(len(messages) - 1, 1, 2)], obs.reward, "done", 0, info=dict(obs.info))
    (site,) = failure_sites(rollout)
    assert site.reference == reference and site.feedback == obs.info["feedback"] and site.tool == "grade"
    # the lines the reference writes: the deleted body, indented as in the file, which the stub does not hold
    change = obs.info["reference_change"].splitlines()
    assert change[0] == f"--- {task.target}" and len(change) > 2 and site.change == obs.info["reference_change"]
    body = "\n".join(change[1:])
    assert body in task.original_source() and body not in task.stubbed_source
    assert site.message == f"hidden tests: {obs.info['reason']}"  # what the policy may be told: no test output
    context = "".join(str(m.get("content")) for m in [*first.messages, *messages])
    assert task.original_source().strip() not in context and obs.info["feedback"].strip() not in context


def test_write_file_cannot_follow_a_symlink_out(env):
    env.reset(seed=0)
    obs = env.step(assistant(tool_calls=[("shell", {"command": "python -c \"import os; os.symlink('/etc', 'esc')\""})]))
    assert obs.error_sites == [], obs.messages
    obs = env.step(assistant(tool_calls=[("write_file", {"path": "esc/cm-pwned", "content": "x"})]))
    assert obs.error_sites[0].kind is ErrorKind.PERMISSION and not os.path.exists("/etc/cm-pwned")


def test_turn_limit_ends_the_episode(repo_tasks, sandbox):
    from composer_mesh.configs.sections.env import ToolLoopConfig

    env = ToolLoopEnv(repo_tasks["minicalc"][:1], sandbox, ToolLoopConfig(max_turns=2))
    env.reset(seed=0)
    assert not env.step(assistant(tool_calls=[("list_dir", {})])).done
    obs = env.step(assistant(tool_calls=[("list_dir", {})]))
    assert obs.done and obs.reward == 0.0 and len(obs.messages) == 1
    env.close()


def test_tool_schemas_are_openai_functions():
    assert [t["function"]["name"] for t in TOOLS] == ["read_file", "write_file", "edit_file", "list_dir", "run_tests", "shell"]
    assert all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object" for t in TOOLS)


def test_static_scan_counts_only_what_the_agent_added():
    old = "import os\n\ndef f():\n    return os.environ.get('HOME')\n"
    assert scan_source(old + "\ndef g():\n    return 1\n", old) == []
    new = old + "\ndef g():\n    import sys\n    sys.exit(0)\n    return os.environ['X']\n"
    assert scan_source(new, old) == [("env_access", "os.environ"), ("exit_trick", "sys.exit")]
    assert ("test_runner_tamper", "import _pytest") in scan_source("import _pytest.python\n", None)
    assert ("reads_tests", "string 'tests/test_core.py'") in scan_source("open('tests/test_core.py')\n", None)
    assert scan_source("def f(:\n", None) == []  # syntax errors are the test run's business


def test_static_scan_returns_for_any_source():
    """Deeply nested code Python still runs is read (its construct found); code past the parser's depth or over
    MAX_SCAN_CHARS cannot be, and is `unscannable_source`; a syntax error (null bytes among them) is the test
    run's; an old side that cannot be read counts as empty."""
    assert scan_source("import os\nx = os.environ" + ".b" * (sys.getrecursionlimit() + 200), None) == [
        ("env_access", "os.environ")]
    unreadable = ["x = " + "+".join(["1"] * 100_000), "x = " + "-" * 100_000 + "1", "x = " + "lambda: " * 3000 + "1",
                  "x = 1\n" * (MAX_SCAN_CHARS // 6 + 1)]
    for source in unreadable:
        assert [reason for reason, _ in scan_source(source, None)] == ["unscannable_source"]
    assert scan_source("import os\x00\n", None) == []
    assert scan_source("import os\nos.environ\n", unreadable[0]) == [("env_access", "os.environ")]


def test_manifest_walks_within_the_tree_bounds_and_hashes_only_regular_files(tmp_path):
    import socket

    (tmp_path / "a.py").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    os.symlink("loop", tmp_path / "loop")
    os.symlink("a.py", tmp_path / "link.py")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
    (tmp_path / "locked.py").write_text("y")
    os.chmod(tmp_path / "locked.py", 0)
    assert sorted(manifest(tmp_path)) == ["a.py", "locked.py"]
    deep = tmp_path / "deep"
    deep.joinpath(*["d"] * (MAX_DEPTH + 1)).mkdir(parents=True)
    with pytest.raises(TreeTooDeep):
        manifest(tmp_path)


def test_change_rules():
    before = {"pkg/a.py": "1", "tests/test_a.py": "1", "pytest.ini": "1", "tests/test_b.py": "1"}
    after = {"pkg/a.py": "2", "tests/test_a.py": "2", "pytest.ini": "2", "conftest.py": "1",
             "pkg/b.pth": "1", "pkg/__pycache__/a.cpython-311.pyc": "1"}
    found = change_violations(diff_tree(before, after))
    assert sorted(found) == [
        ("added_conftest", "conftest.py"), ("deleted_tests", "tests/test_b.py"),
        ("edited_test_config", "pkg/b.pth"), ("edited_test_config", "pytest.ini"), ("edited_tests", "tests/test_a.py"),
    ]
    assert is_test_path("tests/data/x.json") and is_test_path("a/test_x.py") and not is_test_path("pkg/testing.py")


def _micro_env(sandbox, **tool_loop):
    from composer_mesh.configs.sections.env import CodingConfig, ToolLoopConfig
    from composer_mesh.envs.micro import MicroTasks

    tasks = MicroTasks(CodingConfig(functions_per_task=2, kinds=("arithmetic", "strings")), "train")
    return ToolLoopEnv(tasks, sandbox, ToolLoopConfig(**tool_loop))


def test_edit_file_replaces_one_exact_occurrence(sandbox):
    """Missing, ambiguous and empty `old` change nothing and say why; unique edits rebuild the task (reward 1)."""
    env = _micro_env(sandbox)
    env.reset(seed=3)
    task, target = env.task, env.task.target
    start = (env.ws.path / target).read_text()
    outside = os.path.relpath("/etc/hostname", env.ws.path)
    bad = [
        ("edit_file", {"path": target, "old": "pass", "new": "return 0"}),        # twice in the file
        ("edit_file", {"path": target, "old": "return 42", "new": "return 0"}),   # not there
        ("edit_file", {"path": target, "old": "", "new": "x"}),
        ("edit_file", {"path": "nope.py", "old": "pass", "new": "x"}),
        ("edit_file", {"path": outside, "old": "localhost", "new": "x"}),
    ]
    obs = env.step(assistant(tool_calls=bad))
    assert [s.kind for s in obs.error_sites] == [ErrorKind.BAD_TOOL_CALL] * 3 + [ErrorKind.FILE_NOT_FOUND, ErrorKind.PERMISSION]
    texts = [m["content"] for m in obs.messages]
    assert "found 2 times" in texts[0] and "not found" in texts[1] and (env.ws.path / target).read_text() == start
    stubs, refs = start.split("\n\n\n"), task.reference[target].split("\n\n\n")
    obs = env.step(assistant(tool_calls=[("edit_file", {"path": target, "old": s, "new": r}) for s, r in zip(stubs, refs)]))
    assert obs.error_sites == [] and (env.ws.path / target).read_text() == task.reference[target]
    obs = env.step(assistant("Done."))
    assert obs.done and obs.reward == 1.0
    info = obs.info
    assert (info["template"], info["source"], info["passed"], info["total"]) == (task.template, "micro", 8, 8)
    assert info["tool_errors"] == {"bad_tool_call": 3, "file_not_found": 1, "permission": 1}
    assert info["reason"] == "passed" and info["violations"] == [] and info["violation_kinds"] == {}
    assert info["turns"] == 3 and info["grade_s"] > 0


def test_tools_subset_is_what_the_model_sees(sandbox):
    env = _micro_env(sandbox, tools=("edit_file", "run_tests"), max_turns=2)
    obs = env.reset(seed=0)
    assert [t["function"]["name"] for t in obs.info["tools"]] == ["edit_file", "run_tests"]
    assert obs.messages[0]["content"] == "You edit a Python repository with tools: edit_file, run_tests."
    peek = ("edit_file", {"path": "test_hidden.py", "old": "def", "new": "def"})  # absent, and recorded
    obs = env.step(assistant(tool_calls=[("read_file", {"path": env.task.target}), ("run_tests", {}), peek]))
    assert [s.kind for s in obs.error_sites] == [ErrorKind.BAD_TOOL_CALL, ErrorKind.TEST_FAILURE, ErrorKind.FILE_NOT_FOUND]
    assert "unknown tool 'read_file'; tools: edit_file, run_tests" in obs.messages[0]["content"]
    # an edited test is a violation; the turn limit grades
    hack = ("edit_file", {"path": "test_m.py", "old": "from m import", "new": "# ok\nfrom m import"})
    obs = env.step(assistant(tool_calls=[hack, ("run_tests", {})]))
    assert obs.error_sites[0].kind is ErrorKind.TEST_FAILURE and obs.messages[0]["content"] == "edited test_m.py"
    info = obs.info
    assert obs.done and obs.reward == 0.0 and info["turns"] == 2
    assert info["tool_errors"] == {"bad_tool_call": 1, "test_failure": 2, "file_not_found": 1}
    assert info["reason"] == "reads_hidden_tests" and info["violation_kinds"] == {"reads_hidden_tests": 1, "edited_tests": 1}
    with pytest.raises(ValueError, match="env.tool_loop.tools"):
        _micro_env(sandbox, tools=("edit_file", "grep"))
    with pytest.raises(ValueError, match="env.tool_loop.tools"):
        _micro_env(sandbox, tools=())


def _graded_rollout(obs, messages):
    from composer_mesh.actors.rollout import Rollout

    return Rollout(0, 0, 0, [1, 2], 1, [False, True], [0.0, 0.0], messages, [0] * len(messages),
                   [(len(messages) - 1, 1, 2)], obs.reward, "done", 0, info=dict(obs.info))


def test_calls_past_the_message_bound_are_refused_unrun_and_counted(sandbox):
    from composer_mesh.mesh.episode_metrics import episode_metrics

    env = _micro_env(sandbox, max_calls_per_message=2)
    env.reset(seed=0)
    obs = env.step(assistant(tool_calls=[("write_file", {"path": f"a{i}.txt", "content": "x"}) for i in range(4)]))
    texts = [m["content"] for m in obs.messages]
    assert texts[:2] == ["wrote 1 characters to a0.txt", "wrote 1 characters to a1.txt"]
    assert texts[2:] == ["error: write_file: not run: at most 2 tool calls run per message"] * 2
    assert [s.kind for s in obs.error_sites] == [ErrorKind.BAD_TOOL_CALL] * 2
    assert sorted(p.name for p in env.ws.path.glob("a*.txt")) == ["a0.txt", "a1.txt"]
    obs = env.step(assistant("Done."))
    assert obs.info["calls_refused"] == {"calls_per_message": 2} and obs.info["tool_errors"] == {"bad_tool_call": 2}
    metrics = episode_metrics([_graded_rollout(obs, env.state.messages)])
    assert metrics["coding/calls_refused"] == 2.0 and metrics["coding/calls_refused/calls_per_message"] == 2.0
    assert metrics["coding/grading_s_max"] >= metrics["coding/grade_s_max"] > 0
    env.close()


def test_edits_past_the_episode_bound_are_refused_and_other_tools_still_run(sandbox):
    env = _micro_env(sandbox, max_edits_per_episode=2)
    env.reset(seed=1)
    target = env.task.target
    for i in range(2):
        obs = env.step(assistant(tool_calls=[("write_file", {"path": f"n{i}.py", "content": "x = 1\n"})]))
        assert obs.error_sites == []
    obs = env.step(assistant(tool_calls=[("edit_file", {"path": target, "old": "def", "new": "def"}),
                                         ("write_file", {"path": "n2.py", "content": "x = 1\n"}),
                                         ("read_file", {"path": target})]))
    texts = [m["content"] for m in obs.messages]
    refused = "not run: at most 2 edits are applied per episode"
    assert texts[:2] == [f"error: {name}: {refused}" for name in ("edit_file", "write_file")]
    assert texts[2] == (env.ws.path / target).read_text() and not (env.ws.path / "n2.py").exists()
    obs = env.step(assistant("Done."))
    assert obs.info["calls_refused"] == {"edits_per_episode": 2}
    env.close()


def test_the_grading_budget_refuses_an_edit_it_cannot_check_and_the_episode_is_still_graded(tmp_path):
    """A check that runs to the wall limit (the edit's module never finishes importing) spends the budget of
    3 x wall_timeout_s: the next edit would need a check and the final grade beyond it, so it is refused unrun;
    the final grade still runs, and the episode's grading time counts the check."""
    from composer_mesh.configs.sections.env import CodingConfig, SandboxConfig, ToolLoopConfig
    from composer_mesh.envs.micro import MicroTasks
    from composer_mesh.envs.sandbox import Sandbox

    wall = 2.0
    sandbox = Sandbox(SandboxConfig(root_dir=str(tmp_path), wall_timeout_s=wall, cpu_time_s=2))
    config = ToolLoopConfig(tools=("edit_file", "write_file"), check_edits="revert", grading_budget=3.0, max_turns=4)
    env = ToolLoopEnv(MicroTasks(CodingConfig(namings=(2,)), "train"), sandbox, config)
    env.reset(seed=0)
    target, reference = env.task.target, env.task.reference_files()[env.task.target]
    hang = ("edit_file", {"path": target, "old": "def ", "new": "while True:\n    pass\n\n\ndef "})
    obs = env.step(assistant(tool_calls=[hang]))
    assert obs.messages[0]["content"].endswith("visible tests: failed; edit undone")
    obs = env.step(assistant(tool_calls=[("write_file", {"path": target, "content": reference})]))
    assert obs.messages[0]["content"].startswith("error: write_file: not run: the episode's grading time is bounded by 6 s")
    assert obs.error_sites[0].kind is ErrorKind.BAD_TOOL_CALL and (env.ws.path / target).read_text() != reference
    obs = env.step(assistant("Done."))
    assert obs.done and obs.info["calls_refused"] == {"grading_budget": 1} and obs.info["total"] > 0
    assert obs.info["grading_s"] >= wall + obs.info["grade_s"]
    env.close()
