"""Build the environment `[env]` asks for (what the generator actors call)."""

from __future__ import annotations

from configs.sections.env import EnvConfig
from envs.base import Environment
from envs.demo import DemoEnv, Split
from envs.feature_deletion import FeatureDeletionEnv, TaskStore, generate_tasks
from envs.sandbox import Sandbox
from envs.tool_loop import ToolLoopEnv


def build_env(config: EnvConfig, split: Split = "train", store: TaskStore | None = None) -> Environment:
    """The demo env, or a repository env over tasks generated (and verified) from `feature_deletion.repo`.

    Repository envs need a `TaskStore` for the pristine snapshots; pass one to
    share it (and clean it up) across envs, else one is made for this env.
    """
    if config.task == "demo":
        return DemoEnv(config.demo, split)
    if not config.feature_deletion.repo:
        raise ValueError(f"env.task = {config.task!r} needs env.feature_deletion.repo (a local repository path)")
    sandbox = Sandbox(config.sandbox)
    tasks = generate_tasks(config.feature_deletion.repo, config.feature_deletion, sandbox, store or TaskStore(sandbox))
    if not tasks:
        raise ValueError(f"{config.feature_deletion.repo}: no verifiable feature-deletion task found")
    if config.task == "feature_deletion":
        return FeatureDeletionEnv(tasks, sandbox)
    return ToolLoopEnv(tasks, sandbox, config.tool_loop)
