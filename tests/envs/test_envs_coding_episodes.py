"""The coding main job's plumbing on a real repository task, real sandbox and the tiny tokenizer.

Episodes run through `actors.episodes.EpisodeRunner` (the production loop: chat
template with tools, `<tool_call>` parsing, tool results as `tool` messages) with
a scripted policy in place of the model, so each test knows what the episode did:
its grade reaches `Rollout.info`, per-step metrics count its tool errors, hints and
replay states come from its real failures, the coding teachers' reference passes
the hidden tests (their slip fails them), and the warm-start examples are
well-formed tool calls whose code is not the task's.
"""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from composer_mesh.actors.episodes import ChatTokens, EpisodeRunner, parse_assistant
from composer_mesh.actors.hf_engine import Completion
from composer_mesh.actors.rollout import EpisodeRequest, SamplingParams
from composer_mesh.actors.teacher_replay import rollout_states
from composer_mesh.configs.records import ErrorKind
from composer_mesh.envs.tool_format import CLOSING, tool_format_examples
from composer_mesh.envs.tool_loop import ToolLoopEnv
from composer_mesh.mesh.episode_metrics import episode_metrics, eval_pass_rates
from composer_mesh.mesh.packing import make_hint
from composer_mesh.replay.hints import TemplateHintGenerator
from composer_mesh.replay.reference_teacher import DONE_TEXT, ReferenceResponder, near_miss, write_calls
from composer_mesh.replay.server import TeacherServer
from composer_mesh.titan_ext.warmstart import sft_rows


@pytest.fixture(scope="module")
def tok(tiny_assets):
    return AutoTokenizer.from_pretrained(str(tiny_assets.tokenizer_dir))


@pytest.fixture(scope="module")
def task(repo_tasks):
    return repo_tasks["minicalc"][0]


def reference(task) -> dict[str, str]:
    return {task.target: (task.pristine / task.target).read_text()}


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
    runner = EpisodeRunner(ScriptedPolicy(tok, turns), tok, lambda split: ToolLoopEnv(tasks, sandbox),
                           max_turns=6, max_context_tokens=1 << 16)
    groups = runner.run([EpisodeRequest(group_id=0, seed=0)], group_size, SamplingParams(max_new_tokens=512), 0)
    return groups[0].rollouts


def test_episode_grade_failures_hints_and_metrics(tok, task, sandbox):
    files = reference(task)
    turns = [call_text("read_file", {"path": "no/such_file.py"}),
             call_text("write_file", {"path": task.target, "content": files[task.target]}), "Finished."]
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
    assert eval_pass_rates(rollouts[:1], rollouts)["eval/heldout_greedy_pass"] == 1.0


def test_failing_answer_is_replayed_and_counted(tok, task, sandbox):
    wrong = near_miss(reference(task)[task.target])
    rollouts = run_episodes(tok, [task], sandbox, [call_text("write_file", {"path": task.target, "content": wrong}),
                                                   "Finished."])
    r = rollouts[0]
    assert r.reward == 0.0 and r.info["passed"] < r.info["total"] and r.error_sites == []
    assert episode_metrics(rollouts)["coding/pass_rate"] == 0.0
    # no error site, but the grade failed: its first turn goes to the teachers
    (state,) = rollout_states(r)
    assert state.action["tool_calls"][0]["function"]["name"] == "write_file" and len(state.context) == 2
    # the demo's rollouts (no grade in info) add no coding metrics
    r.info = {"turns": 2}
    assert episode_metrics([r]) == {} and rollout_states(r) == []


def teacher_reply(url: str, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 4096}
    return httpx.post(f"{url}/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]


def grade_calls(task, sandbox, calls: list[dict]):
    env = ToolLoopEnv([task], sandbox)
    env.reset(seed=0)
    obs = env.step({"role": "assistant", "content": "", "tool_calls": calls})
    obs = env.step({"role": "assistant", "content": DONE_TEXT}) if not obs.done else obs
    env.close()
    return obs


def test_reference_teachers_over_loopback(task, sandbox):
    env = ToolLoopEnv([task], sandbox)
    start = env.reset(seed=0).messages
    env.close()
    lookup = {task.prompt(): reference(task)}.get
    with TeacherServer(ReferenceResponder(lookup, noise=0.0)) as exact, \
            TeacherServer(ReferenceResponder(lookup, noise=1.0)) as slipping:
        good = teacher_reply(exact.url, "local-a", start)
        bad = teacher_reply(slipping.url, "local-a", start)
        # after its write, the teacher closes the episode
        done = teacher_reply(exact.url, "local-a", start + [{"role": "assistant", "content": "", **good}])
        unknown = teacher_reply(exact.url, "local-a", [{"role": "user", "content": "another task"}])
    assert good["tool_calls"] == write_calls(reference(task))
    assert done["content"] == DONE_TEXT and not done.get("tool_calls")
    assert not unknown.get("tool_calls")
    assert grade_calls(task, sandbox, good["tool_calls"]).reward == 1.0
    assert grade_calls(task, sandbox, bad["tool_calls"]).reward == 0.0


def test_warm_start_examples_teach_the_format_not_the_task(tok, repo_tasks, sandbox):
    tasks = repo_tasks["minicalc"]
    conversations, tools = tool_format_examples(lambda split: ToolLoopEnv(tasks, sandbox), 12, seed=3)
    assert len(conversations) == 12 and [t["function"]["name"] for t in tools][:2] == ["read_file", "write_file"]
    targets = {t.target for t in tasks}
    references = {(t.pristine / t.target).read_text() for t in tasks}
    rows = sft_rows(tok, conversations, tools)
    for messages, (ids, mask) in zip(conversations, rows):
        assert messages[-1] == {"role": "assistant", "content": CLOSING}
        # the rendered call parses back as the tool loop will parse the model's text
        assistant_text = tok.decode([i for i, m in zip(ids, mask) if m]).split("<|im_end|>")[0]
        (call,) = parse_assistant(assistant_text)["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "write_file" and args["path"] not in targets
        assert args["content"] not in references and args["content"].startswith("def ")
        # the tools' schemas are in the rendered prompt
        assert '"name": "write_file"' in tok.decode(ids)
    # the same seed gives the same examples; another seed others
    assert tool_format_examples(lambda split: ToolLoopEnv(tasks, sandbox), 12, seed=3)[0] == conversations
    assert tool_format_examples(lambda split: ToolLoopEnv(tasks, sandbox), 12, seed=4)[0] != conversations
