"""Build the environments `[env]` asks for (what the generator actors call, once per episode)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from composer_mesh.configs.sections.env import CODING_SOURCES, CodingConfig, EnvConfig
from composer_mesh.envs.base import Environment
from composer_mesh.envs.container import ContainerBackend
from composer_mesh.envs.coding import ListPool, TaskPool, UnionPool
from composer_mesh.envs.dataset import DatasetEnv, load_task
from composer_mesh.envs.demo import DemoEnv, Split, stable_split
from composer_mesh.envs.feature_deletion import FeatureDeletionEnv, RepoTask, TaskStore, generate_tasks
from composer_mesh.envs.micro import MicroTasks
from composer_mesh.envs.plugin import check_call, load_callable
from composer_mesh.envs.pool import SandboxPool
from composer_mesh.envs.sandbox import Sandbox
from composer_mesh.envs.swe import SweTask, TaskBackends, load_instances
from composer_mesh.envs.swe_mini import SweMiniTasks
from composer_mesh.envs.tool_loop import ToolLoopEnv, offered_tools


def split_tasks(tasks: list[RepoTask], heldout_fraction: float, split: Split) -> list[RepoTask]:
    """Tasks of one split, by a stable hash of the task name (all tasks when a split would be empty)."""
    chosen = [t for t in tasks if stable_split(t.name, heldout_fraction) == split]
    return chosen or list(tasks)


def env_factory(config: EnvConfig, store: TaskStore | None = None) -> Callable[[Split], Environment]:
    """`make(split)` returning a fresh environment per call.

    Repository tasks are generated and verified once, here, from each of
    `feature_deletion.repos` into `store` (the caller cleans up a store it
    passes; one made here is removed at interpreter exit), then shared by
    every environment the factory makes. `task = "coding"` runs the tool loop
    over the union of `coding.sources`.
    """
    if config.task == "demo":
        return lambda split: DemoEnv(config.demo, split)
    if config.task == "dataset":
        task = load_task(config.dataset)
        return lambda split: DatasetEnv(task, split)
    if config.task == "plugin":
        return plugin_factory(config)
    sandbox = SandboxPool(config.sandbox) if config.sandbox.pool_size else Sandbox(config.sandbox)
    if config.task == "coding":
        pools = coding_pools(config, sandbox, store)
        backend = TaskBackends(sandbox, config.swe) if "swe" in config.coding.sources else sandbox
        return lambda split: ToolLoopEnv(pools[split], backend, config.tool_loop)
    by_split = repository_tasks(config, sandbox, store)
    if config.task == "feature_deletion":
        return lambda split: FeatureDeletionEnv(by_split[split], sandbox)
    return lambda split: ToolLoopEnv(by_split[split], sandbox, config.tool_loop)


def repository_tasks(config: EnvConfig, sandbox: Sandbox, store: TaskStore | None) -> dict[Split, list[RepoTask]]:
    """Verified feature-deletion tasks of every repository in `feature_deletion.repos`, per split."""
    fd = config.feature_deletion
    if not fd.repos:
        raise ValueError(f"env.task = {config.task!r} needs env.feature_deletion.repos (local repository paths)")
    if store is None:
        store = TaskStore(sandbox)
        atexit.register(store.cleanup)
    tasks: list[RepoTask] = []
    for repo in fd.repos:
        found = generate_tasks(repo, fd, sandbox, store)
        if not found:
            raise ValueError(f"env.feature_deletion.repos: {repo}: no verifiable feature-deletion task found")
        tasks += found
    return {s: split_tasks(tasks, fd.heldout_fraction, s) for s in ("train", "heldout")}


def coding_pools(config: EnvConfig, sandbox: Sandbox, store: TaskStore | None) -> dict[Split, TaskPool]:
    """The union of `coding.sources` per split; an unknown or empty source is an error naming its key. Micro
    sources (`micro` and each `[[env.coding.variants]]` named) are split by template hash with their own
    fractions; a validation split is the union of the micro sources that carve one out of train."""
    coding = config.coding
    sources = coding_sources(config)
    pools: dict[Split, list[TaskPool]] = {"train": [], "heldout": []}
    if validation_sources(coding, sources):  # [trainer] eval_split = "validation" checks that there is one
        pools["validation"] = []
    swe_store: Path | None = None
    for source in sources:
        if source == "swe":
            for split, swe in swe_tasks(config, sandbox).items():
                pools[split].append(ListPool(swe))
        elif source == "repos":
            for split, tasks in repository_tasks(config, sandbox, store).items():
                pools[split].append(ListPool(tasks))
        else:
            if coding.shape_of(source) == "swe":
                swe_store = swe_store or private_store(sandbox, "swe-mini-")
            for split in micro_splits(coding, source):
                if split in pools:
                    pools[split].append(micro_source(coding, source, split, swe_store))
    return {split: UnionPool(p) for split, p in pools.items()}


def micro_splits(coding: CodingConfig, source: str) -> tuple[Split, ...]:
    """The splits micro source `source` serves: train and held-out, and validation when it carves one out."""
    return ("train", "heldout", "validation") if coding.variant(source).validation_fraction > 0 else ("train", "heldout")


def micro_source(coding: CodingConfig, source: str, split: Split, store: Path | None) -> TaskPool:
    """The tasks of micro source `source` (micro or a variant) in `split`: micro tasks, or SWE mini instances made
    into `store` (a variant of shape swe needs one); ValueError when the split has no template."""
    knobs = coding.variant(source)
    if coding.shape_of(source) == "swe":
        if store is None:
            raise ValueError(f"env.coding.variants: {source!r} makes SWE instances and needs a store")
        return SweMiniTasks(knobs, split, source, store)
    return MicroTasks(knobs, split, source)


def validation_sources(coding: CodingConfig, sources: list[str]) -> list[str]:
    """The micro sources (micro, variants) of `sources` with a validation split (`validation_fraction` > 0)."""
    return [s for s in sources if s not in ("repos", "swe") and coding.variant(s).validation_fraction > 0]


def private_store(sandbox: Sandbox, prefix: str) -> Path:
    """A root-only directory under the sandbox's root, removed at interpreter exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=sandbox.root))
    atexit.register(shutil.rmtree, path, True)
    return path


def swe_tasks(config: EnvConfig, sandbox: Sandbox) -> dict[Split, list[SweTask]]:
    """SWE instances of `swe.instances` per split; their snapshots live in a private dir removed at exit."""
    tasks = swe_instances(config, private_store(sandbox, "swe-"))
    return {s: split_tasks(tasks, config.swe.heldout_fraction, s) for s in ("train", "heldout")}


def swe_instances(config: EnvConfig, store: Path) -> list[SweTask]:
    """The rows of `swe.instances` (snapshots go to `store`); an empty file is an error naming the key."""
    tasks = load_instances(config.swe, store)
    if not tasks:
        raise ValueError(f"env.coding.sources names swe, but env.swe.instances = {config.swe.instances!r} has no row")
    return tasks


def coding_sources(config: EnvConfig) -> list[str]:
    """`coding.sources` without repeats; empty or unknown is an error naming the key (a variant is known by the
    name of its `[[env.coding.variants]]` table)."""
    sources = config.coding.sources
    known = [*CODING_SOURCES, *(v.name for v in config.coding.variants)]
    if not sources:
        raise ValueError(f"env.coding.sources is empty; sources: {', '.join(known)}")
    unknown = [s for s in sources if s not in known]
    if unknown:
        raise ValueError(f"env.coding.sources: unknown source(s) {unknown}; sources: {', '.join(known)}")
    return list(dict.fromkeys(sources))


def plugin_factory(config: EnvConfig) -> Callable[[Split], Environment]:
    """`make(split)` calling `env.plugin.entry_point(split=split, **env.plugin.kwargs)`, checking what it returns."""
    spec, kwargs = config.plugin.entry_point, dict(config.plugin.kwargs)
    if not spec:
        raise ValueError("env.task = 'plugin' needs env.plugin.entry_point ('package.module:make_env')")
    make = load_callable(spec, "env.plugin.entry_point")
    check_call(make, spec, "env.plugin.entry_point", 0, ["split", *kwargs])

    def build(split: Split) -> Environment:
        env = make(split=split, **kwargs)
        if not isinstance(env, Environment):
            raise TypeError(
                f"env.plugin.entry_point = {spec!r} returned {type(env).__name__}, not an envs.base.Environment"
            )
        return env

    return build


def check_task(config: EnvConfig) -> None:
    """Fail before any actor starts when a dataset or plugin task cannot load (one environment made per split),
    or when a coding task's sources, micro knobs or tools are wrong (cheap checks: no repository is graded here)."""
    if config.task in ("dataset", "plugin"):
        make = env_factory(config)
        for split in ("train", "heldout"):
            make(split).close()
    if config.task in ("tool_loop", "coding"):
        offered_tools(config.tool_loop.tools)
    if config.task == "coding":
        sources = coding_sources(config)
        if "repos" in sources and not config.feature_deletion.repos:
            raise ValueError("env.coding.sources names 'repos': it needs env.feature_deletion.repos (local repository paths)")
        with tempfile.TemporaryDirectory(prefix="micro-check-") as store:  # nothing is made: pools only
            for source in sources:
                if source not in ("repos", "swe"):  # micro and the variants: every split they serve has a template
                    for split in micro_splits(config.coding, source):
                        micro_source(config.coding, source, split, Path(store))
        if "swe" in sources:
            check_swe(config)


def check_swe(config: EnvConfig) -> None:
    """The instances file loads, and each image runs a contained container here (SandboxUnavailable says why not)."""
    with tempfile.TemporaryDirectory(prefix="swe-check-") as tmp:
        tasks = swe_instances(config, Path(tmp) / "store")
    for image in sorted({t.image for t in tasks if t.backend == "container"}):
        ContainerBackend(config.swe, image)


def build_env(config: EnvConfig, split: Split = "train", store: TaskStore | None = None) -> Environment:
    """One environment (see `env_factory`; use the factory when making many)."""
    return env_factory(config, store)(split)
