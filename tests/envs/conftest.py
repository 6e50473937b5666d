"""Fixtures for envs/: one sandbox and the verified tasks of the vendored repositories.

The fixture repositories under `fixtures/` carry their own test suites; they are
run inside the sandbox by the tests here, never collected by the project's run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_mesh.configs.sections.env import FeatureDeletionConfig, SandboxConfig

collect_ignore_glob = ["fixtures/*"]

FIXTURES = Path(__file__).parent / "fixtures"
REPOS = ("textkit", "minicalc")
SANDBOX_LIMITS = dict(wall_timeout_s=8.0, cpu_time_s=3, address_space_mb=1024, max_processes=12)


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory):
    """A sandbox with a root of its own: other graders on the box (a second run, a benchmark) add and remove
    their workspaces elsewhere, so a test may compare the root's listing before and after."""
    from composer_mesh.envs.sandbox import Sandbox

    return Sandbox(SandboxConfig(root_dir=str(tmp_path_factory.mktemp("sandbox-root")), **SANDBOX_LIMITS))


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
