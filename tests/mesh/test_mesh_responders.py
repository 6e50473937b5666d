"""The local coding teachers (`[replay.local_server] responder = "coding"`) serve every task kind with a reference.

A SWE-style instance from a real local git repository (`tests/envs/swe_shapes.py`: the base adds a rectangle's
sides, the gold patch multiplies them): the teacher behind the loopback server answers the episode's first
state with `edit_file` calls that turn the files the gold patch touches into the patched files, and the
run's environment grades that answer 1 (its hidden tests run in the local sandbox). A micro task is served
from its starting workspace. A prompt of no task, and an instance whose gold patch is empty, get a reply
worded per model (never a pair) carrying the reason in OpenAI's `refusal` field, with HTTP 200: no server
error.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from composer_mesh.configs.sections.env import CodingConfig, EnvConfig, SandboxConfig, SweConfig, ToolLoopConfig

REPO = Path(__file__).resolve().parents[2]


def _swe_shapes():
    spec = importlib.util.spec_from_file_location("swe_shapes", REPO / "tests" / "envs" / "swe_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def swe_env(tmp_path_factory) -> tuple[EnvConfig, object]:
    """A coding env of two SWE rows over `acme/shapes`: the real one, and one whose gold patch is empty."""
    shapes = _swe_shapes()
    root = tmp_path_factory.mktemp("swe")
    row = shapes.make_instance(root / "repos")
    empty = row | {"instance_id": "acme__shapes-2", "patch": "",
                   "problem_statement": "Rect needs a perimeter method; nobody wrote the fix yet."}
    (root / "instances.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(empty) + "\n")
    env = EnvConfig(task="coding", coding=CodingConfig(sources=("swe",)),
                    swe=SweConfig(instances=str(root / "instances.jsonl"), repos_dir=str(root / "repos"),
                                  runtime="local", heldout_fraction=0.0),
                    tool_loop=ToolLoopConfig(tools=("edit_file",), max_turns=2),
                    sandbox=SandboxConfig(root_dir=str(root)))
    return env, shapes


def _ask(url: str, model: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json={"model": model, "messages": messages}, timeout=60)


def _first_states(env: EnvConfig, seeds: range) -> dict[str, tuple[int, list[dict]]]:
    """Instance id -> (a seed of it, its episode's first messages: the state a teacher is asked about)."""
    from composer_mesh.envs.factory import env_factory

    make = env_factory(env)
    out = {}
    for seed in seeds:
        episode = make("train")
        obs = episode.reset(seed=seed)
        out[obs.info["task"]] = (seed, obs.messages)
        episode.close()
    return out


def test_coding_teachers_serve_swe_instances_and_say_why_they_cannot(swe_env):
    from composer_mesh.envs.factory import env_factory
    from composer_mesh.mesh.responders import build_responder, reference_lookup
    from composer_mesh.replay.reference_teacher import UNKNOWN_TASK
    from composer_mesh.replay.server import TeacherServer

    env, shapes = swe_env
    states = _first_states(env, range(2))
    assert set(states) == {"acme__shapes-1", "acme__shapes-2"}
    seed, solvable = states["acme__shapes-1"]
    lookup = reference_lookup(env)
    files = lookup(solvable[1]["content"])
    # the files the gold patch touches, before and after it
    assert files.start == {"shapes/core.py": shapes.BASE_CORE} and files.reference == {"shapes/core.py": shapes.FIXED_CORE}
    with TeacherServer(build_responder("coding", noise=0.0, env=env)) as server:
        answer = _ask(server.url, "local-a", solvable)
        unknown = [_ask(server.url, m, [{"role": "user", "content": "a task of no run"}]) for m in ("local-a", "local-b")]
        empty = _ask(server.url, "local-a", states["acme__shapes-2"][1])
    assert answer.status_code == 200
    message = answer.json()["choices"][0]["message"]
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["edit_file"]
    args = json.loads(calls[0]["function"]["arguments"])
    assert args["path"] == "shapes/core.py" and "self.w * self.h" in args["new"] and "refusal" not in message
    # the run's environment passes the teacher's answer: its hidden tests run on the edited repository
    episode = env_factory(env)("train")
    episode.reset(seed=seed)
    obs = episode.step({"role": "assistant", "content": "", "tool_calls": calls})
    if not obs.done:
        obs = episode.step({"role": "assistant", "content": "Done."})
    episode.close()
    assert obs.reward == 1.0, obs.info
    # what the teachers cannot serve: HTTP 200, worded per model (so never a pair), the reason in `refusal`
    replies = [r.json()["choices"][0]["message"] for r in unknown]
    assert [r.status_code for r in unknown] == [200, 200] and replies[0]["content"] != replies[1]["content"]
    assert all(r["refusal"].startswith(UNKNOWN_TASK) and not r.get("tool_calls") for r in replies)
    assert empty.status_code == 200
    assert empty.json()["choices"][0]["message"]["refusal"] == "no reference solution: the task has none"


def test_coding_teachers_serve_micro_tasks_from_their_workspace():
    from composer_mesh.envs.factory import env_factory
    from composer_mesh.mesh.responders import reference_lookup

    env = EnvConfig(task="coding", coding=CodingConfig(sources=("micro",)), tool_loop=ToolLoopConfig(tools=("edit_file",)))
    make = env_factory(env)
    episode = make("train")
    obs = episode.reset(seed=3)
    task = episode.task
    episode.close()
    files = reference_lookup(env)(obs.messages[1]["content"])
    assert files.reference == task.reference_files()
    assert files.start == {path: task.files[path] for path in task.reference_files()}
    assert files.start[task.target] == task.stubbed_source


def test_coding_teachers_find_the_runs_own_problems_whatever_its_seed():
    """A run of job seed s draws problem seeds `problem_seed(s, i)`: the teachers of that run find those tasks
    on a split with many templates (the hard split's union of sources), and still the seed-0 range (frozen traces
    recorded on train tasks)."""
    from composer_mesh.configs.loader import load_config
    from composer_mesh.envs.factory import env_factory
    from composer_mesh.mesh.requests import problem_seed
    from composer_mesh.mesh.responders import reference_lookup

    env = load_config(REPO / "configs" / "coding_hard_cpu.toml", ["--env.sandbox.pool_size=0"]).env
    episode = env_factory(env)("train")
    prompts = {}
    for seed in (problem_seed(3, 0), problem_seed(3, 117), 5):
        obs = episode.reset(seed=seed)
        prompts[seed] = (next(m["content"] for m in obs.messages if m["role"] == "user"),
                         episode.task.reference_files())
    episode.close()
    lookup = reference_lookup(env, job_seed=3, scan=200)
    for prompt, reference in prompts.values():
        assert lookup(prompt).reference == reference
    # a run of another seed does not scan these (in the first 200 of its seeds and of seed 0)
    assert isinstance(reference_lookup(env, job_seed=4, scan=200)(prompts[problem_seed(3, 117)][0]), str)
