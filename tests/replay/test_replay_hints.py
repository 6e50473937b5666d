"""Error classification, hint generators and hint placement / token alignment."""

from __future__ import annotations

import pytest

from composer_mesh.configs.records import ErrorKind, ErrorSite
from composer_mesh.configs.sections.teachers import TeachersConfig, TeacherSpec
from composer_mesh.replay.hints import LLMHintGenerator, TemplateHintGenerator, classify_error, hint_token_spans, insert_hint
from composer_mesh.replay.server import FaultPlan, TeacherServer
from composer_mesh.replay.teachers import SyncTeacherClient

CASES = [
    ("bash: rg: command not found", "Bash", ErrorKind.COMMAND_NOT_FOUND),
    ("/bin/sh: 1: cargo: not found\nzsh: command not found: cargo", "Bash", ErrorKind.COMMAND_NOT_FOUND),
    ("cat: NOTES.md: No such file or directory", "Bash", ErrorKind.FILE_NOT_FOUND),
    ("FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'", "", ErrorKind.FILE_NOT_FOUND),
    ("File does not exist.", "Read", ErrorKind.FILE_NOT_FOUND),
    ("mkdir: cannot create directory '/opt/x': Permission denied", "Bash", ErrorKind.PERMISSION),
    ("PermissionError: [Errno 13] Permission denied: '/etc/passwd'", "", ErrorKind.PERMISSION),
    ('  File "a.py", line 3\n    def f(:\n          ^\nSyntaxError: invalid syntax', "Bash", ErrorKind.SYNTAX),
    ("bash: -c: line 1: syntax error near unexpected token `)'", "Bash", ErrorKind.SYNTAX),
    ("Command timed out after 2m 0.0s", "Bash", ErrorKind.TIMEOUT),
    ("FAILED test_calc.py::test_add - AssertionError\n1 failed, 2 passed in 0.03s", "Bash", ErrorKind.TEST_FAILURE),
    ("<tool_use_error>String to replace not found in file.</tool_use_error>", "Edit", ErrorKind.BAD_TOOL_CALL),
    ("InputValidationError: Read failed due to the following issue: The required parameter `file_path` is missing",
     "Read", ErrorKind.BAD_TOOL_CALL),
    ("Error: No such tool available: Browse", "Browse", ErrorKind.BAD_TOOL_CALL),
    ("The user doesn't want to proceed with this tool use.", "Bash", ErrorKind.OTHER),
]


@pytest.mark.parametrize("message,tool,kind", CASES)
def test_classify_error(message, tool, kind):
    assert classify_error(message, tool) == kind


MESSAGES = [
    {"role": "user", "content": "fix it"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "cat x"}'}},
        {"id": "b", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
    ]},
    {"role": "tool", "tool_call_id": "a", "content": "cat: x: No such file or directory", "is_error": True},
    {"role": "tool", "tool_call_id": "b", "content": "y"},
    {"role": "assistant", "content": "The file is y."},
]
SITE = ErrorSite(turn=1, kind=ErrorKind.FILE_NOT_FOUND, message="cat: x: No such file or directory", tool="Bash")


def test_template_hints_quote_the_error_and_differ_by_kind():
    gen = TemplateHintGenerator()
    hint = gen.hint(SITE, MESSAGES)
    assert "(Bash)" in hint and '"cat: x: No such file or directory"' in hint
    hints = {gen.hint(ErrorSite(1, kind, "boom", ""), MESSAGES) for kind in ErrorKind}
    assert len(hints) == len(ErrorKind)


def test_insert_hint_after_all_results_of_the_failed_turn():
    hinted = insert_hint(MESSAGES, SITE, "look first")
    assert hinted.hint_index == 4 and hinted.after_index == 3
    assert hinted.messages[4] == {"role": "user", "content": "look first"}
    assert hinted.messages[:4] == MESSAGES[:4] and hinted.messages[5:] == MESSAGES[4:]
    assert MESSAGES[4] == {"role": "assistant", "content": "The file is y."}  # input untouched
    # an environment that returns the result as a user message
    env = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "run x"}, {"role": "user", "content": "error: x"}]
    assert insert_hint(env, ErrorSite(1, ErrorKind.OTHER, "error: x"), "h").hint_index == 3
    with pytest.raises(ValueError, match="outside"):
        insert_hint(MESSAGES, ErrorSite(9, ErrorKind.OTHER, "m"), "h")


def test_hint_token_spans_align_with_a_real_chat_template(tiny_assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.tokenizer_dir))
    plain = [{"role": m["role"], "content": m["content"] or "call"} for m in MESSAGES]
    hinted = insert_hint(plain, SITE, "Check the path with ls before reading it.")

    student, teacher, spans = hint_token_spans(plain, hinted, tok.apply_chat_template)
    assert student == tok.apply_chat_template(plain, tokenize=True, return_dict=False)
    assert spans.hint_end - spans.hint_start == len(teacher) - len(student) > 0
    assert "Check the path with ls" in tok.decode(teacher[spans.hint_start : spans.hint_end])
    for j, t in enumerate(student):
        assert teacher[spans.student_to_hinted(j)] == t


def test_llm_hints_through_the_teacher_client(tmp_path):
    def mentor(model, messages, params):
        assert "No such file" in messages[-1]["content"]
        return "Run ls to see which files exist."

    with TeacherServer(mentor, model_faults={"down": FaultPlan(p_server_error=1.0)}) as server:
        cfg = TeachersConfig(
            models=(TeacherSpec(name="mentor", model="m"), TeacherSpec(name="broken", model="down")),
            base_url=server.url, max_retries=1, backoff_base_s=0.001,
        )
        client = SyncTeacherClient(cfg)
        try:
            assert LLMHintGenerator(client, "mentor").hint(SITE, MESSAGES) == "Run ls to see which files exist."
            fallback = LLMHintGenerator(client, "broken")
            assert fallback.hint(SITE, MESSAGES) == TemplateHintGenerator().hint(SITE, MESSAGES)
            assert fallback.fallbacks == 1
        finally:
            client.close()
    assert [r["outcome"] for r in server.log if r["model"] == "down"] == ["server_error"] * 2


# --- privileged hints: `[loss.distill] hint_kind` = feedback | reference ---

PRIVILEGED = ErrorSite(turn=1, kind=ErrorKind.TEST_FAILURE, message="1 failed", tool="run_tests",
                       feedback="FAILED test_calc.py::test_add\nassert add(2, 2) == 4\nE  assert 5 == 4",
                       reference="--- calc.py\ndef add(a, b):\n    return a + b")


def test_feedback_hint_holds_the_environments_feedback():
    from composer_mesh.replay.hints import FeedbackHintGenerator

    text = FeedbackHintGenerator().hint(PRIVILEGED, MESSAGES)
    assert PRIVILEGED.feedback in text and "(run_tests)" in text and PRIVILEGED.reference not in text
    # without privileged feedback, the error as the model saw it
    assert "1 failed" in FeedbackHintGenerator().hint(ErrorSite(1, ErrorKind.TEST_FAILURE, "1 failed"), MESSAGES)
    # long feedback keeps its tail (the failing assertion)
    cut = FeedbackHintGenerator(max_chars=13).hint(PRIVILEGED, MESSAGES)
    assert "assert 5 == 4" in cut and "FAILED" not in cut


def test_reference_hint_holds_the_reference_or_falls_back_to_feedback():
    from composer_mesh.replay.hints import ReferenceHintGenerator

    gen = ReferenceHintGenerator()
    text = gen.hint(PRIVILEGED, MESSAGES)
    assert PRIVILEGED.reference in text and PRIVILEGED.feedback not in text and gen.fallbacks == 0
    no_reference = ErrorSite(1, ErrorKind.TEST_FAILURE, "1 failed", feedback="E  assert 5 == 4")
    assert "E  assert 5 == 4" in gen.hint(no_reference, MESSAGES) and gen.fallbacks == 1
    assert ReferenceHintGenerator(max_chars=10).hint(PRIVILEGED, MESSAGES).count("def add") == 0


def test_hint_kind_selects_the_generator_and_bad_values_name_the_key():
    from composer_mesh.configs.loader import ConfigError, loads_config
    from composer_mesh.replay.hints import (
        FailingTestHintGenerator, FeedbackHintGenerator, ReferenceHintGenerator, ReferencePrefixHintGenerator,
        make_hint_generator,
    )

    kinds = {"template": TemplateHintGenerator, "feedback": FeedbackHintGenerator,
             "reference": ReferenceHintGenerator, "reference_prefix": ReferencePrefixHintGenerator,
             "failing_test": FailingTestHintGenerator}
    for kind, cls in kinds.items():
        job = loads_config(f'[loss.distill]\nhint_kind = "{kind}"')
        assert type(make_hint_generator(job.loss.distill, job.teachers)) is cls
    assert loads_config("").loss.distill.hint_kind == "template"  # today's behaviour stays the default
    job = loads_config('[loss.distill]\nhint_kind = "llm"\nhint_teacher = "t"\n[[teachers.models]]\nname = "t"\nmodel = "m"')
    llm = make_hint_generator(job.loss.distill, job.teachers)
    assert isinstance(llm, LLMHintGenerator) and llm.teacher == "t"
    with pytest.raises(ConfigError, match=r"loss\.distill\.hint_kind.*'bogus'"):
        loads_config('[loss.distill]\nhint_kind = "bogus"')
    with pytest.raises(ConfigError, match=r"loss\.distill\.hint_teacher"):
        loads_config('[loss.distill]\nhint_kind = "llm"')
    with pytest.raises(ConfigError, match=r"loss\.distill\.hint_teacher = 'nobody' names no \[\[teachers\.models\]\]"):
        loads_config('[loss.distill]\nhint_kind = "llm"\nhint_teacher = "nobody"')
    with pytest.raises(ConfigError, match=r"hint_teacher applies to hint_kind = 'llm' only"):
        loads_config('[loss.distill]\nhint_kind = "feedback"\nhint_teacher = "t"')


def test_llm_hint_prompt_carries_the_privileged_feedback():
    gen = LLMHintGenerator(client=None, teacher="t")  # prompt() only; no request is made
    body = gen.prompt(PRIVILEGED, MESSAGES)[1]["content"]
    assert "E  assert 5 == 4" in body


def test_change_and_cases_notes_show_what_they_are_given_and_cut_only_written_lines():
    from composer_mesh.replay.hints import cases_note, change_note

    change = "--- m.py\n    r1 = a + b\n    return r1 * c\n--- util.py\n    return x"
    full = change_note(change)
    assert full.splitlines()[1:-1] == change.splitlines() and full.startswith("Here are the lines")
    two = change_note(change, 2)
    # the first two written lines, and only the file header before them
    assert two.splitlines()[1:-1] == ["--- m.py", "    r1 = a + b", "    return r1 * c"]
    assert "first 2 of the 3 lines" in two
    assert change_note(change, 0).splitlines()[1:-1] == ["--- m.py"]
    assert change_note(change, 9) == full
    assert cases_note("assert f(2, 3) == 6\n").splitlines()[1] == "assert f(2, 3) == 6"


def test_failure_sites_carry_the_episodes_change_and_failing_cases():
    from composer_mesh.actors.rollout import Rollout, failure_sites

    info = {"total": 4, "reason": "tests_failed (1/4 passed)", "reference": "--- m.py\nx", "feedback": "FAILED t",
            "reference_change": "--- m.py\n    return a * b", "failing_cases": "assert f(2, 3) == 6"}
    rollout = Rollout(group_id=0, sample=0, seed=0, token_ids=[1, 2, 3], prompt_len=1, loss_mask=[False, True, True],
                      logprobs=[0.0] * 3, messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                      message_starts=[0, 1], turn_spans=[(1, 1, 3)], reward=0.25, finish_reason="done",
                      policy_version=0, error_sites=[], info=info)
    (site,) = failure_sites(rollout)
    assert (site.change, site.cases, site.reference) == (info["reference_change"], info["failing_cases"], "--- m.py\nx")
    tool_site = ErrorSite(turn=1, kind=ErrorKind.BAD_TOOL_CALL, message="bad", cases="own")
    (kept,) = failure_sites(Rollout(**{**rollout.__dict__, "error_sites": [tool_site]}))
    assert (kept.change, kept.cases) == (info["reference_change"], "own")


CHANGE = "--- m.py\n    a = x + 1\n    b = a * 2\n    c = b - 3\n--- util.py\n    return c"


def test_reference_prefix_reveals_an_adaptive_share_per_task():
    """k = ceil(s·n) of the n written lines; s starts at `start`, +step after an all-fail group of the task,
    −step after one with a pass, within [0, 1]; each task has its own s; a site without a change falls back."""
    from composer_mesh.replay.hints import ReferencePrefixHintGenerator, change_note

    site = ErrorSite(1, ErrorKind.TEST_FAILURE, "hidden tests: 0/3", feedback="E  assert 5 == 4", change=CHANGE)
    gen = ReferencePrefixHintGenerator(start=0.5, step=0.25)
    assert gen.hint(site, MESSAGES) == change_note(CHANGE, 2)  # ceil(0.5 · 4)
    expected = {"t": [], "u": []}
    for task, solved, share in (("t", False, 0.75), ("t", False, 1.0), ("t", False, 1.0), ("u", True, 0.25),
                                ("u", True, 0.0), ("t", True, 0.75)):
        gen.observe(task, solved)
        assert gen.share(task) == pytest.approx(share)
        expected[task].append(gen.for_task(task).hint(site, MESSAGES))
    assert expected["t"][:2] == [change_note(CHANGE, 3), change_note(CHANGE)]  # 0.75 · 4 = 3, then all
    assert expected["u"][-1] == change_note(CHANGE, 0)
    assert expected["t"][-1] == change_note(CHANGE, 3) and gen.share("never seen") == 0.5
    # the shares are the run's state
    again = ReferencePrefixHintGenerator(start=0.5, step=0.25)
    again.load_state_dict(gen.state_dict())
    assert again.for_task("t").hint(site, MESSAGES) == expected["t"][-1] and again.share("u") == 0.0
    # no change known: the feedback, counted
    bare = ErrorSite(1, ErrorKind.TEST_FAILURE, "hidden tests: 0/3", feedback="E  assert 5 == 4")
    assert "E  assert 5 == 4" in gen.for_task("t").hint(bare, MESSAGES) and gen.fallbacks == 1
    # the cap cuts the change before the lines are counted
    short = ReferencePrefixHintGenerator(start=1.0, max_chars=len("--- m.py\n    a = x + 1"))
    assert short.hint(site, MESSAGES) == change_note("--- m.py\n    a = x + 1")


def test_failing_test_hint_holds_the_failed_cases_or_falls_back():
    from composer_mesh.replay.hints import FailingTestHintGenerator, cases_note

    site = ErrorSite(1, ErrorKind.TEST_FAILURE, "hidden tests: 0/2", feedback="E  assert 5 == 4",
                     cases="assert add(2, 3) == 5\nassert add(0, 0) == 0", reference="def add(a, b): ...")
    gen = FailingTestHintGenerator()
    text = gen.hint(site, MESSAGES)
    assert text == cases_note(site.cases) and "def add" not in text and gen.fallbacks == 0
    assert FailingTestHintGenerator(max_chars=22).hint(site, MESSAGES) == cases_note("assert add(2, 3) == 5\n")
    bare = ErrorSite(1, ErrorKind.TEST_FAILURE, "hidden tests: 0/2", feedback="E  assert 5 == 4")
    assert "E  assert 5 == 4" in gen.hint(bare, MESSAGES) and gen.fallbacks == 1


def test_new_hint_kinds_and_their_keys():
    from composer_mesh.configs.loader import ConfigError, loads_config
    from composer_mesh.replay.hints import make_hint_generator

    job = loads_config('[loss.distill]\nhint_kind = "reference_prefix"\nhint_reveal_start = 0.25\nhint_reveal_step = 0.5')
    prefix = make_hint_generator(job.loss.distill, job.teachers)
    assert (prefix.start, prefix.step) == (0.25, 0.5)
    job = loads_config('[loss.distill]\nhint_kind = "failing_test"\nhint_max_chars = 99')
    assert make_hint_generator(job.loss.distill, job.teachers).max_chars == 99
    assert loads_config("").loss.distill.targets == "failed"  # today's behaviour stays the default
    for key, value in (("hint_reveal_step", "1.5"), ("targets", '"passed"'), ("rlsd_w_max", "0.9")):
        with pytest.raises(ConfigError, match=rf"loss\.distill\.{key}"):
            loads_config(f"[loss.distill]\n{key} = {value}")
