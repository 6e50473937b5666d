"""Tool arguments a policy writes, through a real `ToolLoopEnv` on micro tasks in the real sandbox (issue 55).

Each class of argument that used to raise out of `env.step` (and lose the whole generate batch): NUL bytes
in paths, lone surrogates in text, paths and trees deeper than the recursion limit, sources nested past the
static scan, FIFOs / sockets / symlink loops / unreadable files / file names that are not UTF-8 made by a
program; then fuzzed calls (names, argument shapes, types, encodings, sizes, depths, counts). What must hold:
`step` returns, every call gets one tool message of valid UTF-8 text, a failed call changes nothing, a tree
or source past what can be walked or scanned grades 0 naming why, and the workspace and its uid go away.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from composer_mesh.configs.records import ErrorKind
from composer_mesh.configs.sections.env import CodingConfig, ToolLoopConfig
from composer_mesh.envs.base import assistant
from composer_mesh.envs.micro import MicroTasks
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.tool_loop import TOOL_NAMES, ToolLoopEnv

DEEPER_THAN_RECURSION = sys.getrecursionlimit() + 200
FILE_TOOLS = ("read_file", "write_file", "edit_file", "list_dir")


def micro_env(sandbox, **loop) -> ToolLoopEnv:
    loop.setdefault("max_turns", 1000)
    return ToolLoopEnv(MicroTasks(CodingConfig(), "train"), sandbox, ToolLoopConfig(**loop))


@pytest.fixture(scope="module")
def env(sandbox):
    e = micro_env(sandbox)
    yield e
    e.close()


def valid_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def assert_answers_in_valid_text(obs, calls: list) -> None:
    """One tool message per call, in order, and every string the model or a teacher reads is valid UTF-8."""
    assert [m["role"] for m in obs.messages] == ["tool"] * len(calls)
    for message in obs.messages:
        assert valid_utf8(message["content"]), message["content"][:200]
    for site in obs.error_sites:
        assert valid_utf8(site.message) and valid_utf8(site.feedback) and isinstance(site.kind, ErrorKind)


def shell(command: str) -> dict:
    return assistant(tool_calls=[("shell", {"command": command})])


def finish(env):
    """Close the episode (graded) and check that its workspace and uid lock are gone."""
    ws = env.ws
    obs = env.step(assistant("Done."))
    assert obs.done and not ws.path.exists() and not ws.scratch.exists()
    assert ws.uid_lock is None and not (env.sandbox.uid_locks / f"uid-{ws.uid}").exists()
    return obs


def test_a_nul_byte_in_a_path_is_a_bad_tool_call_naming_it(env):
    env.reset(seed=0)
    target = env.task.target
    start = manifest(env.ws.path)
    calls = [("read_file", {"path": target + "\x00"}), ("write_file", {"path": "a\x00.py", "content": "x"}),
             ("edit_file", {"path": "\x00" + target, "old": "pass", "new": "x"}), ("list_dir", {"path": ".\x00"})]
    obs = env.step(assistant(tool_calls=calls))
    assert_answers_in_valid_text(obs, calls)
    assert [s.kind for s in obs.error_sites] == [ErrorKind.BAD_TOOL_CALL] * 4
    assert all("NUL byte" in m["content"] for m in obs.messages)
    assert manifest(env.ws.path) == start
    finish(env)


def test_a_command_that_cannot_be_run_is_a_bad_tool_call_naming_why(env):
    """A NUL byte, only a comment (no program), an argument past the kernel's limit: each answered, none run."""
    env.reset(seed=0)
    commands = {"echo a\x00b": "nul byte", "# only a comment": "no program", "echo " + "a" * 200_000: "too long"}
    obs = env.step(assistant(tool_calls=[("shell", {"command": c}) for c in commands]))
    assert [s.kind for s in obs.error_sites] == [ErrorKind.BAD_TOOL_CALL] * len(commands)
    for message, why in zip(obs.messages, commands.values()):
        assert why in message["content"].lower(), message["content"][:200]
    finish(env)


def test_a_lone_surrogate_is_refused_before_any_file_is_touched(env):
    """The edit's text holds a lone surrogate: nothing is truncated or written, and the reason is named."""
    env.reset(seed=1)
    target = env.task.target
    start = manifest(env.ws.path)
    calls = [("edit_file", {"path": target, "old": "pass", "new": "return '\ud800'"}),
             ("write_file", {"path": target, "content": "x = '\udfff'\n"}),
             ("write_file", {"path": "new_\ud83d.py", "content": "x = 1\n"}),
             ("read_file", {"path": "\udcff" + target}),
             ("shell", {"command": "echo \ud800"})]
    obs = env.step(assistant(tool_calls=calls))
    assert_answers_in_valid_text(obs, calls)
    assert [s.kind for s in obs.error_sites] == [ErrorKind.BAD_TOOL_CALL] * len(calls)
    assert all("lone surrogate" in m["content"] for m in obs.messages), obs.messages
    assert manifest(env.ws.path) == start
    finish(env)


def test_write_paths_past_the_tree_bounds_are_refused_and_make_nothing(env):
    env.reset(seed=2)
    start = manifest(env.ws.path)
    deep = "d/" * DEEPER_THAN_RECURSION + "x.py"
    calls = [("write_file", {"path": deep, "content": "x = 1\n"}),
             ("write_file", {"path": "d/" * 65 + "x.py", "content": "x = 1\n"}),
             ("write_file", {"path": "e/" + "n" * 300 + "/x.py", "content": "x = 1\n"}),
             ("read_file", {"path": "f" * 5000})]
    obs = env.step(assistant(tool_calls=calls))
    assert_answers_in_valid_text(obs, calls)
    assert [s.kind for s in obs.error_sites] == [ErrorKind.BAD_TOOL_CALL] * len(calls)
    texts = [m["content"] for m in obs.messages]
    assert "deeper than 64 directories" in texts[1] and "too long" in texts[2].lower()
    assert manifest(env.ws.path) == start and not (env.ws.path / "d").exists()
    # what the failed write made of its path belongs to the workspace's uid, as everything the agent writes
    assert os.lstat(env.ws.path / "e").st_uid == env.ws.uid
    finish(env)


@pytest.mark.parametrize("check_edits", ["off", "revert"])
def test_a_tree_a_program_nests_past_the_recursion_limit_grades_zero_as_deep_tree(sandbox, check_edits):
    """The agent's program nests directories deeper than the recursion limit: every check and the final grade
    say `deep_tree` (reward 0), no step raises, and the tree, the workspace and its uid lock are removed."""
    env = ToolLoopEnv(MicroTasks(CodingConfig(namings=(2,)), "train"), sandbox,
                      ToolLoopConfig(max_turns=10, check_edits=check_edits))
    env.reset(seed=3)
    nest = f"import os; [os.mkdir('d') or os.chdir('d') for _ in range({DEEPER_THAN_RECURSION})]"
    obs = env.step(shell(f'python -c "{nest}"'))
    assert obs.error_sites == [], obs.messages
    target = env.task.target
    before = (env.ws.path / target).read_text()
    reference = env.task.reference_files()[target]
    obs = env.step(assistant(tool_calls=[("write_file", {"path": target, "content": reference})]))
    if check_edits == "revert":  # the check cannot walk the tree: a failed verdict, the edit undone
        assert obs.messages[0]["content"].endswith("visible tests: failed; edit undone")
        assert obs.error_sites[0].kind is ErrorKind.TEST_FAILURE
        assert (env.ws.path / target).read_text() == before
    obs = finish(env)
    assert obs.reward == 0.0 and obs.info["reason"] == "deep_tree"
    assert obs.info["violation_kinds"] == {"deep_tree": 1}
    env.close()


@pytest.mark.parametrize(("program", "bound"), [
    ("[open(f'f{i}.py', 'w').write('x = 1') for i in range(300)]", {"max_added_files": 100}),
    ("open('big.bin', 'wb').write(bytes(3 << 20))", {"max_added_mb": 2}),
])
def test_a_workspace_grown_past_its_bounds_is_not_graded(sandbox, program, bound):
    """What a grade reads grows with the tree (300 new modules, 3 MiB): past the episode's bounds neither a
    check nor the final grade reads it; both are 0 with `large_tree`, and the check's edit is undone."""
    env = ToolLoopEnv(MicroTasks(CodingConfig(namings=(2,)), "train"), sandbox,
                      ToolLoopConfig(max_turns=10, check_edits="revert", **bound))
    env.reset(seed=8)
    assert env.step(shell(f'python -c "{program}"')).error_sites == []
    target = env.task.target
    reference = env.task.reference_files()[target]
    obs = env.step(assistant(tool_calls=[("write_file", {"path": target, "content": reference})]))
    assert obs.messages[0]["content"].endswith("visible tests: failed; edit undone")
    assert "large_tree" in obs.error_sites[0].feedback
    obs = finish(env)
    assert obs.reward == 0.0 and obs.info["reason"] == "large_tree"
    assert obs.info["violation_kinds"] == {"large_tree": 1}
    env.close()


def test_special_files_a_program_makes_are_tool_errors_and_grading_does_not_block(env):
    """A symlink loop, a chain of links longer than the recursion limit, a FIFO, a unix socket, an unreadable
    file and a file name that is not UTF-8, each made by the agent's program: the file tools answer with an
    error or valid text, and the grade completes."""
    env.reset(seed=4)
    program = ("import os, socket; os.symlink('loop', 'loop'); os.mkfifo('fifo'); "
               f"[os.symlink(f'c{{i + 1}}', f'c{{i}}') for i in range({DEEPER_THAN_RECURSION})]; "
               "socket.socket(socket.AF_UNIX).bind('sock'); open('locked', 'w').write('x'); os.chmod('locked', 0); "
               "open(bytes([99, 97, 102, 233]) + b'.py', 'w').write('x = 1')")
    obs = env.step(shell(f'python -c "{program}"'))
    assert obs.error_sites == [], obs.messages
    calls = [("read_file", {"path": "c0"}), ("write_file", {"path": "c0", "content": "x"}),
             ("read_file", {"path": "loop"}), ("write_file", {"path": "loop", "content": "x"}),
             ("edit_file", {"path": "loop", "old": "a", "new": "b"}), ("list_dir", {"path": "loop"}),
             ("read_file", {"path": "fifo"}), ("write_file", {"path": "fifo", "content": "x"}),
             ("edit_file", {"path": "sock", "old": "a", "new": "b"}),
             ("write_file", {"path": "sock/x", "content": "x"}),
             ("list_dir", {})]
    obs = env.step(assistant(tool_calls=calls))
    assert_answers_in_valid_text(obs, calls)
    assert len(obs.error_sites) == len(calls) - 1  # all but the listing
    assert "caf\\xe9.py" in obs.messages[-1]["content"] and "fifo" in obs.messages[-1]["content"]
    obs = finish(env)
    assert obs.reward == 0.0 and obs.info["total"] > 0


def test_sources_nested_past_the_static_scan_are_graded_never_raised(env):
    """A module whose attribute chain is deeper than the recursion limit runs in Python, so the scan must read
    it (its `os.environ` is found); one nested past the parser's depth cannot be read, and is refused."""
    env.reset(seed=5)
    deep_attr = "import os\nx = os.environ" + ".b" * DEEPER_THAN_RECURSION + "\n"
    deep_sum = "x = " + "+".join(["1"] * 100_000) + "\n"
    calls = [("write_file", {"path": "deep_attr.py", "content": deep_attr}),
             ("write_file", {"path": "deep_sum.py", "content": deep_sum})]
    obs = env.step(assistant(tool_calls=calls))
    assert obs.error_sites == [], obs.messages
    obs = finish(env)
    assert obs.reward == 0.0
    kinds = obs.info["violation_kinds"]
    assert kinds.get("env_access") == 1 and kinds.get("unscannable_source") == 1, obs.info["violations"]


# --- fuzzed calls -----------------------------------------------------------------------------------------

_CHARS = st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                   st.sampled_from(["\x00", "/", ".", "\n", "'", '"', "|", "#", "\\"]))
_TEXT = st.text(_CHARS, max_size=24)
_PATHS = st.one_of(_TEXT, st.sampled_from([
    "m.py", "test_m.py", "test_hidden.py", ".", "..", "../..", "/etc/passwd", "", "a/b/c.py", "m.py/x",
    "d/" * 70 + "x.py", "d/" * DEEPER_THAN_RECURSION + "x.py", "n" * 300, "x" * 5000, "m.py\x00", "\ud800.py",
    "\udcff", "/proc/self/environ", "~/x", "$HOME/x",
]))
_VALUES = st.one_of(
    _PATHS, _TEXT, st.integers(), st.floats(allow_nan=True), st.none(), st.booleans(),
    st.lists(st.integers(), max_size=3), st.dictionaries(_TEXT, st.integers(), max_size=2),
    st.sampled_from(["a" * (2 << 20), "pass", "return 0", "def ", "\ud800" * 3, "x" * 200_000]),
)
_ARGS = st.dictionaries(st.sampled_from(["path", "content", "old", "new", "command", "x"]), _VALUES, max_size=4)
_COMMANDS = st.one_of(_TEXT, st.sampled_from([
    "ls", "ls -la", "cat m.py", "# only a comment", "'unclosed", "python -c 'print(1)'", "ls | cat", "rm -rf /",
    "echo " + "a" * 200_000, "find . -name '*.py'", "", "   ", "cat loop",
]))
_RAW = st.one_of(
    _ARGS.map(json.dumps),
    st.builds(lambda c: json.dumps({"command": c}), _COMMANDS),
    _TEXT,
    st.sampled_from(["[" * 5000, '{"path": ' + "[" * 3000 + "]" * 3000 + "}", "null", "[]", '"m.py"', "{", "1e999"]),
    _ARGS,
)
_NAMES = st.one_of(st.sampled_from(TOOL_NAMES), st.sampled_from(FILE_TOOLS), _TEXT)
_CALLS = st.one_of(
    st.builds(lambda n, r, i: {"id": i, "type": "function", "function": {"name": n, "arguments": r}},
              _NAMES, _RAW, st.one_of(st.text(max_size=8), st.integers())),
    st.sampled_from([None, 3, "call", [], {"function": None}, {"function": {"name": None}},
                     {"function": {"name": "read_file", "arguments": 5}}]),
)
_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
           HealthCheck.function_scoped_fixture]


@settings(max_examples=80, derandomize=True, database=None, deadline=None, suppress_health_check=_CHECKS)
@given(call=_CALLS)
def test_a_fuzzed_call_never_raises_and_a_failed_file_call_changes_nothing(env, call):
    env.reset(seed=6)
    start = manifest(env.ws.path)
    obs = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert_answers_in_valid_text(obs, [call])
    fn = call.get("function") if isinstance(call, dict) else None
    if obs.error_sites and isinstance(fn, dict) and fn.get("name") in FILE_TOOLS:
        assert manifest(env.ws.path) == start, obs.messages


@settings(max_examples=25, derandomize=True, database=None, deadline=None, suppress_health_check=_CHECKS)
@given(calls=st.lists(_CALLS, min_size=1, max_size=24), tool_calls=st.sampled_from(["list", "one", "text"]))
def test_fuzzed_messages_answer_every_call_within_the_bound_and_grade(sandbox, calls, tool_calls):
    """Messages of up to 24 fuzzed calls (or a `tool_calls` that is one call or text): each call gets its
    answer, the calls past `max_calls_per_message` are refused unrun, and the episode grades to a reward."""
    env = micro_env(sandbox, max_calls_per_message=4, max_turns=2)
    try:
        env.reset(seed=7)
        shape = {"list": calls, "one": calls[0], "text": "read_file m.py"}[tool_calls]
        obs = env.step({"role": "assistant", "content": "", "tool_calls": shape})
        answered = calls if tool_calls == "list" else [shape]
        assert_answers_in_valid_text(obs, answered)
        refused = [m for m in obs.messages if "not run: at most 4 tool calls run per message" in m["content"]]
        assert len(refused) == max(0, len(answered) - 4)
        obs = finish(env)
        assert 0.0 <= obs.reward <= 1.0 and obs.info["calls_refused"].get("calls_per_message", 0) == len(refused)
    finally:
        env.close()
