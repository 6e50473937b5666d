"""Micro grades by the judge's plain runner (no pytest): it reports what pytest reports, and hostile
candidates earn nothing through it, cold and through the warm pool (conftest POOLED_MODULES)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from composer_mesh.configs.sections.env import CodingConfig
from composer_mesh.envs import grading
from composer_mesh.envs.grading import grade_workspace
from composer_mesh.envs.micro import HIDDEN_TESTS, make_task, write_tree
from composer_mesh.envs.pool import SandboxPool
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.sandbox import processes_of

HARD = CodingConfig(functions_per_task=2, statements_per_body=2, distractor_files=1, package="pkg")

# What a judge would run instead of the runner if a candidate's patch reached it: a passing summary.
FORGED_RUNNER = (
    "import json, os, re, sys\n"
    "req = json.loads(sys.stdin.read())\n"
    f"src = open(os.path.join(req['repo'], '{HIDDEN_TESTS}')).read()\n"
    f"tests = {{'{HIDDEN_TESTS}::' + n: 'passed' for n in re.findall(r'^def (test_\\w+)', src, re.M)}}\n"
    "line = json.dumps({'done': True, 'exit': 0, 'tests': tests, 'collect_errors': []})\n"
    "os.write(req['channel_fd'], ('@@grade ' + req['nonce'] + ' ' + line + '\\n').encode())\n"
)
# In the callee: swap the worker's preloaded runner code (found up the stack, in the zygote's globals) for the
# forger and make the preloaded wire module decode everything as always-equal; report how much was patched.
PATCH_WORKER = (
    "import sys as _s\n"
    f"_FORGE = {FORGED_RUNNER!r}\n"
    "class _Eq:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
    "def _patch():\n"
    "    n, f, seen = 0, _s._getframe(), set()\n"
    "    while f is not None:\n"
    "        code = f.f_globals.get('_CODE')\n"
    "        if type(code) is dict and id(code) not in seen:\n"
    "            seen.add(id(code))\n"
    "            for k in list(code):\n"
    "                if k.endswith('_grade_runner.py'):\n"
    "                    code[k] = compile(_FORGE, k, 'exec')\n"
    "                    n += 1\n"
    "        f = f.f_back\n"
    "    w = _s.modules.get('_composer_wire')\n"
    "    if w is not None:\n"
    "        w.decode = lambda *a, **k: _Eq()\n"
    "        n += 1\n"
    "    return n\n"
    "def _answer(*a, **k):\n"
    "    raise ValueError(f'patched={_patch()}')\n"
)
_OUT = "import os as _o, sys as _s\n_OUT = int(_s.argv[2])  # the callee's pipe to the judge\n"
_SUMMARY = '{"done": true, "exit": 0, "tests": {}, "collect_errors": []}'

# name -> (code defining `_answer`, every task function returning `_answer(...)`; allowed reasons)
CASES = {
    "always_equal_object": (
        "class _Eq:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
        "def _answer(*a, **k):\n    return _Eq()\n", {"unplain_result"},
    ),
    "str_subclass_always_equal": (
        "class _S(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n"
        "def _answer(*a, **k):\n    return _S('')\n", {"unplain_result"},
    ),
    # exceptions that would end a runner which caught only Exception: every test still reported, failed
    "raise_system_exit": ("def _answer(*a, **k):\n    raise SystemExit(0)\n", {"tests_failed"}),
    "raise_keyboard_interrupt": ("def _answer(*a, **k):\n    raise KeyboardInterrupt\n", {"tests_failed"}),
    "exit_zero_in_call": ("import os as _o\ndef _answer(*a, **k):\n    _o._exit(0)\n", {"tests_failed", "exit_trick", "malformed_reply"}),
    "forged_describe": (
        _OUT + "_o.write(_OUT, b'{\"ok\": {\"d\": []}}\\n')\ndef _answer(*a, **k):\n    return 0\n",
        {"malformed_reply", "tests_failed"},
    ),
    "forged_summary_on_every_fd": (
        "import os as _o\n"
        f"def _answer(*a, **k):\n    for fd in range(3, 256):\n        try:\n"
        f"            _o.write(fd, b'@@grade 0 ' + {_SUMMARY!r}.encode() + b'\\n')\n"
        "        except OSError:\n            pass\n    return 0\n",
        {"malformed_reply"},
    ),
    "patch_worker_state": (PATCH_WORKER, {"tests_failed"}),
    "reach_other_processes": (
        "import os as _o\n"
        "def _answer(*a, **k):\n    found = []\n"
        "    for pid in [p for p in _o.listdir('/proc') if p.isdigit() and int(p) != _o.getpid()]:\n"
        "        for what in ('mem', 'environ', 'fd/0'):\n"
        "            try:\n                open(f'/proc/{pid}/{what}', 'rb').read(1)\n"
        "                found.append(f'{pid}/{what}')\n            except OSError:\n                pass\n"
        "    raise ValueError(f'found={found}')\n",
        {"tests_failed"},
    ),
}


def candidate(task, payload: str) -> str:
    """The stub (every function wrong) with `payload`, and every task function answering through it."""
    calls = "".join(f"\n\ndef {name}(*args, **kwargs):\n    return _answer(*args, **kwargs)\n" for name in task.functions)
    return task.stubbed_source + "\n\n" + payload + calls


def grade(task, backend, sources: dict[str, str], plain: bool = True):
    """Grade `sources` written over the task's workspace, by the plain runner or by pytest."""
    with task.workspace(backend) as ws:
        start = manifest(ws.path)
        for rel, text in sources.items():
            (ws.path / rel).write_text(text)
        pristine = ws.scratch / "pristine"
        write_tree(pristine, {**task.files, **task.reference, **task.hidden})
        return grade_workspace(backend, pristine, start, ws, task.expected_tests,
                               targets={task.target: task.stubbed_source}, plain=plain)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_candidate_earns_zero_through_the_plain_runner(name, sandbox, monkeypatch):
    """The static scan (an early signal only) is off: what holds is the split judge and its runner."""
    monkeypatch.setattr("composer_mesh.envs.grading.scan_source", lambda new, old: [])
    task = make_task(CodingConfig(), "train", 11)
    payload, reasons = CASES[name]
    before = set(sandbox.root.iterdir())
    with task.workspace(sandbox) as ws:
        start = manifest(ws.path)
        (ws.path / task.target).write_text(candidate(task, payload))
        result = task.grade(sandbox, ws, start)
        uid = ws.uid
    assert result.reward == 0.0, result
    assert result.reason.split()[0] in reasons, (result.reason, result.violations, result.output)
    if result.reason.startswith("tests_failed"):
        # the runner finished and reported every expected test (not an early exit)
        counts = [int(part.split()[0]) for part in result.output.strip().splitlines()[-1].split(", ")]
        assert sum(counts) == result.total == len(task.expected_tests), result.output
    if name == "patch_worker_state":
        # the patch did reach the callee's own copy of the worker's state (and stopped there)
        assert ("patched=2" if isinstance(sandbox, SandboxPool) else "patched=0") in result.output, result.output
    if name == "reach_other_processes":
        assert "found=[]" in result.output, result.output
    assert processes_of(uid) == []
    assert set(sandbox.root.iterdir()) == before  # agent, grading and task workspaces are gone


def test_plain_runner_reports_what_pytest_reports(sandbox):
    """Reference, stub, one function right, a raising candidate: the same grade by both runners."""
    task = make_task(HARD, "train", 2)
    ref, stub = task.reference[task.target], task.stubbed_source
    half = ref.split("\n\n\n")[0] + "\n\n\n" + "\n\n\n".join(stub.split("\n\n\n")[1:])
    raising = candidate(task, "def _answer(*a, **k):\n    raise ValueError('no')\n")
    for sources in ({task.target: ref}, {}, {task.target: half}, {task.target: raising}):
        by_pytest, by_plain = grade(task, sandbox, sources, plain=False), grade(task, sandbox, sources)
        assert (by_plain.reward, by_plain.reason, by_plain.passed, by_plain.total) == (
            by_pytest.reward, by_pytest.reason, by_pytest.passed, by_pytest.total), (by_plain, by_pytest.output)
    assert grade(task, sandbox, {task.target: half}).passed == HARD.hidden_tests_per_function


def _runner():
    """The grade runner script as a module (stdlib only; its `run_plain` is what the judge calls)."""
    spec = importlib.util.spec_from_file_location("_grade_runner_under_test", grading._RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_plain_collects_only_the_files_own_test_functions(tmp_path: Path, capsys):
    (tmp_path / "helper.py").write_text("def test_imported():\n    pass\n")
    (tmp_path / "test_a.py").write_text(
        "from helper import test_imported\n"
        "import sys\n"
        "sys.path.insert(0, '.')\n"
        "test_not_a_function = 3\n"
        "def test_ok():\n    assert 1 + 1 == 2\n"
        "def test_wrong():\n    assert 1 == 2\n"
        "def test_needs_a_fixture(tmp_path):\n    pass\n"
        "def test_exits():\n    raise SystemExit(0)\n"
        "def helper_not_a_test():\n    raise AssertionError\n"
    )
    (tmp_path / "test_broken.py").write_text("import no_such_module_here\n")
    runner = _runner()
    outcomes, errors = {}, []
    sys.path.insert(0, str(tmp_path))
    try:
        code = runner.run_plain(["test_a.py", "test_broken.py"], str(tmp_path), outcomes, errors)
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("test_a", "test_broken", "helper"):
            sys.modules.pop(name, None)
    assert outcomes == {
        "test_a.py::test_ok": "passed", "test_a.py::test_wrong": "failed",
        "test_a.py::test_needs_a_fixture": "failed", "test_a.py::test_exits": "failed",
    }
    assert errors == ["test_broken.py"] and code == 2
    out = capsys.readouterr().out
    assert "FAILED test_a.py::test_wrong - AssertionError" in out and "ERROR test_broken.py" in out
    assert out.strip().endswith("3 failed, 1 passed")
