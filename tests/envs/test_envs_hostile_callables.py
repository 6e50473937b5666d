"""Hostile corpus, round 3 (issue 32), on a task whose tests pass callables in and get callables back.

The object cases (`OBJECT_CASES`) attack the proxies of the test's objects (`total_area` gets the test's
`Square`s) and the rebuilding of returned instances (`tokenize` returns `Token`s).

Each case is played through the single-turn env and the tool loop (new files only through the tool
loop, which can create them): shadowing the test runner, its plugins, the standard library and the
grader's own scripts; forged judge replies and callback requests; report-channel truncation; heap walks
for closures; code-object swaps; forged exception and warning names; answers that run into the
deadline. Each earns 0 with a named reason and leaves no workspace or cgroup of this sandbox behind.
Controls: every callable task's original code earns 1 and a wrong implementation 0, through both envs.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from composer_mesh.envs.base import assistant
from composer_mesh.envs.containment import CGROUP_ROOT, CONTROLLERS
from composer_mesh.envs.feature_deletion import FeatureDeletionEnv
from composer_mesh.envs.sandbox import Sandbox
from composer_mesh.envs.tool_loop import ToolLoopEnv

_OUT = "import os as _o, sys as _s\n_OUT = int(_s.argv[2])  # the callee's pipe to the judge\n"
_SUMMARY = '{"done": true, "exit": 0, "tests": {}, "collect_errors": []}'


def _redefine(helpers: str, body: str) -> str:
    """Module-level `helpers`, then `apply_all` redefined with `body` (a wrong answer unless the attack works)."""
    return f"\n{textwrap.dedent(helpers)}\ndef apply_all(fn, items):\n{textwrap.indent(textwrap.dedent(body), '    ')}"


def _forge_in_call(line: bytes) -> str:
    return _redefine(_OUT, f"_o.write(_OUT, {line!r})\nreturn list(items)\n")


# name -> (appended to the stubbed target, allowed reasons)
FILE_CASES = {
    "forged_describe_dunder": (
        _OUT + "_o.write(_OUT, b'{\"ok\": {\"d\": [[\"__class__\", [\"value\", 1]], [\"__dict__\", [\"value\", 2]]]}}\\n')\n",
        {"malformed_reply"},
    ),
    "forged_reply_bad_hex": (_forge_in_call(b'{"ok": {"b": "zz"}}\n'), {"malformed_reply"}),
    "forged_reply_deep_json": (_forge_in_call(b'{"ok": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"), {"malformed_reply"}),
    "forged_reply_unhashable_set": (_forge_in_call(b'{"ok": {"s": [[1], [2]]}}\n'), {"malformed_reply"}),
    "forged_callback_unknown_handle": (
        _redefine(_OUT, "_o.write(_OUT, b'{\"op\": \"call\", \"handle\": 987654, \"args\": [], \"kwargs\": {\"d\": []}}\\n')\n"
                        "return [fn(x) for x in items][::-1]\n"),
        {"malformed_reply"},
    ),
    "forged_callback_bool_handle_bad_kwargs": (
        _forge_in_call(b'{"op": "call", "handle": true, "args": [], "kwargs": {"d": [[1, 2]]}}\n'), {"malformed_reply"},
    ),
    "judge_rpc_through_callback_closure": (
        _redefine("", "peer = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))['peer']\n"
                      "for req in ({'op': 'describe', 'module': 'tests.test_hooks'},\n"
                      "            {'op': 'call', 'module': 'os', 'name': 'system', 'args': ['id'], 'kwargs': {'d': []}}):\n"
                      "    try:\n        print(peer.request(req))\n    except Exception:\n        pass\n"
                      "return list(items)\n"),
        {"malformed_reply", "test_runner_tamper", "dynamic_code", "reads_tests"},
    ),
    "report_truncate_rewind": (
        "\nimport os as _o\n_line = ('@@grade ' + '0' * 32 + ' ' + " + repr(_SUMMARY) + " + '\\n').encode()\n"
        "for _fd in range(3, 256):\n    try:\n        _o.ftruncate(_fd, 0)\n    except OSError:\n        pass\n"
        "    try:\n        _o.lseek(_fd, 0, 0)\n    except OSError:\n        pass\n"
        "    try:\n        _o.write(_fd, _line)\n    except OSError:\n        pass\n",
        {"malformed_reply", "tests_failed"},
    ),
    "heap_walk_for_judge_closures": (
        _redefine(
            "import types as _t\n_gc = __import__('g' + 'c')\n",
            "for o in _gc.get_objects():\n"
            "    if isinstance(o, _t.FunctionType) and o.__name__ in ('emit', 'violation', 'protocol_error'):\n"
            "        try:\n            o({'done': True, 'exit': 0, 'tests': {}, 'collect_errors': []})\n"
            "        except Exception:\n            pass\n"
            "    if hasattr(o, 'exported') and hasattr(o, 'out_fd'):  # the wire peer: answer for the judge\n"
            "        try:\n            o.exported.clear()\n            __import__('o' + 's').write(o.out_fd, b'{\"ok\": [2, 4, 6]}\\n')\n"
            "        except Exception:\n            pass\n"
            "return list(items)\n",
        ),
        {"dynamic_code", "test_runner_tamper", "malformed_reply", "tests_failed"},
    ),
    "code_object_swap_of_runner_and_wire": (
        "\nimport importlib as _il\n"
        "for _m, _f in (('_pytest.python', 'pytest_pyfunc_call'), ('_pytest.runner', 'call_and_report'), ('_wire', 'decode')):\n"
        "    try:\n        getattr(_il.import_module(_m), _f).__code__ = (lambda *a, **k: True).__code__\n"
        "    except Exception:\n        pass\n",
        # importing pytest inside the callee can run into the 8 s limit on a loaded box: also 0
        {"dynamic_code", "test_runner_tamper", "tests_failed", "timeout"},
    ),
    "forged_pytest_outcome_exception": (
        _redefine("class Skipped(Exception):\n    pass\n", "raise Skipped('@@grade ' + '0' * 32 + ' skipped')\n"),
        {"tests_failed"},
    ),
    "callable_always_equal_result": (
        _redefine(
            "class _Eq:\n    def __eq__(self, other):\n        return True\n    def __call__(self, *a, **k):\n"
            "        return self\n    __hash__ = None\n",
            "return _Eq()\n",
        ),
        {"tests_failed"},
    ),
    "forged_warning_category_flood": (
        _redefine("import warnings as _w\nclass AssertionError(UserWarning):\n    pass\n",
                  "for _ in range(1000):\n    _w.warn('@@grade ' + '0' * 32 + ' ' + " + repr(_SUMMARY) + ", AssertionError)\n"
                  "return list(items)\n"),
        {"tests_failed"},
    ),
    "wrong_answer_until_the_deadline": (_redefine("import time as _ti\n", "_ti.sleep(3600)\n"), {"timeout", "malformed_reply"}),
}

_WRONG_TARGET = _redefine("", "return list(items)\n")
# name -> ({path: content} written next to the wrong target, shell commands, allowed reasons)
TOOL_CASES = {
    "shadow_pytest_runner": (
        {"_pytest/__init__.py": "", "_pytest/runner.py": "def pytest_runtest_protocol(item, nextitem):\n    return True\n"},
        (), {"shadows_module"},
    ),
    "shadow_pytest_itself": ({"pytest.py": "def main(*a, **k):\n    return 0\n"}, (), {"shadows_module"}),
    "shadow_pluggy_plugin_manager": ({"pluggy/__init__.py": "class PluginManager:\n    pass\n"}, (), {"shadows_module"}),
    "shadow_stdlib_json": ({"json.py": f"def dumps(*a, **k):\n    return {_SUMMARY!r}\n"}, (), {"shadows_module"}),
    "shadow_stdlib_package": ({"encodings/__init__.py": "x = 1\n"}, (), {"shadows_module"}),
    "shadow_grader_wire": ({"_wire.py": "def decode(obj, *a, **k):\n    return [2, 4, 6]\n"}, (), {"shadows_module"}),
    "shadow_written_by_shell": ({}, ("python -c \"open('unittest.py', 'w').write('x = 1')\"",), {"shadows_module"}),
}

_WRONG = {
    "apply_all": "def apply_all(fn, items):\n    return list(items)\n",
    "retry": "def retry(fn, attempts):\n    return fn()\n",
    "compose": "def compose(*fns):\n    return fns[0] if fns else (lambda x: x)\n",
    "group_by": "def group_by(items, key):\n    return {key(i): [i] for i in items}\n",
    "parse_flag": "def parse_flag(text):\n    return text.strip().lower() == 'yes'\n",
}
_WRONG_OBJECTS = {
    "total_area": "def total_area(shapes):\n    return float(len(list(shapes)))\n",
    "tokenize": "def tokenize(source):\n    return [Token('name', source)]\n",
}


def _total_area(helpers: str, body: str) -> str:
    """`total_area` redefined (a wrong answer unless the attack works)."""
    return f"\n{textwrap.dedent(helpers)}\ndef total_area(shapes):\n{textwrap.indent(textwrap.dedent(body), '    ')}"


def _tokenize_forging(*replies: bytes) -> str:
    """`tokenize` that writes forged replies to the judge, then answers nothing useful."""
    return f"\n{_OUT}\ndef tokenize(source):\n" + "".join(f"    _o.write(_OUT, {r!r})\n" for r in replies) + "    return []\n"


def _token_state(pairs: str, module: str = "minicalc.lexer", qualname: str = "Token") -> bytes:
    return b'{"ok": [{"i": ["' + module.encode() + b'", "' + qualname.encode() + b'", ' + pairs.encode() + b']}]}\n'


# name -> (task symbol, appended to the stubbed target, allowed reasons)
OBJECT_CASES = {
    "proxy_walk_for_judge_internals": ("total_area", _total_area(_OUT, """\
        import gc
        seen = []
        for s in shapes:
            for name in ("__class__", "__dict__", "__globals__", "__self__", "__func__", "__init__", "__reduce_ex__"):
                try:
                    seen.append(getattr(s, name))
                except Exception:
                    pass
            try:
                seen.append(s.area.__closure__)
            except Exception:
                pass
        # the proxies hold only handle numbers: ask the judge for its object's class directly
        _o.write(_OUT, b'{"op": "object", "handle": 0, "action": "getattr", "args": ["__class__"]}\\n')
        return 0.0
        """), {"malformed_reply", "test_runner_tamper"}),
    "forged_object_handles": ("total_area", _total_area(_OUT, """\
        _o.write(_OUT, b'{"op": "object", "handle": 987654, "action": "len", "args": []}\\n')
        _o.write(_OUT, b'{"op": "object", "handle": true, "action": "bool", "args": []}\\n')
        _o.write(_OUT, b'{"op": "call", "handle": 0, "args": [], "kwargs": {"d": []}}\\n')
        _o.write(_OUT, b'{"op": "object", "handle": 0, "action": "system", "args": ["id"]}\\n')
        return 0.0
        """), {"malformed_reply"}),
    "proxy_dunder_write": ("total_area", _total_area(_OUT, """\
        for s in shapes:
            try:
                s.__class__ = int
            except Exception:
                pass
        _o.write(_OUT, b'{"op": "object", "handle": 0, "action": "setattr", "args": ["__class__", {"r": 0}]}\\n')
        return 0.0
        """), {"malformed_reply"}),
    "proxy_call_storm": ("total_area", _total_area("", """\
        total = 0.0
        for s in shapes:
            for _ in range(10**6):
                total = s.side
        return total
        """), {"malformed_reply"}),
    "returned_state_claims_dunders": ("tokenize", _tokenize_forging(
        _token_state('[["__class__", "x"], ["kind", "name"], ["text", "x1"]]'),
        _token_state('[["__dict__", {"d": []}], ["kind", "name"], ["text", "x1"]]'),
        _token_state('[["kind", "name"], ["text", "x1"], ["__eq__", {"c": 0}]]'),
    ), {"malformed_reply"}),
    "returned_instance_of_a_class_outside_the_targets": ("tokenize", _tokenize_forging(
        _token_state("[]", "os", "_wrap_close"),
        _token_state("[]", "minicalc.parser", "_Stream"),
        _token_state('[["kind", "name"]]', "minicalc.lexer", "dataclass"),
        _token_state('[["kind", "name"]]', "minicalc.lexer", "Token.__class__"),
    ), {"malformed_reply"}),
    "returned_state_oversized_or_deep": ("tokenize", _tokenize_forging(
        _token_state('[["kind", ' + "[" * 200 + "]" * 200 + '], ["text", "x"]]'),
        _token_state("[" + ", ".join(f'["a{i}", 1]' for i in range(5000)) + "]"),
        _token_state('[["kind", "name"]]'),
    ), {"malformed_reply"}),
}


@pytest.fixture(scope="module")
def tasks(callable_tasks):
    found, refused = callable_tasks
    return {t.symbols[0]: t for t in found}


def _play(env_kind: str, task, sandbox: Sandbox, target: str, files: dict | None = None, shell=()):
    """One episode: the single-turn env gets the target in a reply; the tool loop writes files and runs commands."""
    if env_kind == "single":
        env = FeatureDeletionEnv([task], sandbox)
        env.reset(seed=0)
        return env.step(assistant(f"```python\n{target}```"))
    env = ToolLoopEnv([task], sandbox)
    env.reset(seed=0)
    calls = [("write_file", {"path": p, "content": c}) for p, c in {task.target: target, **(files or {})}.items()]
    obs = env.step(assistant(tool_calls=calls + [("shell", {"command": c}) for c in shell]))
    assert not obs.done, obs.messages
    obs = env.step(assistant("done"))
    env.close()
    return obs


def _left_behind(sandbox: Sandbox, before: set) -> list:
    """This sandbox's cgroups still present (a live process keeps one) and workspaces not removed."""
    groups = [p for c in CONTROLLERS for p in (CGROUP_ROOT / c / "composer-mesh-sandbox").glob(f"{sandbox.tag}-*")]
    return groups + sorted(set(sandbox.root.iterdir()) - before)


def _check(obs, reasons: set, sandbox: Sandbox, before: set) -> None:
    assert obs.done and obs.reward == 0.0, obs.info
    reason = obs.info["reason"].split()[0]
    named = {r for r, _ in obs.info["violations"]}
    assert reason in reasons and (reason in named or reason == "tests_failed"), (obs.info["reason"], obs.info["violations"])
    assert obs.info["grade_s"] > 0
    assert _left_behind(sandbox, before) == []


@pytest.mark.parametrize("env_kind", ["single", "tool_loop"])
@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_attack_in_the_target_earns_zero(name, env_kind, tasks, sandbox):
    task = tasks["apply_all"]
    extra, reasons = FILE_CASES[name]
    before = set(sandbox.root.iterdir())
    _check(_play(env_kind, task, sandbox, task.stubbed_source + extra), reasons, sandbox, before)


@pytest.mark.parametrize("name", sorted(TOOL_CASES))
def test_new_files_that_shadow_modules_earn_zero(name, tasks, sandbox):
    task = tasks["apply_all"]
    files, shell, reasons = TOOL_CASES[name]
    before = set(sandbox.root.iterdir())
    obs = _play("tool_loop", task, sandbox, task.stubbed_source + _WRONG_TARGET, files, shell)
    _check(obs, reasons, sandbox, before)
    assert any(r == "shadows_module" for r, _ in obs.info["violations"])


@pytest.mark.parametrize("name", sorted(set(FILE_CASES) - {"wrong_answer_until_the_deadline"}))
def test_attacks_earn_zero_without_the_static_checks(name, tasks, sandbox, monkeypatch):
    """The static scan is an early signal only: switched off, the split judge still pays nothing."""
    monkeypatch.setattr("composer_mesh.envs.grading.scan_source", lambda new, old: [])
    task = tasks["apply_all"]
    obs = _play("single", task, sandbox, task.stubbed_source + FILE_CASES[name][0])
    assert obs.reward == 0.0 and obs.info["reason"].split()[0] in FILE_CASES[name][1] | {"tests_failed"}, obs.info


def test_shadowing_is_refused_whatever_its_content(tasks, sandbox):
    """Even with the correct answer, a new file shadowing the standard library is a violation."""
    task = tasks["apply_all"]
    obs = _play("tool_loop", task, sandbox, task.original_source(), {"json.py": "from_the_agent = True\n"})
    assert obs.reward == 0.0 and obs.info["reason"] == "shadows_module" and ("shadows_module", "json.py") in obs.info["violations"]


@pytest.mark.parametrize("env_kind", ["single", "tool_loop"])
def test_slow_correct_answer_is_reported_and_capped(env_kind, tasks, sandbox):
    """A correct answer that sleeps before answering: `grade_s` shows the cost; `slow_answer_s` zeroes it."""
    task = tasks["apply_all"]
    slow = task.original_source() + "\nimport time as _ti\n_ti.sleep(4)\n"
    capped = Sandbox(dataclasses.replace(sandbox.config, slow_answer_s=3.0))
    obs = _play(env_kind, task, capped, slow)
    assert obs.reward == 0.0 and obs.info["reason"] == "slow_answer" and obs.info["grade_s"] > 4.0, obs.info
    if env_kind == "single":  # uncapped, the same answer is paid, and its cost is visible
        obs = _play(env_kind, task, sandbox, slow)
        assert obs.reward == 1.0 and obs.info["grade_s"] > 4.0, obs.info


@pytest.mark.parametrize("env_kind", ["single", "tool_loop"])
@pytest.mark.parametrize("symbol", sorted(_WRONG))
def test_callable_task_controls(symbol, env_kind, tasks, sandbox):
    """Correct answer 1 and a wrong one 0, for every task whose tests pass (or get back) callables."""
    task = tasks[symbol]
    obs = _play(env_kind, task, sandbox, task.original_source())
    assert (obs.reward, obs.info["reason"]) == (1.0, "passed"), obs.info
    obs = _play(env_kind, task, sandbox, task.stubbed_source + "\n" + _WRONG[symbol])
    assert obs.reward == 0.0 and obs.info["reason"].startswith("tests_failed"), obs.info


def test_generator_probes_the_split_and_keeps_object_passing_tasks(callable_tasks, object_tasks):
    """`total_area` gets the test's own objects and `tokenize` returns `Token`s: both are graded across the split."""
    found, refused = callable_tasks
    assert sorted(t.symbols[0] for t in found) == sorted([*_WRONG, "total_area"]) and refused == []
    found, refused = object_tasks
    assert "tokenize" in {t.symbols[0] for t in found} and refused == []


@pytest.fixture(scope="module")
def object_task(tasks, object_tasks):
    return {"total_area": tasks["total_area"], "tokenize": next(t for t in object_tasks[0] if t.symbols == ("tokenize",))}


@pytest.mark.parametrize("env_kind", ["single", "tool_loop"])
@pytest.mark.parametrize("symbol", sorted(_WRONG_OBJECTS))
def test_object_task_controls(symbol, env_kind, object_task, sandbox):
    """Correct answer 1 and a wrong one 0 for tasks whose tests hand the solution objects or get objects back."""
    task = object_task[symbol]
    obs = _play(env_kind, task, sandbox, task.original_source())
    assert (obs.reward, obs.info["reason"], obs.info["violations"]) == (1.0, "passed", []), obs.info
    obs = _play(env_kind, task, sandbox, task.stubbed_source + "\n" + _WRONG_OBJECTS[symbol])
    assert obs.reward == 0.0 and obs.info["reason"].startswith("tests_failed"), obs.info


@pytest.mark.parametrize("env_kind", ["single", "tool_loop"])
@pytest.mark.parametrize("name", sorted(OBJECT_CASES))
def test_attack_on_object_proxies_earns_zero(name, env_kind, object_task, sandbox):
    """Each attack earns 0 and the judge itself names the violation (it never raises there)."""
    symbol, extra, reasons = OBJECT_CASES[name]
    task = object_task[symbol]
    before = set(sandbox.root.iterdir())
    obs = _play(env_kind, task, sandbox, task.stubbed_source + extra)
    _check(obs, reasons, sandbox, before)
    assert any(r == "malformed_reply" for r, _ in obs.info["violations"]), obs.info


def _refused(repo: Path, files: dict[str, str], sandbox, task_store) -> list:
    """generate_tasks over a repository made of `files`: it must give no task; what it refused, with reasons."""
    from composer_mesh.configs.sections.env import FeatureDeletionConfig
    from composer_mesh.envs.feature_deletion import generate_tasks

    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    refused: list = []
    assert generate_tasks(repo, FeatureDeletionConfig(), sandbox, task_store, refused) == []
    return refused


def test_a_task_whose_objects_cannot_cross_is_still_refused(tmp_path, sandbox, task_store):
    """A generator (not the repository's object, not plain data, not callable) cannot cross: refused, with the reason."""
    refused = _refused(tmp_path / "genrepo", {
        "counting.py": "def count(items):\n    n = 0\n    for _ in items:\n        n += 1\n    return n\n",
        "tests/test_count.py": "from counting import count\n\n\ndef test_count():\n    assert count(x for x in range(3)) == 3\n",
    }, sandbox, task_store)
    (name, reason), = refused
    assert name.endswith("counting.py:count") and "split judge" in reason and "test_count" in reason, refused


def test_a_task_whose_test_expects_the_judges_own_error_is_refused(tmp_path, sandbox, task_store):
    """A test expecting TypeError for a generator argument: the judge cannot pass the generator, and its failure is
    `grader_error`, never the TypeError the test expects (once, any answer passed it): the probe refuses the task."""
    refused = _refused(tmp_path / "raisesrepo", {
        "counting.py": (
            "def total(items):\n    if not isinstance(items, list):\n        raise TypeError('a list')\n"
            "    n = 0\n    for x in items:\n        n += x\n    return n\n"
        ),
        "tests/test_total.py": (
            "import pytest\nfrom counting import total\n\n\ndef test_total():\n    assert total([1, 2]) == 3\n\n\n"
            "def test_refuses_a_generator():\n    with pytest.raises(TypeError):\n        total(x for x in [1])\n"
        ),
    }, sandbox, task_store)
    (name, reason), = refused
    assert name.endswith("counting.py:total") and "grader_error" in reason, refused


def test_at_least_fifteen_new_hostile_kinds():
    assert len(FILE_CASES) + len(TOOL_CASES) + 1 >= 15  # + the slow correct answer


def test_a_virtualenv_reached_through_a_symlink_can_be_sandboxed(tmp_path):
    """The interpreter inside is found through the resolved prefix (the symlinked path does not exist there)."""
    link = tmp_path / "venv-link"
    link.symlink_to(os.path.realpath(sys.prefix), target_is_directory=True)
    exe = link / os.path.relpath(os.path.abspath(sys.executable), os.path.abspath(sys.prefix))
    code = (
        "import sys; from composer_mesh.envs.sandbox import Sandbox\n"
        "sb = Sandbox()\n"
        "assert sys.prefix.startswith(sys.argv[1]), sys.prefix\n"
        "with sb.workspace() as ws:\n"
        "    r = sb.run([sb.python(), '-c', 'import pytest, sys; print(sys.prefix)'], ws)\n"
        "print(r.exit_code, r.stdout.strip(), r.stderr[-300:])\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([str(exe), "-c", code, str(link)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root}, cwd=root)
    assert proc.returncode == 0, proc.stderr
    status, prefix = proc.stdout.split()[:2]
    assert status == "0" and prefix == os.path.realpath(sys.prefix), proc.stdout


def test_a_target_named_like_an_installed_module_is_refused(tmp_path, sandbox, task_store):
    """The judge never forwards a name the stdlib or site-packages provide, even when the repository owns it."""
    refused = _refused(tmp_path / "shadowrepo", {
        "pluggy.py": "def double(x):\n    y = x * 2\n    return y\n",
        "tests/test_double.py": (
            "import importlib.util, pathlib\n"
            "spec = importlib.util.spec_from_file_location('pluggy_local', pathlib.Path(__file__).parents[1] / 'pluggy.py')\n"
            "mod = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mod)\n\n"
            "def test_double():\n    assert mod.double(2) == 4\n"
        ),
    }, sandbox, task_store)
    assert refused and "provides" in refused[0][1], refused
