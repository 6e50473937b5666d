"""The local teacher server's responders by name (`[replay.local_server] responder`, `serve-teachers`).

Mesh sits above both what answers (`replay.server`'s generic responders,
`replay.reference_teacher`) and what is answered for (the demo task's solver in
`envs.demo`, the coding tasks' reference solutions), so it joins them here.
"""

from __future__ import annotations

import threading
from typing import Any

from composer_mesh.configs.sections.env import EnvConfig
from composer_mesh.configs.sections.replay import RESPONDERS
from composer_mesh.envs.demo import solve
from composer_mesh.envs.factory import env_factory
from composer_mesh.envs.feature_deletion import RepoTask
from composer_mesh.envs.micro import MicroTask
from composer_mesh.envs.swe import SweTask
from composer_mesh.mesh.requests import problem_seed
from composer_mesh.replay.reference_teacher import UNKNOWN_TASK, Lookup, ReferenceResponder, TaskFiles
from composer_mesh.replay.server import ConsensusResponder, HFResponder, Responder, SolverResponder, echo_responder


def build_responder(kind: str, model_dir: str = "", noise: float = 0.2, env: EnvConfig | None = None,
                    job_seed: int = 0) -> Responder:
    """The responder named by a config / command line (one of `RESPONDERS`); `coding` needs the job's `env` (and
    its `job_seed`: the teachers look the run's own problems up)."""
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
        tool = "edit_file" if "edit_file" in env.tool_loop.tools else "write_file"
        return ReferenceResponder(reference_lookup(env, job_seed), noise=noise, tool=tool)
    raise ValueError(f"unknown responder {kind!r}; choose from {', '.join(RESPONDERS)}")


def task_files(task: Any) -> TaskFiles | str:
    """The files a coding teacher answers `task` from, or why it cannot: the reference solution's files as the
    agent first sees them and as the solution writes them. A micro task's come from its starting workspace, a
    repository task's are its target file, a SWE task's the files the gold patch touches (before: the repository
    at base_commit; the files the patch deletes are left out, as `SweTask.reference_files` leaves them)."""
    reference = task.reference_files()
    if not reference:
        return "no reference solution: the task has none"
    if isinstance(task, MicroTask):
        return TaskFiles({path: task.files.get(path, "") for path in reference}, reference)
    if isinstance(task, RepoTask):
        return TaskFiles({task.target: task.stubbed_source}, reference)
    if isinstance(task, SweTask):
        base = task.snapshot()
        return TaskFiles({path: (base / path).read_text() if (base / path).is_file() else "" for path in reference},
                         reference)
    return f"no starting files: a {type(task).__name__} task does not name them"


def reference_lookup(env: EnvConfig, job_seed: int = 0, scan: int = 1024) -> Lookup:
    """Prompt text -> the files (`task_files`) of the train split's task with that prompt, or why there are none.
    A source makes tasks from seeds (`pick`), so prompts are indexed lazily: a prompt not seen yet scans further
    seeds, up to `scan` of each range: first the problem seeds of a run with `job_seed` (`mesh.requests.
    problem_seed`: its failed turns), then seeds from 0 (frozen traces recorded on train tasks). Each task's files
    are made once (the server answers on several threads: one lock guards the index)."""
    train = env_factory(env)("train")
    pool: Any = train.tasks
    train.close()
    by_prompt: dict[str, Any] = {}
    files: dict[str, TaskFiles | str] = {}
    first = problem_seed(job_seed, 0)
    seeds = iter([*range(first, first + scan), *(range(scan) if first else ())])
    scanned = "of the run's seeds and of seed 0" if first else "of seed 0"
    lock = threading.Lock()

    def lookup(prompt: str) -> TaskFiles | str:
        with lock:
            while prompt not in by_prompt and (seed := next(seeds, None)) is not None:
                task = pool.pick(seed)
                by_prompt.setdefault(task.prompt(), task)
            if prompt not in by_prompt:
                return f"{UNKNOWN_TASK} (the first {scan} train tasks {scanned} scanned)"
            if prompt not in files:
                files[prompt] = task_files(by_prompt[prompt])
            return files[prompt]

    return lookup
