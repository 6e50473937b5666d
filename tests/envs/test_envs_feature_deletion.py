"""Feature-deletion tasks from real repositories: oracle 1 on every task, no-op 0; generator checks."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from composer_mesh.configs.sections.env import FeatureDeletionConfig
from composer_mesh.envs.feature_deletion import generate_tasks, stub_functions
from composer_mesh.envs.grading import grade_workspace, run_suite
from composer_mesh.envs.safeguards import manifest

FIXTURES = Path(__file__).parent / "fixtures"
REPOS = ("textkit", "minicalc")


def _grade(sandbox, task, write_original: bool):
    with task.workspace(sandbox) as ws:
        start = manifest(ws.path)
        assert not any(h in start for h in task.hidden_tests)  # hidden tests are not in the workspace
        assert (ws.path / task.target).read_text() == task.stubbed_source
        if write_original:
            (ws.path / task.target).write_text(task.original_source())
        return grade_workspace(sandbox, task.pristine, start, ws, task.expected_tests, targets={task.target: task.stubbed_source})


@pytest.mark.parametrize("repo", REPOS)
def test_oracle_gets_one_and_noop_gets_zero_on_every_task(repo, repo_tasks, sandbox):
    tasks = repo_tasks[repo]
    assert len(tasks) == 3
    for task in tasks:
        oracle = _grade(sandbox, task, write_original=True)
        assert (oracle.reward, oracle.reason) == (1.0, "passed"), (task.name, oracle.violations, oracle.output[-800:])
        assert oracle.passed == oracle.total == len(task.expected_tests) == 8
        noop = _grade(sandbox, task, write_original=False)
        assert noop.reward == 0.0 and noop.reason.startswith("tests_failed"), (task.name, noop.reason)
        assert noop.violations == ()


def test_multi_function_features(sandbox, task_store):
    config = FeatureDeletionConfig(max_tasks=1, functions_per_task=2, seed=1)
    tasks = generate_tasks(FIXTURES / "minicalc", config, sandbox, task_store)
    assert len(tasks) == 1
    for task in tasks:
        assert len(task.symbols) == 2
        tree = ast.parse(task.stubbed_source)
        stubbed = {
            node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and "deleted feature" in ast.unparse(node)
        }
        assert stubbed == {s.split(".")[-1] for s in task.symbols}
        assert _grade(sandbox, task, write_original=True).reward == 1.0
        assert _grade(sandbox, task, write_original=False).reward == 0.0


def test_stub_keeps_docstrings_and_everything_else():
    source = textwrap.dedent('''
        import math


        def keep(x):
            return x + 1


        class Box:
            def area(self, w, h):
                """Area of the box."""
                a = w * h
                return a

            def other(self):
                return 2


        def gone(n):
            total = 0
            for i in range(n):
                total += i
            return total
    ''')
    out = stub_functions(source, {"Box.area", "gone"})
    tree, before = ast.parse(out), ast.parse(source)
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    old = {n.name: n for n in ast.walk(before) if isinstance(n, ast.FunctionDef)}
    assert ast.get_docstring(fns["area"]) == "Area of the box."
    assert [type(s).__name__ for s in fns["area"].body] == ["Expr", "Raise"]
    assert [type(s).__name__ for s in fns["gone"].body] == ["Raise"]
    for name in ("keep", "other"):
        assert ast.dump(fns[name]) == ast.dump(old[name])


def _make_repo(root: Path, tests: str) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text(textwrap.dedent('''
        def covered(xs):
            out = []
            for x in xs:
                out.append(x * 2)
            return out


        def uncovered(xs):
            total = 0
            for x in xs:
                total += x
            return total
    '''))
    (root / "tests" / "test_mod.py").write_text(textwrap.dedent(tests))
    return root


def test_generator_works_on_any_local_repo_and_drops_untested_functions(tmp_path, sandbox, task_store):
    repo = _make_repo(tmp_path / "anyrepo", "from pkg.mod import covered\n\ndef test_covered():\n    assert covered([1, 2]) == [2, 4]\n")
    tasks = generate_tasks(repo, FeatureDeletionConfig(max_tasks=5), sandbox, task_store)
    assert [t.symbols for t in tasks] == [("covered",)]  # deleting `uncovered` breaks no test: no task
    assert tasks[0].hidden_tests == ("tests/test_mod.py",)
    assert _grade(sandbox, tasks[0], write_original=True).reward == 1.0


def test_generator_refuses_a_repo_whose_suite_fails(tmp_path, sandbox, task_store):
    repo = _make_repo(tmp_path / "broken", "def test_broken():\n    assert 1 == 2\n")
    with pytest.raises(ValueError, match="pristine test suite must pass"):
        generate_tasks(repo, FeatureDeletionConfig(), sandbox, task_store)


def test_task_store_is_private(repo_tasks, task_store):
    task = repo_tasks["textkit"][0]
    assert task_store.root in task.pristine.parents and task.pristine.name == "textkit"
    assert (task_store.root.stat().st_mode & 0o777) == 0o700 and task_store.root.stat().st_uid == 0


def _run_with_appended(sandbox, code: str):
    """`run_suite` alone (no static scan) on textkit with `code` appended to textkit/core.py."""
    with sandbox.workspace(copy_from=FIXTURES / "textkit") as ws:
        core = ws.path / "textkit" / "core.py"
        core.write_text(core.read_text() + code)
        ws.adopt()
        return run_suite(sandbox, ws, ["textkit/core.py"])


def test_runtime_integrity_check_catches_patching_the_static_scan_misses(sandbox):
    """The audit hook and the identity checks see tampering on their own."""
    run = _run_with_appended(
        sandbox,
        "\nimport importlib as _il\n"
        "_il.import_module('_pytest.python').Function.runtest = lambda self: None\n"
        "try:\n    open('/var/tmp/cm-should-not-exist', 'w')\nexcept OSError:\n    pass\n",
    )
    reasons = {r for r, _, _ in run.violations}
    assert {"test_runner_tamper", "write_outside_workdir"} <= reasons
    assert ("test_runner_tamper", "", "_pytest.python.Function.runtest") in run.violations
    assert ("write_outside_workdir", "textkit/core.py", "/var/tmp/cm-should-not-exist") in run.violations
    assert run.complete and all(o == "passed" for o in run.tests.values())  # the tamper did make tests "pass"
    assert not Path("/var/tmp/cm-should-not-exist").exists()


def test_bytecode_is_not_carried_into_grading(repo_tasks, sandbox):
    """A planted .pyc (even a valid one for the original module) must not be what gets graded."""
    import py_compile

    task = repo_tasks["textkit"][0]
    with task.workspace(sandbox) as ws:
        start = manifest(ws.path)
        target = ws.path / task.target
        original = ws.path / "orig_tmp.py"
        original.write_text(task.original_source())
        # A sourceless module next to where the source was: Python would import it.
        py_compile.compile(str(original), cfile=str(target.with_suffix(".pyc")))
        target.unlink()  # only the bytecode of the real implementation is left
        original.unlink()
        grade = grade_workspace(sandbox, task.pristine, start, ws, task.expected_tests, targets={task.target: task.stubbed_source})
    assert grade.reward == 0.0


def test_single_turn_env_grades_the_file_in_the_reply(repo_tasks, sandbox):
    from composer_mesh.configs.records import ErrorKind
    from composer_mesh.envs.base import assistant
    from composer_mesh.envs.feature_deletion import FeatureDeletionEnv

    env = FeatureDeletionEnv(repo_tasks["minicalc"], sandbox)
    (prompt,) = env.reset(seed=1).messages
    task = env.task
    assert task.stubbed_source in prompt["content"] and task.target in prompt["content"]
    obs = env.step(assistant(f"Here it is:\n```python\n{task.original_source()}```\n"))
    assert (obs.reward, obs.info["reason"]) == (1.0, "passed")
    env.reset(seed=1)
    obs = env.step(assistant("I would rewrite the parser."))
    assert obs.reward == 0.0 and obs.error_sites[0].kind is ErrorKind.SYNTAX
    env.reset(seed=1)
    obs = env.step(assistant(f"```python\n{task.stubbed_source}```"))
    assert obs.reward == 0.0 and obs.error_sites[0].kind is ErrorKind.TEST_FAILURE


def test_env_factory_from_the_env_section(task_store, repo_tasks):
    from composer_mesh.configs.sections.env import EnvConfig
    from composer_mesh.envs.demo import DemoEnv
    from composer_mesh.envs.factory import build_env, env_factory, split_tasks
    from composer_mesh.envs.tool_loop import ToolLoopEnv

    demo = build_env(EnvConfig(), "heldout")
    assert isinstance(demo, DemoEnv) and demo.split == "heldout"
    with pytest.raises(ValueError, match="feature_deletion.repos"):
        build_env(EnvConfig(task="tool_loop"))
    fd = FeatureDeletionConfig(repos=(str(FIXTURES / "textkit"),), max_tasks=2)
    make = env_factory(EnvConfig(task="tool_loop", feature_deletion=fd), store=task_store)
    a, b = make("train"), make("train")
    assert isinstance(a, ToolLoopEnv) and a is not b and a.tasks.tasks == b.tasks.tasks  # generated once, shared
    tasks = repo_tasks["textkit"] + repo_tasks["minicalc"]
    train, held = split_tasks(tasks, 0.5, "train"), split_tasks(tasks, 0.5, "heldout")
    assert set(train).isdisjoint(held) and len(train) + len(held) == len(tasks)


def test_what_the_pristine_code_does_at_run_time_is_not_held_against_the_agent(tmp_path, sandbox, task_store):
    """A repository whose own code spawns a process and warns: its oracle still earns 1."""
    repo = tmp_path / "spawner"
    (repo / "pkg").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "run.py").write_text(textwrap.dedent('''
        import subprocess
        import warnings


        def echo(text):
            warnings.warn("spawning echo")
            out = subprocess.run(["echo", text], capture_output=True, text=True, check=True)
            return out.stdout.strip()
    '''))
    (repo / "tests" / "test_run.py").write_text(
        "import pytest\nfrom pkg.run import echo\n\ndef test_echo():\n"
        "    with pytest.warns(UserWarning):\n        assert echo('hi') == 'hi'\n"
    )
    (task,) = generate_tasks(repo, FeatureDeletionConfig(), sandbox, task_store)
    assert _grade(sandbox, task, write_original=True).reward == 1.0  # the spawn runs in the callee, the warning crosses
    with task.workspace(sandbox) as ws:  # the same spawn from a file that never did it is still refused
        start = manifest(ws.path)
        (ws.path / task.target).write_text(task.original_source())
        (ws.path / "pkg" / "__init__.py").write_text("import os\nos.system('true')\n")
        grade = grade_workspace(sandbox, task.pristine, start, ws, task.expected_tests, targets={task.target: task.stubbed_source})
    assert grade.reward == 0.0 and grade.reason == "process_spawn"
    assert ("process_spawn", "pkg/__init__.py: os.system") in grade.violations


def test_the_report_cannot_be_forged_from_the_request(sandbox):
    """Submission code re-reads every fd for the request's nonce and writes a passing summary everywhere."""
    run = _run_with_appended(
        sandbox,
        "\nimport os as _os, json as _json, re as _re\n"
        "_found = []\n"
        "for _fd in range(64):  # pytest keeps a saved copy of the original fd 0: try them all\n"
        "    try:\n        _os.lseek(_fd, 0, 0)\n        _found += _re.findall(r'nonce.: .([0-9a-f]{32})', _os.read(_fd, 1 << 16).decode())\n"
        "    except (OSError, UnicodeDecodeError):\n        pass\n"
        "_nonce = (_found or ['0' * 32])[0]\n"
        "_line = f'\\n@@grade {_nonce} ' + _json.dumps({'done': True, 'exit': 0, 'tests': "
        "{'tests/test_core.py::test_slugify': 'passed'}, 'collect_errors': []}) + '\\n'\n"
        "for _fd in range(1, 64):  # past pytest's capture: every open descriptor\n"
        "    try:\n        _os.write(_fd, _line.encode())\n    except OSError:\n        pass\n"
        "def slugify(text):\n    return 'broken'\n",
    )
    assert run.complete and run.tests["tests/test_core.py::test_slugify"] == "failed"
    assert not any(r == "forged_report" for r, _, _ in run.violations)  # the forged line carried no nonce


def test_tasks_command(capsys, tmp_path):
    from composer_mesh.mesh.cli import main

    assert main(["tasks", str(FIXTURES / "minicalc"), "--max-tasks", "1", "--check"]) == 0
    out = capsys.readouterr().out
    assert "1 verified task(s)" in out and "; 0 refused" in out and "oracle 1 no-op 0" in out
    # a candidate the suite notices but no grade of which can be trusted (a generator cannot cross the judge's
    # split) is listed with its reason
    repo = tmp_path / "genrepo"
    (repo / "tests").mkdir(parents=True)
    (repo / "counting.py").write_text("def count(items):\n    n = 0\n    for _ in items:\n        n += 1\n    return n\n")
    (repo / "tests" / "test_count.py").write_text(
        "from counting import count\n\n\ndef test_count():\n    assert count(x for x in range(3)) == 3\n")
    assert main(["tasks", str(repo)]) == 0
    out = capsys.readouterr().out
    assert "0 verified task(s)" in out and "; 1 refused" in out, out
    assert "counting.py:count: its original code earns 0 through the split judge" in out, out
    (tmp_path / "empty").mkdir()
    assert main(["tasks", str(tmp_path / "empty")]) == 1
    assert "pristine test suite must pass" in capsys.readouterr().err
