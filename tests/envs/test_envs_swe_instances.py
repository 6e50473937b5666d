"""`composer-mesh swe-instances` and its pieces (envs/swe_commits.py, envs/swe_rows.py) on a real git repository.

The repository `calc` is made once, one commit per case after its base (whose `add` subtracts):
a good fix (a test that fails, one whose module does not import before the fix, one that passes
throughout), a notes-only commit, a tests-only one, one whose new test fails with the fix, a
refactor whose test passes before it, one whose row fails validation (a test that passes run by
module but not by node id, as grades run it), and one whose test part is only a conftest.py. The
command runs once over the whole history; its rows and lines are checked case by case. Real git,
real pytest in the bubblewrap sandbox.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

from composer_mesh.envs.swe_commits import git_toplevel, read_fix, resolve_commits, split_patch
from composer_mesh.mesh.cli import main

BASE = {
    "calc/__init__.py": "def add(a, b):\n    return a - b\n\n\ndef double(x):\n    return 2 * x\n",
    "tests/test_calc.py": "from calc import add, double\n\n\ndef test_double():\n    assert double(3) == 6\n",
}
FIXED = "def add(a, b):\n    return a + b\n\n\ndef double(x):\n    return 2 * x\n"
# each case: the files its commit writes (None deletes one) and its message
CASES = {
    "fix": ({
        "calc/__init__.py": FIXED + "\n\ndef triple(x):\n    return 3 * x\n",
        "tests/test_calc.py": BASE["tests/test_calc.py"] + "\n\ndef test_add():\n    assert add(2, 3) == 5\n",
        "tests/test_triple.py": "from calc import triple\n\n\ndef test_triple():\n    assert triple(2) == 6\n",
    }, "add(2, 3) returns -1\n\nadd subtracts; it must add. triple is new."),
    "notes": ({"NOTES.md": "notes\n"}, "notes"),
    "tests_only": ({"tests/test_more.py": "from calc import double\n\n\ndef test_zero():\n    assert double(0) == 0\n"},
                   "one more test"),
    "fails_after": ({
        "calc/half.py": "def half(x):\n    return x // 2\n",
        "tests/test_half.py": "from calc.half import half\n\n\ndef test_half():\n    assert half(3) == 1.5\n",
    }, "half"),
    "passes_before": ({
        "calc/__init__.py": FIXED.replace("2 * x", "x + x") + "\n\ndef triple(x):\n    return 3 * x\n",
        "tests/test_more.py": None,
        "tests/test_double.py": "from calc import double\n\n\ndef test_double_again():\n    assert double(4) == 8\n",
    }, "double without a multiplication"),
    "by_node_id": ({
        "calc/neg.py": "def neg(x):\n    return -x\n",
        "tests/test_neg.py": "import sys\n\n\ndef test_neg():\n    from calc.neg import neg\n    assert neg(2) == -2\n\n\n"
                             "def test_run_by_module():\n    assert not any('::' in a for a in sys.argv)\n",
    }, "neg"),
    "conftest_only": ({"calc/neg.py": "def neg(x):\n    return 0 - x\n", "tests/conftest.py": "collect_ignore = []\n"},
                      "neg by subtraction"),
}


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _commit(repo: Path, files: dict[str, str | None], message: str) -> str:
    for rel, text in files.items():
        if text is None:
            (repo / rel).unlink()
        else:
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture(scope="module")
def calc(tmp_path_factory) -> dict:
    """The repository (`repo`), its commits by case (`base` and each of CASES), in order."""
    repo = tmp_path_factory.mktemp("repos") / "calc"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    commits = {"base": _commit(repo, BASE, "calc: add and double")}
    for case, (files, message) in CASES.items():
        commits[case] = _commit(repo, files, message)
    return {"repo": repo, "commits": commits}


@pytest.fixture(scope="module")
def command(calc, tmp_path_factory) -> dict:
    """`composer-mesh swe-instances calc main~7..main -o rows.jsonl` once: exit status, output lines, rows."""
    out = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["swe-instances", str(calc["repo"]), f"main~{len(CASES)}..main", "-o", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return {"rc": rc, "lines": stdout.getvalue().splitlines(), "stderr": stderr.getvalue(), "rows": rows, "out": out}


def _verdict(command: dict, calc: dict, case: str) -> str:
    """The command's last line about `case`'s commit (its row, or why there is none)."""
    short = calc["commits"][case][:12]
    return [line for line in command["lines"] if line.split(" ")[1:2] == [short]][-1]


def test_split_patch_puts_test_side_files_in_the_test_part(calc):
    commits = calc["commits"]
    diff = _git(calc["repo"], "diff-tree", "-p", "--no-renames", commits["base"], commits["fix"])
    patch, test_patch = split_patch(diff)
    assert _git(calc["repo"], "diff", commits["base"], commits["fix"], "--", "calc") == patch
    assert _git(calc["repo"], "diff", commits["base"], commits["fix"], "--", "tests") == test_patch
    fix = read_fix(calc["repo"], commits["fix"])
    assert (fix.patch, fix.test_patch, fix.base) == (patch, test_patch, commits["base"])
    assert fix.message == "add(2, 3) returns -1\n\nadd subtracts; it must add. triple is new."
    assert fix.subject == "add(2, 3) returns -1"
    # conftest.py and test configuration go with the tests; a name git would quote is refused
    extra = ("diff --git a/tests/conftest.py b/tests/conftest.py\n+x\n"
             "diff --git a/pyproject.toml b/pyproject.toml\n+y\n"
             "diff --git a/calc/test_data_reader.py b/calc/test_data_reader.py\n+z\n")
    assert split_patch(patch + extra) == (patch, extra)
    with pytest.raises(ValueError, match="cannot read the file names of 'diff --git a/read me.txt b/read me.txt'"):
        split_patch("diff --git a/read me.txt b/read me.txt\n+x\n")


def test_read_fix_names_what_a_commit_lacks(calc):
    repo, commits = calc["repo"], calc["commits"]
    with pytest.raises(ValueError, match="it has no parent: no base commit to start from"):
        read_fix(repo, commits["base"])
    with pytest.raises(ValueError, match=r"it changes no test file \(the test part: files under a tests/ or test/"):
        read_fix(repo, commits["notes"])
    with pytest.raises(ValueError, match="it changes only test files: no source part for the agent to write"):
        read_fix(repo, commits["tests_only"])


def test_commits_and_ranges_resolve_oldest_first(calc):
    repo, commits = calc["repo"], calc["commits"]
    assert resolve_commits(repo, ["main~7..main~5", "main", "HEAD"]) == [
        commits["fix"], commits["notes"], commits["conftest_only"]]
    assert resolve_commits(repo, [commits["fix"][:8], "main~6"]) == [commits["fix"]]
    with pytest.raises(ValueError, match=r"unknown commit 'nope' in .*calc"):
        resolve_commits(repo, ["nope"])
    with pytest.raises(ValueError, match=r"unknown commit range 'nope\.\.main' in .*calc: fatal"):
        resolve_commits(repo, ["nope..main"])
    with pytest.raises(ValueError, match=r"commit range 'main\.\.main' in .*calc holds no commit"):
        resolve_commits(repo, ["main..main"])


def test_only_a_repository_top_is_taken(calc, tmp_path):
    assert git_toplevel(calc["repo"]) == calc["repo"].resolve()
    with pytest.raises(ValueError, match="not a git repository"):
        git_toplevel(tmp_path)
    with pytest.raises(ValueError, match=r"calc/tests: not the top of a git repository \(that is .*calc\)"):
        git_toplevel(calc["repo"] / "tests")
    with pytest.raises(ValueError, match="no such directory"):
        git_toplevel(tmp_path / "missing")


def test_fail_to_pass_and_pass_to_pass_come_from_running_the_tests(command, calc):
    (row,) = command["rows"]
    commits = calc["commits"]
    assert row["instance_id"] == f"calc-{commits['fix'][:12]}" and row["repo"] == "calc"
    assert row["base_commit"] == commits["base"]
    assert row["problem_statement"] == CASES["fix"][1]
    # a failing test, and a module that did not import without the fix; the test that passed throughout
    assert json.loads(row["FAIL_TO_PASS"]) == ["tests/test_calc.py::test_add", "tests/test_triple.py::test_triple"]
    assert json.loads(row["PASS_TO_PASS"]) == ["tests/test_calc.py::test_double"]
    assert "tests/" not in row["patch"] and "calc/" not in row["test_patch"]
    verdict = _verdict(command, calc, "fix")
    assert f"row calc-{commits['fix'][:12]}: FAIL_TO_PASS 2, PASS_TO_PASS 1; gold patch earns 1, no patch 0" in verdict


@pytest.mark.parametrize("case, reason", [
    ("notes", "refused: it changes no test file (the test part: files under a tests/ or test/ directory"),
    ("tests_only", "refused: it changes only test files: no source part for the agent to write"),
    ("fails_after", "refused: 1 test(s) fail with the fix applied: tests/test_half.py::test_half"),
    ("passes_before", "refused: none of its 1 test(s) fails without the fix: nothing for FAIL_TO_PASS"),
    ("by_node_id", "refused: validation failed: the gold patch earns 0 (tests_failed (1/2 passed)), no patch 0 "
                   "(tests_failed (0/2 passed))"),
    ("conftest_only", "refused: its test part holds no test module to run (test_*.py or *_test.py)"),
])
def test_each_refused_commit_is_named_with_its_reason(command, calc, case, reason):
    assert reason in _verdict(command, calc, case), command["lines"]


def test_only_validated_rows_are_written_and_the_status_says_some_were_refused(command, calc):
    assert command["rc"] == 1, command["stderr"]
    assert [r["instance_id"] for r in command["rows"]] == [f"calc-{calc['commits']['fix'][:12]}"]
    assert command["lines"][-2] == f"wrote 1 row(s) to {command['out']}; 6 commit(s) refused. Train on them:"
    assert command["lines"][-1].startswith("  composer-mesh train configs/swe_cpu.toml --env.swe.instances=")
    # progress: a line as each commit that has a change to test starts
    assert sum("running its tests without and with the fix" in line for line in command["lines"]) == 5


def test_command_errors_before_any_commit(calc, tmp_path, capsys):
    assert main(["swe-instances", str(tmp_path), "HEAD"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: not a git repository"
    assert main(["swe-instances", str(calc["repo"]), "main", "nope", "-o", str(tmp_path / "rows.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"error: unknown commit 'nope' in {calc['repo'].resolve()}"
    assert not (tmp_path / "rows.jsonl").exists()
    assert main(["swe-instances", str(calc["repo"]), "main", "-o", str(tmp_path / "rows.jsonl")]) == 1
    out = capsys.readouterr()
    assert "refused: its test part holds no test module" in out.out and "rows.jsonl left as it was" in out.err
    assert not (tmp_path / "rows.jsonl").exists()
