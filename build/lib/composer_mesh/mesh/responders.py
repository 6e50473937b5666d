"""The local teacher server's responders by name (`[replay.local_server] responder`, `serve-teachers`).

Mesh sits above both what answers (`replay.server`'s generic responders) and what
is answered for (the demo task's solver in `envs.demo`), so it joins them here.
"""

from __future__ import annotations

from composer_mesh.configs.sections.replay import RESPONDERS
from composer_mesh.envs.demo import solve
from composer_mesh.replay.server import ConsensusResponder, HFResponder, Responder, SolverResponder, echo_responder


def build_responder(kind: str, model_dir: str = "", noise: float = 0.2) -> Responder:
    """The responder named by a config / command line (one of `RESPONDERS`)."""
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
    raise ValueError(f"unknown responder {kind!r}; choose from {', '.join(RESPONDERS)}")
