"""The coding main job's plumbing on micro coding tasks, the real sandbox and the tiny tokenizer.

Episodes run through `actors.episodes.EpisodeRunner` (the production loop: chat
template with tools, `<tool_call>` parsing, tool results as `tool` messages) with
a scripted policy in place of the model, so each test knows what the episode did:
its grade reaches `Rollout.info`, per-step metrics count its tool errors, hints and
replay states come from its real failures, the coding teachers' reference passes
the hidden tests (their slip fails them), and the warm-start examples are
well-formed tool calls whose code is not the task's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import partial
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from composer_mesh.actors.episodes import ChatTokens, EpisodeRunner, parse_assistant
from composer_mesh.actors.pair_verify import PairVerifier, action_score
from composer_mesh.actors.hf_engine import Completion
from composer_mesh.actors.rollout import EpisodeRequest, SamplingParams
from composer_mesh.actors.teacher_replay import rollout_states
from composer_mesh.configs.records import ErrorKind
from composer_mesh.configs.sections.env import CodingConfig, EnvConfig, MicroVariant, SandboxConfig, ToolLoopConfig
from composer_mesh.envs.coding import reference_change, render_reference
from composer_mesh.envs.factory import env_factory
from composer_mesh.envs.micro import make_task, templates
from composer_mesh.envs.sandbox import Sandbox
from composer_mesh.envs.tool_format import CLOSING, EXPRESSIONS, edit_sites, tool_format_examples, warm_start_env
from composer_mesh.envs.tool_loop import ToolLoopEnv, offered_tools
from composer_mesh.mesh.episode_metrics import episode_metrics, eval_pass_rates
from composer_mesh.mesh.launch import HINT_FORMATS
from composer_mesh.mesh.packing import make_hint, pair_tokens
from composer_mesh.replay.hints import (
    FeedbackHintGenerator, ReferenceHintGenerator, TemplateHintGenerator, change_note, reference_note,
)
from composer_mesh.replay.pairs import PreferencePair
from composer_mesh.replay.reference_teacher import DONE_TEXT, ReferenceResponder, change_calls, files_after, near_miss
from composer_mesh.replay.server import TeacherServer
from composer_mesh.replay.traces import TraceState
from composer_mesh.titan_ext.warmstart import sft_rows


@pytest.fixture(scope="module")
def tok(tiny_assets):
    return AutoTokenizer.from_pretrained(str(tiny_assets.tokenizer_dir))


LOOP = ToolLoopConfig(tools=("read_file", "edit_file"), max_turns=6)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A sandbox whose wall limit leaves room for a loaded box (a grade took over 8 s on a shared 2-core
    machine); the limits themselves are tested in test_envs_sandbox.py."""
    config = SandboxConfig(root_dir=str(tmp_path_factory.mktemp("coding-sandbox")), wall_timeout_s=90.0)
    return Sandbox(config)


@pytest.fixture(scope="module")
def task():
    return make_task(CodingConfig(), "train", 0)


def reference(task) -> dict[str, str]:
    return task.reference_files()


def edit_text(task, files: dict[str, str]) -> str:
    """The model's text of the edit_file call(s) turning the task's stub into `files`."""
    calls = change_calls({task.target: task.stubbed_source}, files, "edit_file")
    return "\n".join(call_text(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls)


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


class ScriptedPolicy:
    """Answers turn k of every episode with `turns[k]` (the engine's interface; no model)."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.tok, self.turns, self.chat = tok, turns, ChatTokens(tok)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        out = []
        for ids in prompts:
            k = self.tok.decode(ids).count("<|im_start|>assistant") - 1
            reply = self.chat.encode(self.turns[k]) + [self.chat.end_id]
            out.append(Completion(reply, [-0.5] * len(reply), "stop"))
        return out


def run_episodes(tok, tasks, sandbox, turns: list[str], group_size: int = 2):
    runner = EpisodeRunner(ScriptedPolicy(tok, turns), tok, lambda split: ToolLoopEnv(tasks, sandbox, LOOP),
                           max_turns=6, max_context_tokens=1 << 16)
    groups = runner.run([EpisodeRequest(group_id=0, seed=0)], group_size, SamplingParams(max_new_tokens=512), 0)
    return groups[0].rollouts


def test_episode_grade_failures_hints_and_metrics(tok, task, sandbox):
    turns = [call_text("read_file", {"path": "no/such_file.py"}), edit_text(task, reference(task)), "Finished."]
    rollouts = run_episodes(tok, [task], sandbox, turns)
    r = rollouts[0]
    assert r.reward == 1.0 and r.info["turns"] == 3 and r.info["total"] >= 1 and r.info["passed"] == r.info["total"]
    assert r.info["grade_s"] > 0 and r.info["violations"] == []
    # the failed call came back as a tool message and an error site of its kind
    assert r.messages[3]["role"] == "tool" and "no such file" in r.messages[3]["content"]
    assert [s.kind for s in r.error_sites] == [ErrorKind.FILE_NOT_FOUND] and r.error_sites[0].tool == "read_file"
    m = episode_metrics(rollouts)
    assert m["coding/pass_rate"] == 1.0 and m["coding/turns"] == 3.0 and m["coding/multi_turn"] == 1.0
    assert m["coding/tool_errors/file_not_found"] == 2.0 and m["coding/violations"] == 0.0
    hint = make_hint(ChatTokens(tok), r, TemplateHintGenerator())
    assert hint is not None and "no/such_file.py" in hint.text and hint.site.kind is ErrorKind.FILE_NOT_FOUND
    states = rollout_states(r)
    assert len(states) == 1 and states[0].action["tool_calls"][0]["function"]["name"] == "read_file"
    rates = eval_pass_rates(rollouts[:1], [rollouts])
    assert rates["eval/heldout_greedy_pass"] == 1.0 and rates["eval/heldout_all_fail_share"] == 0.0
    # a pair's context is rendered with the run's tool schemas, as the episode's prompt was
    pair = pair_tokens(ChatTokens(tok), r.messages[:2], r.messages[4], r.messages[2], offered_tools(LOOP.tools))
    assert tok.decode(pair.prompt) == tok.decode(r.token_ids[: r.turn_spans[0][1]])
    assert tok.decode(pair_tokens(ChatTokens(tok), r.messages[:2], r.messages[4], r.messages[2]).prompt) != \
        tok.decode(r.token_ids[: r.turn_spans[0][1]])


def test_failing_answer_is_replayed_and_counted(tok, task, sandbox):
    wrong = {task.target: near_miss(reference(task)[task.target])}
    rollouts = run_episodes(tok, [task], sandbox, [edit_text(task, wrong), "Finished."])
    r = rollouts[0]
    assert r.reward == 0.0 and r.info["passed"] < r.info["total"] and r.error_sites == []
    assert episode_metrics(rollouts)["coding/pass_rate"] == 0.0
    # no error site, but the grade failed: its first turn is hinted (the grade's count, never the tests)
    # and goes to the teachers
    hint = make_hint(ChatTokens(tok), r, TemplateHintGenerator())
    assert hint is not None and hint.site.kind is ErrorKind.TEST_FAILURE and hint.site.turn == 2
    assert f'hidden tests: {r.info["reason"]}' in hint.text and "==" not in hint.text and "test_" not in hint.text
    # the privileged kinds give the teacher (only) the hidden tests' output, or the task's reference files
    assert r.info["feedback"].strip()
    feedback = make_hint(ChatTokens(tok), r, FeedbackHintGenerator(100_000))
    assert feedback.site.turn == 2 and r.info["feedback"].strip()[-300:] in feedback.text
    ref = make_hint(ChatTokens(tok), r, ReferenceHintGenerator(100_000))
    assert all(body.rstrip() in ref.text for body in reference(task).values())
    assert all(body.rstrip() not in str(m.get("content")) for m in r.messages for body in reference(task).values())
    (state,) = rollout_states(r)
    assert state.action["tool_calls"][0]["function"]["name"] == "edit_file" and len(state.context) == 2
    # the demo's rollouts (no grade in info) add no coding metrics
    r.info = {"turns": 2}
    assert episode_metrics([r]) == {} and rollout_states(r) == []


def test_hostile_tool_call_text_never_takes_the_batch_down(tok, task, sandbox):
    """The model writes calls whose name or string arguments hold a lone surrogate (a JSON escape), whose
    arguments nest past the JSON parser's depth, or whose path holds a NUL byte: the batch goes on (every
    message renders and tokenizes), each call is answered with its error, and the episode is solved and graded."""
    hostile = "\n".join([
        r'<tool_call>{"name": "read_\ud800", "arguments": {"path": "m.py"}}</tool_call>',
        r'<tool_call>{"name": "read_file", "arguments": "{\"path\": \"m\ud800.py\"}"}</tool_call>',
        '<tool_call>{"name": "read_file", "arguments": ' + "[" * 3000 + "]" * 3000 + "}</tool_call>",
        call_text("read_file", {"path": "m.py\x00"}),
    ])
    rollouts = run_episodes(tok, [task], sandbox, [hostile, edit_text(task, reference(task)), "Finished."])
    for r in rollouts:
        assert r.reward == 1.0 and r.info["turns"] == 3
        assert [s.kind for s in r.error_sites] == [ErrorKind.BAD_TOOL_CALL] * 3
        results = [m["content"] for m in r.messages if m["role"] == "tool"][:3]
        assert "unknown tool 'read_" in results[0] and "lone surrogate" in results[1] and "NUL" in results[2]
        assert all(json.dumps(m, ensure_ascii=False).encode("utf-8") for m in r.messages)


def teacher_reply(url: str, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 4096}
    return httpx.post(f"{url}/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]


def grade_calls(task, sandbox, calls: list[dict]):
    env = ToolLoopEnv([task], sandbox, LOOP)
    env.reset(seed=0)
    obs = env.step({"role": "assistant", "content": "", "tool_calls": calls})
    obs = env.step({"role": "assistant", "content": DONE_TEXT}) if not obs.done else obs
    env.close()
    return obs


def test_reference_teachers_over_loopback(task, sandbox):
    env = ToolLoopEnv([task], sandbox, LOOP)
    start = env.reset(seed=0).messages
    env.close()
    start_files = {task.target: task.stubbed_source}
    lookup = {task.prompt(): (start_files, reference(task))}.get
    with TeacherServer(ReferenceResponder(lookup, noise=0.0)) as exact, \
            TeacherServer(ReferenceResponder(lookup, noise=1.0)) as slipping:
        good = teacher_reply(exact.url, "local-a", start)
        bad = teacher_reply(slipping.url, "local-a", start)
        # after its write, the teacher closes the episode
        done = teacher_reply(exact.url, "local-a", start + [{"role": "assistant", "content": "", **good}])
        unknown = [teacher_reply(exact.url, m, [{"role": "user", "content": "another task"}]) for m in ("a", "b")]
    assert good["tool_calls"] == change_calls(start_files, reference(task), "edit_file")
    assert [c["function"]["name"] for c in good["tool_calls"]] == ["edit_file"]
    assert done["content"] == DONE_TEXT and not done.get("tool_calls")
    # an unknown task: no tool call, and two teachers never agree on it (no pair)
    assert not any(u.get("tool_calls") for u in unknown) and unknown[0]["content"] != unknown[1]["content"]
    assert grade_calls(task, sandbox, good["tool_calls"]).reward == 1.0
    assert grade_calls(task, sandbox, bad["tool_calls"]).reward == 0.0


def test_warm_start_examples_teach_the_format_not_the_task(tok, sandbox):
    tasks = [make_task(CodingConfig(), "train", seed) for seed in range(40)]
    make = lambda split: ToolLoopEnv(tasks, sandbox, ToolLoopConfig(tools=("edit_file",), max_turns=2))  # noqa: E731
    conversations, tools = tool_format_examples(make, 40, seed=3, formats=HINT_FORMATS)
    assert len(conversations) == 40 and [t["function"]["name"] for t in tools] == ["edit_file"]
    rows = sft_rows(tok, conversations, tools)
    right = 0
    for messages, (ids, mask) in zip(conversations, rows):
        assert messages[-1] == {"role": "assistant", "content": CLOSING} and messages[-2]["content"] == "edited m.py"
        # the rendered call parses back as the tool loop will parse the model's text
        assistant_text = tok.decode([i for i, m in zip(ids, mask) if m]).split("<|im_end|>")[0]
        (call,) = parse_assistant(assistant_text)["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "edit_file" and args["path"] == "m.py" and args["old"] == "pass"
        assert args["new"].startswith("return ")
        # which expression does not depend on the task: it is right about as often as chance
        task = next(t for t in tasks if t.prompt() == messages[1]["content"])
        right += "return " + args["new"][7:] in task.reference_files()[task.target]
        assert '"name": "edit_file"' in tok.decode(ids)
        # the expression is over the stub's own parameters
        params = re.search(r"def \w+\((\w+), (\w+)\)", task.stubbed_source).groups()
        assert set(re.findall(r"[a-z]\w*", args["new"][7:])) - {"max", "min"} <= set(params), (args, params)
    # chance is 1/len(EXPRESSIONS) of 40 (names always right); twice chance would mean the task leaked in
    assert 1 <= right <= 2 * 40 // len(EXPRESSIONS)
    # the same seed gives the same examples; another seed others
    assert tool_format_examples(make, 40, seed=3, formats=HINT_FORMATS)[0] == conversations
    assert tool_format_examples(make, 40, seed=4, formats=HINT_FORMATS)[0] != conversations


def test_warm_start_env_widens_the_ops_and_keeps_heldout_unseen(sandbox):
    env = EnvConfig(task="coding", coding=CodingConfig(namings=(2,), heldout_fraction=0.25,
                                                       warm_start_kinds=("arithmetic", "strings")))
    wide = warm_start_env(env)
    assert wide.coding.kinds == ("arithmetic", "strings") and wide.coding.ops_per_kind == 0
    assert warm_start_env(EnvConfig(task="coding")) == EnvConfig(task="coding")
    held = {t.id for t in templates(env.coding, "heldout")}
    seen = {t.id for t in templates(wide.coding, "train")}
    assert held and not held & seen
    assert {t.id for t in templates(env.coding, "train")} < seen
    with pytest.raises(ValueError, match="env.coding.warm_start_kinds"):
        warm_start_env(EnvConfig(task="coding", coding=CodingConfig(warm_start_kinds=("arithmetic", "poetry"))))
    # a validation carve (for choosing settings) leaves the warm start's prompts, and so the base, as they are
    carved = dataclasses.replace(env, coding=dataclasses.replace(env.coding, validation_fraction=0.2))
    assert warm_start_env(carved) == wide and {t.id for t in templates(carved.coding, "validation")} <= seen


def test_micro_teachers_edit_passes_and_slip_fails(sandbox):
    for seed in range(3):
        task = make_task(CodingConfig(), "train", seed)
        start = {task.target: task.stubbed_source}
        good = change_calls(start, task.reference_files(), "edit_file")
        bad = change_calls(start, {p: near_miss(t) for p, t in task.reference_files().items()}, "edit_file")
        assert json.loads(good[0]["function"]["arguments"])["old"] == "pass"
        assert grade_calls(task, sandbox, good).reward == 1.0 and grade_calls(task, sandbox, bad).reward < 1.0


def test_chosen_tool_call_is_tokenized_as_the_student_would_write_it(tok):
    """A teacher's call (API shape: compact JSON arguments, its own call id, no content, a reasoning key) is the
    student's action once parsed from the student's own tool-call text: the pair's chosen ids are the ids the
    student's chat template gives that message, and the student's rejected call keeps its ids."""
    chat = ChatTokens(tok)
    tools = offered_tools(LOOP.tools)
    context = [{"role": "system", "content": "Fix the function."}, {"role": "user", "content": "Make the tests pass."}]
    args = {"path": "pkg/util.py", "old": "return a - b", "new": "return a + b"}
    teacher = {"role": "assistant", "content": None, "reasoning": "the sign is wrong",
               "tool_calls": [{"id": "toolu_01AbC", "type": "function",
                               "function": {"name": "edit_file", "arguments": json.dumps(args, separators=(",", ":"))}}]}
    student_same = parse_assistant(call_text("edit_file", args))
    student_slip = parse_assistant(call_text("read_file", {"path": "pkg/util.py"}))
    pair = pair_tokens(chat, context, teacher, student_slip, tools)
    _, want_chosen = chat.prompt_and_action(context, student_same, tools)
    _, want_rejected = chat.prompt_and_action(context, student_slip, tools)
    assert list(pair.chosen) == want_chosen and list(pair.rejected) == want_rejected
    assert "edit_file" in tok.decode(pair.chosen) and "the sign is wrong" not in tok.decode(pair.chosen)
    # a teacher that wrote the call as text in the student's markup is the same action
    as_text = {"role": "assistant", "content": call_text("edit_file", args)}
    assert list(pair_tokens(chat, context, as_text, student_slip, tools).chosen) == want_chosen


def make_pair(state: TraceState, chosen: dict, rejected: dict) -> PreferencePair:
    return PreferencePair(trace_id=state.trace_id, step=state.step, context=state.context, chosen=chosen,
                          rejected=rejected, votes={}, agree=2, teachers=("a", "b"),
                          env_seed=state.env_seed, env_split=state.env_split)


@pytest.fixture(scope="module")
def coding(tmp_path_factory):
    return EnvConfig(task="coding", coding=CodingConfig(sources=("micro",)),
                     tool_loop=ToolLoopConfig(tools=("read_file", "edit_file"), max_turns=6),
                     sandbox=SandboxConfig(root_dir=str(tmp_path_factory.mktemp("verify-sandbox")), wall_timeout_s=90.0))


def test_pairs_from_a_rollout_are_verified_in_the_sandbox(tok, coding):
    make = env_factory(coding)
    env = make("train")
    env.reset(seed=3)
    task = env.task
    env.close()
    reference = task.reference_files()
    slip_files = {task.target: near_miss(reference[task.target])}
    # the student's episode: a failed read, then the right edit; its failed turn becomes a replay state
    turns = [call_text("read_file", {"path": "no/such_file.py"}), edit_text(task, reference), "Finished."]
    runner = EpisodeRunner(ScriptedPolicy(tok, turns), tok, make, max_turns=6, max_context_tokens=1 << 16)
    rollout = runner.run([EpisodeRequest(group_id=0, seed=3)], 1, SamplingParams(max_new_tokens=512), 0)[0].rollouts[0]
    assert rollout.reward == 1.0 and rollout.seed == 3 and rollout.split == "train"
    (state,) = rollout_states(rollout)
    assert state.env_seed == 3 and state.env_split == "train"
    # teachers answer in the API's shape (compact arguments, their own call ids)
    teacher_right = {"role": "assistant", "content": None, "tool_calls": [
        {**c, "id": f"toolu_{i}", "function": {**c["function"], "arguments": json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"))}}
        for i, c in enumerate(change_calls({task.target: task.stubbed_source}, reference, "edit_file"))]}
    teacher_slip = {"role": "assistant", "content": None,
                    "tool_calls": change_calls({task.target: task.stubbed_source}, slip_files, "edit_file")}
    student_right = parse_assistant(edit_text(task, reference))
    assert action_score(make, 3, "train", state.context, teacher_right) == 1.0
    assert action_score(make, 3, "train", state.context, state.action) == 0.0
    verifier = PairVerifier(partial(env_factory, coding))
    assert verifier.keep(make_pair(state, teacher_right, state.action))
    assert not verifier.keep(make_pair(state, teacher_slip, student_right))
    assert verifier.keep(make_pair(TraceState("trace.jsonl", 0, state.context, state.action), teacher_slip, student_right))
    assert dict(verifier.counts) == {"verified": 1, "refuted": 1, "unverifiable": 1}
    # every scored episode closed its workspace
    assert not list((Path(coding.sandbox.root_dir) / "composer-mesh-sandboxes").iterdir())


HARD_SOURCES = CodingConfig(
    namings=(2,), kinds=("arithmetic", "strings", "lists", "dicts", "control"), ops_per_kind=0, heldout_by="template",
    sources=("micro", "pair", "bugfix", "swe_mini"),
    variants=(MicroVariant(name="pair", functions_per_task=2), MicroVariant(name="bugfix", failing_visible_test=True),
              MicroVariant(name="swe_mini", shape="swe")))


def test_note_examples_write_exactly_what_the_note_shows(tok, tmp_path):
    """With `note_share = 1` every example holds a note right after the prompt (where the hint channel puts hints),
    in the hint channel's own formats, showing random code that is never the task's solution; its edits, applied
    as the tool loop applies them, make exactly that code (one edit per function, unique context where two stubs
    read `pass`), each answered as passing, then the episode closes."""
    env = EnvConfig(task="coding", coding=HARD_SOURCES, sandbox=SandboxConfig(root_dir=str(tmp_path)),
                    tool_loop=ToolLoopConfig(tools=("edit_file",), max_turns=4, check_edits="revert"))
    make = env_factory(env)
    conversations, tools = tool_format_examples(make, 48, seed=1, formats=HINT_FORMATS, note_share=1.0)
    kinds = set()
    # the edits replayed in the real loop with the check off: the note's random code fails the real visible tests,
    # and a revert would undo what the next edit's context expects (the notes' verdicts are those of a right note)
    loop = env_factory(dataclasses.replace(env, tool_loop=ToolLoopConfig(tools=("edit_file",), max_turns=4)))("train")
    for i, messages in enumerate(conversations):
        loop.reset(seed=1 * 1_000_003 + 10_000_019 + i)
        task = loop.task
        assert messages[:2] == loop.state.messages and messages[2]["role"] == "user"
        note = messages[2]["content"]
        edits = [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in messages if m.get("tool_calls")]
        start = {task.target: task.stubbed_source}
        final = files_after(start, [("edit_file", e) for e in edits])[task.target]
        sites = edit_sites(task)
        assert len(edits) == len(sites) and final != start[task.target]
        assert all(task.render({s.name: s.body}) != final for s in sites)  # never a site's solution
        if note.startswith("Here is a reference solution"):
            kinds.add("reference")
            assert note == reference_note(render_reference({task.target: final}))
        elif note.startswith("Hidden tests"):
            kinds.add("cases")
            ns: dict = {}
            exec(final, ns)
            for line in note.splitlines()[1:-1]:
                exec(line, ns)  # each case holds for the note's code
        else:
            kinds.add("change")
            change = reference_change(start, {task.target: final})
            shown = [change_note(change, k) for k in [None, *range(1, len(change.splitlines()) - 1)]]
            assert note in shown
        for k, m in enumerate(messages):
            if m.get("tool_calls"):
                assert loop.step(m).messages[0]["content"] == f"edited {task.target}"
                assert messages[k + 1]["content"] == f"edited {task.target}" + (
                    "\nvisible tests: passed" if hasattr(task, "check") else "")
        assert messages[-1] == {"role": "assistant", "content": CLOSING}
        loop.close()
    assert kinds == {"reference", "change", "cases"}
    rows = sft_rows(tok, conversations, tools)
    assert all(any(mask) for _, mask in rows)
    # no share: no note, and the same seed draws the same examples
    plain, _ = tool_format_examples(make, 12, seed=1, formats=HINT_FORMATS)
    assert not any(m[2]["role"] == "user" for m in plain)
    half, _ = tool_format_examples(make, 48, seed=1, formats=HINT_FORMATS, note_share=0.5)
    assert 12 <= sum(m[2]["role"] == "user" for m in half) <= 36


def test_the_hard_splits_base_spans_its_sources_and_is_one_for_every_loss(tmp_path):
    """configs/coding_hard_cpu.toml's warm start draws its prompts from the main job's source and every hard source
    (SWE mini instances among them), holds notes, and is the same conversations whatever loss channels a run then
    trains with (one base per recipe, so channel ablations start from one point)."""
    from composer_mesh.configs.loader import load_config

    overrides = ["--env.tool_loop.warm_start_examples=24", "--env.sandbox.pool_size=0",
                 f"--env.sandbox.root_dir={tmp_path}"]
    examples = []
    for extra in ([], ["--loss.alpha=0.25", "--loss.beta=0.25", "--trainer.eval_split=validation"]):
        job = load_config("configs/coding_hard_cpu.toml", overrides + extra)
        tl = job.env.tool_loop
        examples.append(tool_format_examples(env_factory(warm_start_env(job.env)), tl.warm_start_examples,
                                             tl.warm_start_seed, HINT_FORMATS, note_share=tl.warm_start_note_share,
                                             note_formats=tl.warm_start_note_formats))
    assert examples[0] == examples[1]
    prompts = {m[1]["content"].split("\n")[0] for m in examples[0][0]}
    assert any(p.startswith("Repository `acme/") for p in prompts) and any(p.startswith("Implement") for p in prompts)
    assert any(m[2]["role"] == "user" for m in examples[0][0])  # notes
