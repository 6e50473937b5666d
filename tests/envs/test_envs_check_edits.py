"""`[env.tool_loop] check_edits`: the visible tests' verdict after every applied edit, and what builds on it.

The verdict is judged as the grade is (the pristine visible test file against
the submission), a failing one is an error site whose privileged feedback is
the failing test; the warm start's retry examples word their tool results as
the loop does and draw each edit independently of the task; the reference
teachers answer from the files as the context's own edits left them (an undone edit left nothing).
"""

from __future__ import annotations

import dataclasses
import json
import random

import httpx
import pytest

from composer_mesh.configs.records import ErrorKind
from composer_mesh.configs.sections.env import CodingConfig, EnvConfig, SandboxConfig, ToolLoopConfig
from composer_mesh.envs.micro import VISIBLE_TESTS, make_task
from composer_mesh.envs.safeguards import manifest
from composer_mesh.envs.sandbox import Sandbox
from composer_mesh.envs.tool_format import CLOSING, EXPRESSIONS, attempt_edits, tool_format_examples
from composer_mesh.envs.tool_loop import ToolLoopEnv
from composer_mesh.mesh.launch import HINT_FORMATS
from composer_mesh.replay.reference_teacher import DONE_TEXT, ReferenceResponder, edit_args, files_after
from composer_mesh.replay.server import TeacherServer

CHECKED = ToolLoopConfig(tools=("edit_file",), max_turns=4, check_edits="report")
REVERT = ToolLoopConfig(tools=("edit_file",), max_turns=4, check_edits="revert")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return Sandbox(SandboxConfig(root_dir=str(tmp_path_factory.mktemp("check-sandbox")), wall_timeout_s=90.0))


def ref_line(task) -> str:
    return next(x.strip() for x in task.reference_files()[task.target].splitlines() if x.strip().startswith("return "))


def wrong_line(task) -> str:
    right = ref_line(task)
    return next(w for w in ("return m + n", "return m - n", "return m * n") if w != right)


def edit(old: str, new: str, k: int = 0) -> dict:
    args = {"path": "m.py", "old": old, "new": new}
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{k}", "type": "function", "function": {"name": "edit_file", "arguments": json.dumps(args)}}]}


def task_of(seed: int):
    return make_task(CodingConfig(namings=(2,)), "train", seed)


def test_check_judges_the_pristine_visible_tests(sandbox):
    task = task_of(1)
    for body, passed in ((ref_line(task), True), (wrong_line(task), False), ("pass", False)):
        ws = task.workspace(sandbox)
        try:
            start = manifest(ws.path)
            target = ws.path / task.target
            target.write_text(target.read_text().replace("pass", body))
            if not passed:
                # the workspace's own copy of the visible tests made to pass: the verdict reads the pristine one
                (ws.path / VISIBLE_TESTS).write_text("def test_ok():\n    pass\n")
            check = task.check(sandbox, ws, start)
        finally:
            ws.cleanup()
        assert (check.reason == "passed") is passed, (body, check.reason, check.output)
        assert check.total == len(task.functions)


def test_check_edits_appends_the_verdict_and_marks_the_failure(sandbox):
    task = task_of(2)
    env = ToolLoopEnv([task], sandbox, CHECKED)
    env.reset(seed=0)
    wrong = env.step(edit("pass", wrong_line(task)))
    right = env.step(edit(wrong_line(task), ref_line(task), 1))
    end = env.step({"role": "assistant", "content": CLOSING})
    env.close()
    assert wrong.messages[0]["content"] == "edited m.py\nvisible tests: failed" and not wrong.done
    (site,) = wrong.error_sites
    # the teacher's feedback names the failing visible test; the hidden tests stay out of it
    assert site.kind == ErrorKind.TEST_FAILURE and f"{VISIBLE_TESTS}::test_" in site.feedback
    assert "test_hidden" not in site.feedback
    assert right.messages[0]["content"] == "edited m.py\nvisible tests: passed" and not right.error_sites
    assert end.done and end.reward == 1.0 and end.info["tool_errors"] == {"test_failure": 1}
    # off (the default), an edit answers as before
    plain = ToolLoopEnv([task], sandbox, ToolLoopConfig(tools=("edit_file",), max_turns=4))
    plain.reset(seed=0)
    assert plain.step(edit("pass", wrong_line(task))).messages[0]["content"] == "edited m.py"
    plain.close()


def test_revert_undoes_a_failing_edit_and_keeps_a_passing_one(sandbox):
    task = task_of(2)
    env = ToolLoopEnv([task], sandbox, REVERT)
    env.reset(seed=0)
    start = (env.ws.path / task.target).read_text()
    wrong = env.step(edit("pass", wrong_line(task)))
    after_wrong = (env.ws.path / task.target).read_text()
    # the next attempt edits the stub again (the failed line is gone)
    stale = env.step(edit(wrong_line(task), ref_line(task), 1))
    right = env.step(edit("pass", ref_line(task), 2))
    end = env.step({"role": "assistant", "content": CLOSING})
    env.close()
    assert wrong.messages[0]["content"] == "edited m.py\nvisible tests: failed; edit undone" and after_wrong == start
    assert wrong.error_sites[0].kind == ErrorKind.TEST_FAILURE
    assert stale.error_sites[0].kind == ErrorKind.BAD_TOOL_CALL
    assert right.messages[0]["content"] == "edited m.py\nvisible tests: passed"
    assert end.done and end.reward == 1.0


@pytest.mark.parametrize("loop", [CHECKED, REVERT], ids=["report", "revert"])
def test_retry_examples_word_results_as_the_loop_and_draw_edits_blind(sandbox, loop):
    tasks = [task_of(seed) for seed in range(30)]
    make = lambda split: ToolLoopEnv(tasks, sandbox, loop)  # noqa: E731
    conversations, _ = tool_format_examples(make, 60, seed=5, formats=HINT_FORMATS)
    firsts, repeats, retries = 0, 0, 0
    for messages in conversations:
        task = next(t for t in tasks if t.prompt() == messages[1]["content"])
        calls = [m for m in messages if m.get("tool_calls")]
        assert 1 <= len(calls) <= loop.max_turns - 1 and messages[-1] == {"role": "assistant", "content": CLOSING}
        edits = [json.loads(c["tool_calls"][0]["function"]["arguments"]) for c in calls]
        news = [e["new"] for e in edits]
        # a retry edits the line before, or the stub again when the loop undid the failed edit
        olds = ["pass"] * len(edits) if loop is REVERT else ["pass", *news[:-1]]
        assert [e["old"] for e in edits] == olds
        # it stops at the first right line, else after the attempts the turns leave
        assert all(n != ref_line(task) for n in news[:-1])
        assert news[-1] == ref_line(task) or len(news) == loop.max_turns - 1
        firsts += news[0] == ref_line(task)
        repeats += sum(a == b for a, b in zip(news, news[1:]))
        retries += len(news) - 1
    # right at chance (1/3 of 60) on the first edit, and a retry repeats the line before at chance too:
    # nothing of the task or of the failed line leaks into the draw
    assert 10 <= firsts <= 30 and 0.15 <= repeats / retries <= 0.55, (firsts, repeats, retries)
    # each example's tool results are what the real loop answers to its calls
    for messages in conversations[:6]:
        task = next(t for t in tasks if t.prompt() == messages[1]["content"])
        env = ToolLoopEnv([task], sandbox, loop)
        env.reset(seed=0)
        for k, m in enumerate(messages):
            if m.get("tool_calls"):
                assert env.step(m).messages[0]["content"] == messages[k + 1]["content"]
        env.close()


def test_attempt_edits_replace_the_line_before_or_the_stub():
    task = task_of(3)
    never = dataclasses.replace(task, signatures=tuple(dataclasses.replace(s, body=("no line of it",))
                                                       for s in task.signatures))
    edits = [e for e, ok in attempt_edits(never, 3, random.Random(0), edit_args, "report")]
    assert len(edits) == 3 and edits[0]["old"] == "pass"
    assert [e["old"] for e in edits[1:]] == [e["new"] for e in edits[:-1]]
    assert all(e["new"][len("return "):] in {x.format(a="m", b="n") for x in EXPRESSIONS} for e in edits)
    undone = [e for e, ok in attempt_edits(never, 3, random.Random(0), edit_args, "revert")]
    assert [e["old"] for e in undone] == ["pass"] * 3 and [e["new"] for e in undone] == [e["new"] for e in edits]
    # unchecked: each site edited once
    assert len(attempt_edits(never, 3, random.Random(0), edit_args, "off")) == 1


def test_reference_teachers_answer_from_the_edited_file(sandbox):
    task = task_of(4)
    start = {task.target: task.stubbed_source}
    lookup = {task.prompt(): (start, task.reference_files())}.get
    context = [{"role": "user", "content": task.prompt()}, edit("pass", wrong_line(task))]
    assert files_after(start, [("edit_file", {"path": "m.py", "old": "pass", "new": "x"})])["m.py"].count("x") == 1
    # an edit whose old text is missing changes nothing, as in the loop
    assert files_after(start, [("edit_file", {"path": "m.py", "old": "nowhere", "new": "x"})]) == start
    with TeacherServer(ReferenceResponder(lookup, noise=0.0)) as server:

        def ask(messages):
            r = httpx.post(f"{server.url}/chat/completions", json={"model": "local-a", "messages": messages}, timeout=30)
            r.raise_for_status()
            return r.json()["choices"][0]["message"]
        fix = ask(context)
        args = json.loads(fix["tool_calls"][0]["function"]["arguments"])
        done = ask(context + [edit(wrong_line(task), ref_line(task), 1)])
    assert args["old"].strip() == wrong_line(task) and args["new"].strip() == ref_line(task)
    assert files_after(start, [("edit_file", json.loads(context[1]["tool_calls"][0]["function"]["arguments"])),
                               ("edit_file", args)]) == task.reference_files()
    assert done["content"] == DONE_TEXT and not done.get("tool_calls")
    # a context whose failed edit the loop undid: the teacher edits the stub, as the file now holds it
    loop = ToolLoopEnv([task], sandbox, REVERT)
    loop.reset(seed=0)
    wrong = edit("pass", wrong_line(task))
    undone = [{"role": "user", "content": task.prompt()}, wrong, *loop.step(wrong).messages]
    loop.close()
    with TeacherServer(ReferenceResponder(lookup, noise=0.0)) as server:
        r = httpx.post(f"{server.url}/chat/completions", json={"model": "local-a", "messages": undone}, timeout=30)
    again = json.loads(r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert again["old"] == "pass" and again["new"].strip() == ref_line(task)


def test_a_failed_episode_names_the_failed_hidden_cases_and_the_written_line_for_the_teacher(sandbox):
    """The final info of a failed micro episode: `reference_change` (the line the reference writes, indented) and
    `failing_cases` (the `assert` lines of the hidden tests the workspace failed); `failure_sites` hands both to
    the hint teacher, and neither reaches the policy's messages or the workspace."""
    from composer_mesh.actors.rollout import Rollout, failure_sites

    task = task_of(6)
    env = ToolLoopEnv([task], sandbox, REVERT)
    env.reset(seed=0)
    right = env.step(edit("pass", ref_line(task)))
    passed = env.step({"role": "assistant", "content": CLOSING})
    assert right.messages[0]["content"].endswith("passed") and passed.reward == 1.0
    assert "reference_change" not in passed.info and "failing_cases" not in passed.info
    env.reset(seed=0)
    ws = env.ws.path
    env.step(edit("pass", wrong_line(task)))
    obs = env.step({"role": "assistant", "content": CLOSING})
    messages = list(env.state.messages)
    env.close()
    assert obs.done and obs.reward == 0.0
    assert obs.info["reference_change"] == f"--- m.py\n    {ref_line(task)}"
    cases = obs.info["failing_cases"].splitlines()
    hidden = [line.strip() for line in task.hidden["test_hidden.py"].splitlines() if line.strip().startswith("assert")]
    assert cases and set(cases) <= set(hidden) and len(cases) == len(hidden)  # the stub passes none of them
    rollout = Rollout(0, 0, 0, [1, 2], 1, [False, True], [0.0, 0.0], messages, [0] * len(messages),
                      [(2, 1, 2)], obs.reward, "done", 0, info=dict(obs.info))
    (site,) = failure_sites(rollout)
    assert site.change == obs.info["reference_change"] and site.cases == obs.info["failing_cases"]
    assert not any(ref_line(task) in str(m.get("content")) or cases[0] in str(m.get("content")) for m in messages)
    assert not ws.exists()


def test_check_edits_is_refused_where_no_task_has_visible_tests():
    for env in (dict(task="tool_loop"), dict(task="coding", coding=CodingConfig(sources=("repos",)))):
        with pytest.raises(ValueError, match="env.tool_loop.check_edits"):
            EnvConfig(tool_loop=CHECKED, **env)
    assert EnvConfig(task="coding", tool_loop=REVERT).tool_loop.check_edits == "revert"
    assert EnvConfig(task="tool_loop").tool_loop.check_edits == "off"
