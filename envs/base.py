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

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

from composer_mesh.configs.records import ErrorSite


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

    def step(self, action: dict[str, Any]) -> Observation:
        """Apply one assistant message; raises if the episode is over or the message is not one."""
        if self._state.done:
            raise RuntimeError("episode is done; call reset()")
        if not self._state.messages:
            raise RuntimeError("call reset() before step()")
        if not isinstance(action, dict) or action.get("role") != "assistant":
            raise ValueError(f"an action is an assistant message dict, got {str(action)[:80]!r}")
        turn = len(self._state.messages)
        self._state.messages.append(action)
        self._state.step_count += 1
        obs = self._answer(action, turn)
        self._state.messages.extend(obs.messages)
        self._state.error_sites.extend(obs.error_sites)
        self._state.reward, self._state.done = obs.reward, obs.done
        return obs

    def close(self) -> None:
        """Release resources of the current episode (workspaces); reset() calls it."""

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
