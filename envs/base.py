"""The environment interface: reset / step over OpenAI-style chat messages.

Shaped after OpenEnv's `Environment` (`openenv-core`: `reset(seed, episode_id)
-> Observation`, `step(action) -> Observation` with `done`, `reward`,
`metadata`, and a `state` property with `episode_id`, `step_count`) without
its dependencies (FastAPI, Gradio, Hugging Face Hub, ...): an action here is
one assistant message (text and/or `tool_calls`), an observation carries the
messages the environment answers with, the reward, `done`, the error sites
this step produced and an `info` dict (its `metadata`). docs/envs.md has the
mapping.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

from composer_mesh.configs.records import ErrorKind, ErrorSite

logger = logging.getLogger(__name__)
# the reason an episode ends with when applying a reply raised (`Environment.step`'s last line of defence)
ENV_ERROR = "env_error"


class EnvironmentFault(RuntimeError):
    """The environment cannot answer any reply (a user's reward function that raises or breaks TRL's contract):
    not the reply's doing, so `step` lets it through and the run stops with its reason."""


@dataclass
class Observation:
    """What the environment returns from `reset` and `step`.

    messages: new chat messages to append (the prompt at reset; tool results or
    feedback after a step). reward: the reward of the episode so far, None
    before the first action. error_sites: sites produced by this step, `turn`
    indexing the full message list (`state.messages`).
    """

    messages: list[dict[str, Any]]
    reward: float | None = None
    done: bool = False
    error_sites: list[ErrorSite] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvState:
    """The episode so far: every message (prompt, actions, answers) and every error site."""

    episode_id: str = ""
    step_count: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    error_sites: list[ErrorSite] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


class Environment(ABC):
    """Base class: keeps the transcript; subclasses supply `_start` and `_answer`."""

    def __init__(self) -> None:
        self._state = EnvState()

    @property
    def state(self) -> EnvState:
        return self._state

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> Observation:
        """Start an episode; `seed` picks the problem deterministically."""
        self.close()
        self._state = EnvState(episode_id=episode_id or uuid.uuid4().hex)
        obs = self._start(seed)
        self._state.messages.extend(obs.messages)
        return obs

    def add_note(self, text: str) -> None:
        """Append a user message holding `text` to the episode's transcript before its first reply (a privileged
        note: the hinted evaluation's reference, where the hint channel puts its hints); the environment's own
        state is unchanged, so the episode runs and is graded as without it."""
        if not self._state.messages or self._state.step_count or self._state.done:
            raise RuntimeError("a note goes after reset() and before the first step()")
        self._state.messages.append({"role": "user", "content": valid_text(text)})

    def step(self, action: dict[str, Any]) -> Observation:
        """Apply one assistant message; raises if the episode is over or the message is not one.

        Never raises for what the message says: an exception out of `_answer` (but an `EnvironmentFault`) ends
        the episode with reward 0 and the reason `env_error` (`_failed`), and the observation's text is made
        valid UTF-8 (`valid_text`), so one reply never takes a batch of episodes down or reaches the tokenizer
        as text it cannot encode.
        """
        if self._state.done:
            raise RuntimeError("episode is done; call reset()")
        if not self._state.messages:
            raise RuntimeError("call reset() before step()")
        if not isinstance(action, dict) or action.get("role") != "assistant":
            raise ValueError(f"an action is an assistant message dict, got {str(action)[:80]!r}")
        turn = len(self._state.messages)
        self._state.messages.append(action)
        self._state.step_count += 1
        try:
            obs = self._answer(action, turn)
        except EnvironmentFault:
            raise
        except Exception as exc:  # the last line of defence: subclasses handle what they expect
            obs = self._failed(exc, turn)
        obs = valid_observation(obs)
        self._state.messages.extend(obs.messages)
        self._state.error_sites.extend(obs.error_sites)
        self._state.reward, self._state.done = obs.reward, obs.done
        return obs

    def close(self) -> None:
        """Release resources of the current episode (workspaces); reset() calls it. Never raises: a failure to
        release is logged (subclasses release in `_release`)."""
        try:
            self._release()
        except Exception:
            logger.exception("%s: releasing episode %s failed", type(self).__name__, self._state.episode_id)

    def _release(self) -> None:
        """Free what the current episode holds (nothing here)."""

    def _failed(self, exc: Exception, turn: int) -> Observation:
        """The episode's end when applying a reply raised: reward 0, the reason `env_error` naming the exception,
        an error site at the reply; the episode's resources are released. Logged with its traceback: an
        exception reaching here is one the environment did not expect."""
        logger.exception("%s: applying a reply of episode %s raised", type(self).__name__, self._state.episode_id)
        detail = f"{type(exc).__name__}: {exc}"[:2000]
        self.close()
        site = ErrorSite(turn=turn, kind=ErrorKind.OTHER, message=f"{ENV_ERROR}: {detail}"[:500], feedback=detail)
        info = {"reason": ENV_ERROR, "violations": [(ENV_ERROR, detail)], "violation_kinds": {ENV_ERROR: 1}}
        return Observation([], reward=0.0, done=True, error_sites=[site], info=info)

    @classmethod
    def step_many(cls, envs: Sequence[Environment], actions: Sequence[dict[str, Any]]) -> list[Observation] | None:
        """Step several environments of this class in one go (e.g. one reward call over all their actions);
        None: this class has no batched step, and the caller steps each one."""
        return None

    @abstractmethod
    def _start(self, seed: int | None) -> Observation: ...

    @abstractmethod
    def _answer(self, action: dict[str, Any], turn: int) -> Observation: ...


def assistant(content: str = "", tool_calls: list[tuple[str, dict[str, Any]]] | None = None) -> dict[str, Any]:
    """An assistant message; `tool_calls` as (name, arguments) pairs get ids call_0, call_1, ..."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(tool_calls)
        ]
    return msg


def valid_text(text: str) -> str:
    """`text` as valid UTF-8: each lone surrogate (which a JSON escape such as "\\ud800" or a file name that is
    not UTF-8 can put in a string) written as its escape; text that is valid comes back as it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def valid_data(value: Any) -> Any:
    """`value` with every string in it (dict keys, list and tuple items, nested) made `valid_text`."""
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, dict):
        return {valid_data(k): valid_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [valid_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(valid_data(v) for v in value)
    return value


def valid_observation(obs: Observation) -> Observation:
    """`obs` with the text of its messages, error sites and info made `valid_text`."""
    sites = [
        dataclasses.replace(s, **{k: valid_data(getattr(s, k)) for k in ("message", "tool", "feedback", "reference")})
        for s in obs.error_sites
    ]
    return dataclasses.replace(obs, messages=valid_data(obs.messages), error_sites=sites, info=valid_data(obs.info))
