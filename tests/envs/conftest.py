"""Fixtures for envs/: one sandbox and the verified tasks of the vendored repositories.

The fixture repositories under `fixtures/` carry their own test suites; they are
run inside the sandbox by the tests here, never collected by the project's run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from composer_mesh.configs.sections.env import FeatureDeletionConfig, SandboxConfig

collect_ignore_glob = ["fixtures/*"]

FIXTURES = Path(__file__).parent / "fixtures"
REPOS = ("textkit", "minicalc")
SANDBOX_LIMITS = dict(wall_timeout_s=8.0, cpu_time_s=3, address_space_mb=1024, max_processes=12)
# these modules run twice: graded by cold sandboxes, and through a pool of warm workers (envs.pool)
POOLED_MODULES = ("test_envs_hostile", "test_envs_hostile_callables", "test_envs_micro_hostile")


def pytest_generate_tests(metafunc):
    if "sandbox" in metafunc.fixturenames and metafunc.module.__name__.rsplit(".", 1)[-1] in POOLED_MODULES:
        metafunc.parametrize("sandbox", ["cold", "pool"], indirect=True, scope="session")


@pytest.fixture(scope="session")
def sandbox(request, tmp_path_factory):
    """A sandbox with a root of its own: other graders on the box (a second run, a benchmark) add and remove
    their workspaces elsewhere, so a test may compare the root's listing before and after.
    Parametrized "pool" (POOLED_MODULES): a `SandboxPool` over the same limits, grading in warm workers."""
    from composer_mesh.envs.pool import SandboxPool
    from composer_mesh.envs.sandbox import Sandbox

    config = SandboxConfig(root_dir=str(tmp_path_factory.mktemp("sandbox-root")), **SANDBOX_LIMITS)
    if getattr(request, "param", "cold") == "pool":
        with SandboxPool(dataclasses.replace(config, pool_size=2)) as pool:
            yield pool
    else:
        yield Sandbox(config)


@pytest.fixture(scope="session")
def task_store(sandbox):
    from composer_mesh.envs.feature_deletion import TaskStore

    store = TaskStore(sandbox)
    yield store
    store.cleanup()


@pytest.fixture(scope="session")
def repo_tasks(sandbox, task_store):
    """Verified single-function tasks, three per vendored repository."""
    from composer_mesh.envs.feature_deletion import generate_tasks

    config = FeatureDeletionConfig(max_tasks=3, functions_per_task=1, seed=0)
    return {repo: generate_tasks(FIXTURES / repo, config, sandbox, task_store) for repo in REPOS}


@pytest.fixture(scope="session")
def callable_tasks(sandbox, task_store):
    """The hookkit fixture: tests pass callables and objects in and get callables back; (tasks, refused)."""
    from composer_mesh.envs.feature_deletion import generate_tasks

    refused: list[tuple[str, str]] = []
    tasks = generate_tasks(FIXTURES / "hookkit", FeatureDeletionConfig(max_tasks=10, seed=0), sandbox, task_store, refused)
    return tasks, refused


@pytest.fixture(scope="session")
def object_tasks(sandbox, task_store):
    """The first four minicalc tasks, `tokenize` among them (its tests get `Token` objects back); (tasks, refused)."""
    from composer_mesh.envs.feature_deletion import generate_tasks

    refused: list[tuple[str, str]] = []
    tasks = generate_tasks(FIXTURES / "minicalc", FeatureDeletionConfig(max_tasks=4, seed=0), sandbox, task_store, refused)
    return tasks, refused
