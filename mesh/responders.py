"""The local teacher server's responders by name (`[replay.local_server] responder`, `serve-teachers`).

Mesh sits above both what answers (`replay.server`'s generic responders,
`replay.reference_teacher`) and what is answered for (the demo task's solver in
`envs.demo`, the coding tasks' reference solutions), so it joins them here.
"""

from __future__ import annotations

from typing import Any

from composer_mesh.configs.sections.env import EnvConfig
from composer_mesh.configs.sections.replay import RESPONDERS
from composer_mesh.envs.demo import solve
from composer_mesh.envs.factory import env_factory
from composer_mesh.replay.reference_teacher import Lookup, ReferenceResponder
from composer_mesh.replay.server import ConsensusResponder, HFResponder, Responder, SolverResponder, echo_responder


def build_responder(kind: str, model_dir: str = "", noise: float = 0.2, env: EnvConfig | None = None) -> Responder:
    """The responder named by a config / command line (one of `RESPONDERS`); `coding` needs the job's `env`."""
    if kind == "consensus":
        return ConsensusResponder(noise=noise)
    if kind == "echo":
        return echo_responder
    if kind == "solver":
        return SolverResponder(solve, noise=noise)
    if kind == "hf":
        if not model_dir:
            raise ValueError("responder 'hf' needs a local model directory")
        return HFResponder(model_dir)
    if kind == "coding":
        if env is None:
            raise ValueError("responder 'coding' serves a recipe's coding tasks: use it from a recipe's "
                             "[replay.local_server], not on its own")
        return ReferenceResponder(reference_lookup(env), noise=noise)
    raise ValueError(f"unknown responder {kind!r}; choose from {', '.join(RESPONDERS)}")


def reference_lookup(env: EnvConfig) -> Lookup:
    """Prompt text -> reference files, over the train split's tasks (`env.tasks` of a tool-loop environment)."""
    train = env_factory(env)("train")
    tasks: list[Any] = list(getattr(train, "tasks", ()))
    train.close()
    if not tasks:
        raise ValueError(f"responder 'coding': env.task = {env.task!r} has no tool-loop tasks to serve")
    by_prompt = {t.prompt(): t for t in tasks}

    def lookup(prompt: str) -> dict[str, str] | None:
        task = by_prompt.get(prompt)
        return task.reference_files() if task is not None else None

    return lookup
