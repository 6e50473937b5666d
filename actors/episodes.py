"""The episode loop: environments from `envs/` driven by an engine, turn by turn, as tokens.

All active episodes of a turn are sampled in one engine batch. The token ids
of an episode are built piece by piece so they are exactly what the model saw
and produced: the rendered prompt, each sampled assistant turn as sampled
(its tokens carry loss and logprobs), and the chat-template text the
environment's answer adds (tool results, feedback, the next assistant header),
tokenized on its own. Template text is taken as the difference between
renderings of the message list before and after (the chat template renders
messages by concatenation), so tool calls parsed out of a reply never have to
re-render to the sampled text.

Assistant text becomes a message with OpenAI `tool_calls` when it contains the
template's `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.
"""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from composer_mesh.actors.hf_engine import Completion
from composer_mesh.actors.rollout import EpisodeRequest, Rollout, RolloutGroup, SamplingParams
from composer_mesh.envs.base import Environment, Observation, valid_text
from composer_mesh.envs.coding import render_reference
from composer_mesh.replay.hints import reference_note

logger = logging.getLogger(__name__)

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]: ...


def parse_assistant(text: str) -> dict[str, Any]:
    """An assistant message from generated text: content plus any well-formed tool calls.

    A block that is not JSON with a string `name` (nested past the parser's depth included) stays in the
    content (the environment then sees no call, which is what the model wrote). A name or string arguments
    holding a lone surrogate (a JSON escape such as "\\ud800") keep it as its escape: the chat template
    renders them, and the tokenizer cannot encode a lone surrogate.
    """
    calls, kept, last = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            args = obj.get("arguments", {}) if isinstance(obj, dict) else None
            arguments = args if isinstance(args, str) else json.dumps(args)
        except (ValueError, RecursionError):
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        calls.append({
            "id": f"call_{len(calls)}", "type": "function",
            "function": {"name": valid_text(obj["name"]), "arguments": valid_text(arguments)},
        })
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(kept).strip() if calls else text}
    if calls:
        msg["tool_calls"] = calls
    return msg


def student_action(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message in the shape `parse_assistant` gives the student's own turns: tool calls
    with ids call_0.., arguments re-serialised as the student's are (`json.dumps`), no extra keys
    (a teacher's `reasoning`, call ids, `None` content); calls written as text in the student's
    markup are parsed. The student's own messages come back unchanged, so a pair's chosen and
    rejected actions reach the chat template in one format."""
    calls = message.get("tool_calls") or []
    if not calls:
        return parse_assistant(str(message.get("content") or ""))
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                pass
        arguments = args if isinstance(args, str) else json.dumps(args)
        out.append({"id": f"call_{i}", "type": "function",
                    "function": {"name": valid_text(str(fn.get("name", ""))), "arguments": valid_text(arguments)}})
    return {"role": "assistant", "content": str(message.get("content") or "").strip(), "tool_calls": out}


def reference_note_of(env: Environment) -> str:
    """The hinted evaluation's note for the episode `env` just started: its task's reference files, worded as the
    hint channel's reference hints are (`replay.hints.reference_note`)."""
    task = getattr(env, "task", None)
    if task is None or not callable(getattr(task, "reference_files", None)):
        raise ValueError(f"a hinted episode needs a task with reference files; {type(env).__name__} has none "
                         "(trainer.eval_hinted is for coding tasks)")
    return reference_note(render_reference(task.reference_files()))


@dataclass
class _Episode:
    request: EpisodeRequest
    sample: int
    env: Environment
    tools: list[dict] | None
    ids: list[int]
    mask: list[bool]
    logps: list[float]
    starts: list[int]
    spans: list[tuple[int, int, int]]
    prompt_len: int
    finish: str = ""
    turns: int = 0
    # the environment's info at the end of the episode (a coding task's grade: passed, total, grade_s, violations)
    final: dict[str, Any] | None = None


class Tokenizer(Protocol):
    eos_token: str

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any: ...
    def __call__(self, text: str, **kwargs: Any) -> Any: ...
    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...


class ChatTokens:
    """Token ids of chat-template pieces: whole renderings, and the text one step of a chat adds.

    `delta(before, after)` is the rendering of `after` minus that of `before` (a
    prefix when the template renders by concatenation, else ValueError), so
    pieces can be tokenized on their own and appended to ids already sampled.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.end_text = tokenizer.eos_token
        self.end_id = self.encode(self.end_text)[-1]

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list[dict], tools: list[dict] | None = None, generation: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)

    def delta(self, before: list[dict], after: list[dict], tools: list[dict] | None = None,
              generation: bool = False) -> str:
        old = self.render(before, tools) if before else ""
        new = self.render(after, tools, generation)
        if not new.startswith(old):
            raise ValueError("the chat template does not render messages by concatenation; cannot extend tokens")
        return new[len(old):]

    def prompt_and_action(self, context: list[dict], message: dict,
                          tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """Ids of `context` (rendered with `tools`' schemas, as the episode's prompt was) with the assistant
        header, and of `message`'s content through its end token."""
        prompt_text = self.render(context, tools, generation=True)
        head = prompt_text[len(self.render(context, tools)):] if context else prompt_text
        text = self.delta(context, context + [message], tools)
        if not text.startswith(head):
            raise ValueError("the chat template renders the assistant header differently with content")
        ids = self.encode(text[len(head):])
        return self.encode(prompt_text), ids[: ids.index(self.end_id) + 1] if self.end_id in ids else ids


class EpisodeRunner:
    """Runs episodes of `make_env()` environments with an engine and a chat tokenizer.

    max_turns: assistant turns per episode; max_context_tokens: an episode whose
    next prompt would leave fewer than `max_new_tokens` free ends ("context"); when
    that is the first prompt, nothing is sampled and a warning names the request.
    step_workers: environments stepped at once after a turn (1 = one after another).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, make_env: Callable[[str], Environment],
                 max_turns: int, max_context_tokens: int, step_workers: int = 1) -> None:
        self.engine = engine
        self.tok = tokenizer
        self.chat = ChatTokens(tokenizer)
        self.make_env = make_env
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        self.pool = ThreadPoolExecutor(step_workers, thread_name_prefix="env-step") if step_workers > 1 else None

    def _start(self, request: EpisodeRequest, sample: int) -> _Episode:
        env = self.make_env(request.split)
        obs = env.reset(seed=request.seed, episode_id=f"{request.group_id}:{sample}")
        if request.hinted:
            env.add_note(reference_note_of(env))
        tools = obs.info.get("tools") or None
        messages = env.state.messages
        ids: list[int] = []
        starts: list[int] = []
        # per-message pieces when the rendering allows it
        for i in range(len(messages)):
            try:
                piece = self.chat.delta(messages[:i], messages[: i + 1], tools, generation=False)
            except ValueError:
                starts, ids = [-1] * len(messages), self.chat.encode(self.chat.render(messages, tools))
                break
            starts.append(len(ids))
            ids += self.chat.encode(piece)
        ep = _Episode(request, sample, env, tools, ids, [False] * len(ids), [0.0] * len(ids), starts, [], len(ids))
        self._open_turn(ep)
        return ep

    def _open_turn(self, ep: _Episode) -> None:
        """Append the assistant header; the next message (the reply) starts there."""
        messages = ep.env.state.messages
        ep.starts.append(len(ep.ids))
        header = self.chat.delta(messages, messages, ep.tools, generation=True)
        self._append(ep, self.chat.encode(header))

    @staticmethod
    def _append(ep: _Episode, ids: list[int], logps: list[float] | None = None) -> None:
        ep.ids += ids
        ep.mask += [logps is not None] * len(ids)
        ep.logps += logps if logps is not None else [0.0] * len(ids)

    def _record_turn(self, ep: _Episode, done: Completion) -> tuple[int, dict[str, Any]]:
        """Record the sampled turn; returns its message index and the assistant message parsed from it."""
        start = len(ep.ids)
        self._append(ep, done.token_ids, done.logprobs)
        text_ids = done.token_ids[:-1] if done.finish_reason == "stop" else done.token_ids
        # close the turn so the context stays well-formed (no loss)
        if done.finish_reason == "length":
            self._append(ep, [self.chat.end_id])
        message_index = len(ep.env.state.messages)
        ep.spans.append((message_index, start, start + len(done.token_ids)))
        return message_index, parse_assistant(self.tok.decode(text_ids, skip_special_tokens=False))

    def _step_all(self, episodes: list[_Episode], actions: list[dict[str, Any]]) -> list[Observation]:
        """Each episode's environment answers its action; up to `step_workers` at once (sandboxed tool runs and
        grading wait on other processes), each environment stepped by one thread only. Environments of one
        class with a batched step (`Environment.step_many`: a dataset task's rewards over the whole batch, as
        TRL calls them) are stepped together."""
        kind = type(episodes[0].env)
        if all(type(e.env) is kind for e in episodes):
            batched = kind.step_many([e.env for e in episodes], actions)
            if batched is not None:
                return batched
        if self.pool is None or len(episodes) < 2:
            return [e.env.step(a) for e, a in zip(episodes, actions)]
        return list(self.pool.map(lambda ea: ea[0].env.step(ea[1]), zip(episodes, actions)))

    def _finish_turn(self, ep: _Episode, message_index: int, obs: Observation) -> None:
        """After the environment's answer: append it and the next header (or end the episode)."""
        ep.turns += 1
        if obs.done:
            ep.final = dict(obs.info)
        messages = ep.env.state.messages
        rendered = self.chat.render(messages[: message_index + 1], ep.tools)
        # template text after the reply
        tail = rendered[rendered.rfind(self.chat.end_text) + len(self.chat.end_text):]
        self._append(ep, self.chat.encode(tail))
        if ep.env.state.done:
            ep.finish = "done"
            return
        if ep.turns >= self.max_turns:
            ep.finish = "max_turns"
            return
        for i in range(message_index + 1, len(messages)):
            ep.starts.append(len(ep.ids))
            self._append(ep, self.chat.encode(self.chat.delta(messages[:i], messages[: i + 1], ep.tools, generation=False)))
        self._open_turn(ep)

    def run(self, requests: Sequence[EpisodeRequest], group_size: int, sampling: SamplingParams,
            policy_version: int) -> list[RolloutGroup]:
        """`group_size` episodes per request, all sampled in lock-step turns."""
        episodes = [self._start(r, k) for r in requests for k in range(group_size)]
        try:
            turn = 0
            while True:
                active = [e for e in episodes if not e.finish]
                for e in active:
                    if len(e.ids) + sampling.max_new_tokens > self.max_context_tokens:
                        e.finish = "context"
                        if e.turns == 0 and e.sample == 0:
                            self._report_long_prompt(e, sampling.max_new_tokens)
                active = [e for e in active if not e.finish]
                if not active:
                    break
                step = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k,
                                      sampling.max_new_tokens, sampling.seed * 1009 + turn)
                completions = self.engine.generate([e.ids for e in active], step)
                recorded = [self._record_turn(e, done) for e, done in zip(active, completions)]
                observations = self._step_all(active, [action for _, action in recorded])
                for e, (message_index, _), obs in zip(active, recorded, observations):
                    self._finish_turn(e, message_index, obs)
                turn += 1
            return self._groups(requests, episodes, group_size, policy_version)
        finally:
            for e in episodes:
                e.env.close()

    def _report_long_prompt(self, ep: _Episode, max_new_tokens: int) -> None:
        """Say, as it happens, that a request's prompt leaves no room for its first turn (nothing is sampled)."""
        logger.warning("request %d (seed %d, %s): prompt of %d tokens + generator.max_new_tokens %d exceeds the "
                       "context budget trainer.max_seq_len %d; no tokens sampled: raise trainer.max_seq_len",
                       ep.request.group_id, ep.request.seed, ep.request.split, len(ep.ids), max_new_tokens,
                       self.max_context_tokens)

    def _groups(self, requests, episodes: list[_Episode], group_size: int, version: int) -> list[RolloutGroup]:
        groups = []
        for gi, request in enumerate(requests):
            rollouts = []
            for e in episodes[gi * group_size : (gi + 1) * group_size]:
                state = e.env.state
                rollouts.append(Rollout(
                    group_id=request.group_id, sample=e.sample, seed=request.seed, token_ids=e.ids,
                    prompt_len=e.prompt_len, loss_mask=e.mask, logprobs=e.logps,
                    messages=list(state.messages),
                    message_starts=(e.starts + [-1] * len(state.messages))[: len(state.messages)],
                    turn_spans=e.spans, reward=float(state.reward or 0.0), finish_reason=e.finish,  # type: ignore[arg-type]
                    policy_version=version, error_sites=list(state.error_sites),
                    info={**(e.final or {}), "turns": e.turns}, split=request.split,
                ))
            groups.append(RolloutGroup(request.group_id, request.seed, rollouts))
        return groups
