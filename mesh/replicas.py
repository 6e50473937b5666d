"""DiLoCo in the RL loop: R trainer replica groups under one `DiLoCoManagerActor`.

Placement (`place_replicas`): the manager actor (torchft lighthouse) in the
controller's process; per replica group its own process mesh of
`[diloco] procs_per_group` trainer procs (its own torch-elastic env, so its
own FSDP mesh and TCPStore) running `DiLoCoTrainerActor`, set up and joined
to the quorum; generators as in `mesh.placement` (disaggregated: their own
procs; colocated: one in every trainer proc of every group).

Loop (`ReplicaController`): one `mesh.controller.Controller` per replica
group, each drawing `prompts_per_step / R` prompts a step from a prompt
stream of its own (`group_streams`: reproducible whatever the thread timing),
fed by its generators (`generators[g::R]`, or all when there are fewer than R).
Every group generates and trains in its own thread (the DiLoCo sync inside
`train_step` waits for the whole quorum, which keeps them in step); after a
step that ended an outer round the generators load group 0's weights, i.e.
the post-outer-step weights, through the same topology-aware sync as the
main loop (`actors.weight_sync.sync.TopologySync`). Between syncs they stay on those weights; the generator logprobs
travel with every sample, so the loss's IS correction sees what sampled.
Teacher replay: one actor for all groups; each group queues its own failed
turns and draws `pairs_per_step / R` pairs. Checkpoints: each group its own
(`<checkpoint dir>/replica_<g>`, with DiLoCo's outer state, and its
controller state under `controller/`); a resumed run continues every group
from the same step. The first group that fails stops
the others (`run_groups`).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from monarch.actor import this_proc
from composer_mesh.actors.elastic import setup_elastic_env

from composer_mesh.actors.diloco import DiLoCoManagerActor, DiLoCoTrainerActor
from composer_mesh.actors.mesh_utils import rank0
from composer_mesh.actors.weight_sync.sync import TopologySync, sync_keep
from composer_mesh.configs.sections.diloco import DiLoCoConfig
from composer_mesh.configs.sections.mesh import MeshConfig
from composer_mesh.mesh.controller import Controller, ControllerConfig, StepRecord
from composer_mesh.mesh.placement import Placement, host_meshes, spawn_generators, spawn_replay
from composer_mesh.mesh.supervision import load_state

# batches in a row with nothing to train before a group gives up
MAX_TIED_RETRIES = 20


@dataclass
class ReplicaPlacement(Placement):
    """`trainer` is group 0; `groups` every group's trainer mesh; `manager` the DiLoCo manager actor."""

    manager: Any = None
    groups: list[Any] = field(default_factory=list)
    # group g checkpoints under <checkpoint_dir>/replica_<g> ("" = none)
    checkpoint_dir: str = ""

    def stop(self) -> None:
        if self.manager is not None:
            self.manager.shutdown.call_one().get()
        super().stop()


def check_supported(job: Any) -> None:
    """Clear errors for recipe combinations the DiLoCo loop does not run."""
    if job.trainer.mode != "sync":
        raise ValueError(
            "diloco.enabled needs trainer.mode = \"sync\": async generation would need one weight publication "
            "per replica group (a slot ring and generators of its own) and a staleness bound across outer syncs, "
            "which the DiLoCo loop does not build"
        )
    if job.loss.beta > 0 and job.mesh.replay_procs > 0 and job.replay.gating.enabled:
        raise ValueError(
            "diloco.enabled with replay.gating.enabled: gating scores states with one group's trainer, which may "
            "be blocked in an outer sync waiting for the group that asks; set replay.gating.enabled = false"
        )
    if job.trainer.prompts_per_step < job.diloco.replica_groups:
        raise ValueError(f"trainer.prompts_per_step ({job.trainer.prompts_per_step}) < diloco.replica_groups "
                         f"({job.diloco.replica_groups}): every group needs rollouts each step")


def place_replicas(cfg: MeshConfig, diloco: DiLoCoConfig, trainer_spec: Any, generator_spec: Any,
                   replay_spec: Any | None = None) -> ReplicaPlacement:
    """Spawn the manager, R trainer replica groups (set up, joined), the generators and the replay actor.

    Group g checkpoints under `<checkpoint_dir>/replica_<g>` (its own inner optimizer and DiLoCo state)
    and resumes from there. Groups that start fresh must hold group 0's weights (checked per rank at
    join); resumed groups must all be at the same step.
    """
    trainer_hosts = host_meshes(cfg)[0]
    manager = this_proc().spawn("diloco_manager", DiLoCoManagerActor, diloco)
    meshes, groups = [], []
    for g in range(diloco.replica_groups):
        procs = trainer_hosts.spawn_procs(per_host={"gpus": diloco.procs_per_group})
        setup_elastic_env(procs)
        meshes.append(procs)
        spec = trainer_spec
        if trainer_spec.checkpoint_dir:
            spec = dataclasses.replace(trainer_spec, checkpoint_dir=_group_dir(trainer_spec.checkpoint_dir, g))
        groups.append(procs.spawn(f"trainer_{g}", DiLoCoTrainerActor, spec, diloco))
    generators, _, _ = spawn_generators(cfg, list(meshes), generator_spec, meshes)
    setups = [list(group.setup.call().get().values()) for group in groups]
    steps = [s[0]["step"] for s in setups]
    if len(set(steps)) > 1:
        raise ValueError(f"the replica groups resumed at different steps {steps} (checkpoints under "
                         f"{trainer_spec.checkpoint_dir}/replica_<g>): every group must resume the same step")
    # fresh: every group must start from group 0's weights (per rank); resumed: each restored its own state
    start = list(groups[0].local_digest.call().get().values()) if steps[0] == 0 else None
    for g, group in enumerate(groups):
        group.join.call(manager.assign.call_one(g).get(), start).get()
    replay = spawn_replay(cfg, replay_spec, groups[0], meshes)
    return ReplicaPlacement(groups[0], generators, replay, [s for setup in setups for s in setup], meshes,
                            manager=manager, groups=groups, checkpoint_dir=trainer_spec.checkpoint_dir)


def _group_dir(checkpoint_dir: str, g: int) -> str:
    return str(Path(checkpoint_dir) / f"replica_{g}")


def _split(n: int, parts: int) -> list[int]:
    """`n` split into `parts` near-equal counts, the larger first."""
    return [n // parts + (1 if g < n % parts else 0) for g in range(parts)]


def group_streams(cfg: ControllerConfig, groups: int, prompt_cursor: int) -> list[tuple[ControllerConfig, int]]:
    """Each replica group's controller config and first prompt index.

    Group g draws `prompts_per_step / groups` prompts a step (and as many of `pairs_per_step`) from a
    stream of its own (seed `cfg.seed * groups + g`), so which prompts a group trains does not depend
    on thread timing, and a run resumed at step s (`prompt_cursor` = s × prompts_per_step) continues
    every stream where it stopped (a tied batch a group generated again is not counted; the group's
    controller state saved beside its checkpoint, when there is one, has the exact cursor).
    """
    counts, pairs = _split(cfg.prompts_per_step, groups), _split(cfg.pairs_per_step, groups)
    steps = prompt_cursor // cfg.prompts_per_step
    return [(dataclasses.replace(cfg, prompts_per_step=n, pairs_per_step=p, seed=cfg.seed * groups + g), steps * n)
            for g, (n, p) in enumerate(zip(counts, pairs))]


# per-step counts (summed over replica groups) and maxima; by exact key or by key prefix
COUNT_KEYS = ("rollouts/policy", "rollouts/dropped_groups", "rollouts/completion_tokens", "distill/hinted",
              "preference/pairs_in_batch", "coding/tool_errors", "coding/violations", "coding/calls_refused")
COUNT_PREFIXES = ("rollouts/dropped_reason/", "coding/tool_errors/", "coding/violations/", "coding/calls_refused/")
MAX_KEYS = ("rollouts/dropped_prompt_tokens", "coding/grade_s_max", "coding/grading_s_max")


def merge_metrics(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its replica groups' rows: counts summed, maxima kept, `skipped` only when every
    group skipped (a step that trained in one group trained), everything else averaged over the groups."""
    keys = set().union(*rows)
    out: dict[str, float] = {}
    for k in keys:
        values = [row.get(k, 0.0) for row in rows]
        if k in COUNT_KEYS or k.startswith(COUNT_PREFIXES):
            out[k] = sum(values)
        elif k in MAX_KEYS:
            out[k] = max(values)
        elif k != "skipped":
            out[k] = sum(values) / len(rows)
    if all("skipped" in row for row in rows):
        out["skipped"] = 1.0
    return out


def run_groups(drive: Callable[[int, threading.Event], None], n: int, stop_run: Callable[[], None]) -> None:
    """`drive(g, stop)` for every replica group g in its own thread; the first failure stops them all.

    A group blocked in a DiLoCo sync waits for a quorum that a failed group never joins
    (`quorum_timeout_s`, 600 s by default). So on the first failure `stop` is set (drivers check it
    between steps) and `stop_run()` shuts the lighthouse down: every replica then aborts its pending
    quorum within `heartbeat_timeout_ms` (`DiLoCoReplica._watch_lighthouse`). Once every thread has
    ended, raises the first failure, naming its group.
    """
    stop = threading.Event()
    failed: list[tuple[int, BaseException]] = []
    with ThreadPoolExecutor(n) as pool:
        futures = {pool.submit(drive, g, stop): g for g in range(n)}
        for future in as_completed(futures):
            if future.exception() is not None and not failed:
                failed.append((futures[future], future.exception()))
                stop.set()
                stop_run()
    if failed:
        g, exc = failed[0]
        raise RuntimeError(f"replica group {g} failed; the other groups were stopped") from exc


class ReplicaController:
    """Drives R replica groups in lockstep; same `run() -> list[StepRecord]` as `Controller`."""

    def __init__(
        self,
        cfg: ControllerConfig,
        placement: ReplicaPlacement,
        diloco: DiLoCoConfig,
        chat: Any,
        *,
        hinter: Any = None,
        on_step: Callable[[StepRecord], None] | None = None,
        prompt_cursor: int = 0,
    ) -> None:
        R = len(placement.groups)
        if cfg.mode != "sync":
            raise ValueError("the DiLoCo loop runs in sync mode")
        self.cfg, self.placement, self.on_step = cfg, placement, on_step
        self.per_sync = diloco.inner_steps // diloco.fragments
        gens = placement.generators
        shares = [gens[g::R] if len(gens) >= R else list(gens) for g in range(R)]
        self.groups: list[Controller] = []
        for g, (trainer, share, (group_cfg, cursor)) in enumerate(
                zip(placement.groups, shares, group_streams(cfg, R, prompt_cursor))):
            state = None
            # each group's controller state beside its checkpoints, resumed with them
            if placement.checkpoint_dir:
                group_cfg = dataclasses.replace(
                    group_cfg, state_dir=str(Path(_group_dir(placement.checkpoint_dir, g)) / "controller"))
                state = load_state(group_cfg.state_dir, rank0(trainer.policy_version.call().get()))
            # one replay actor for all: each group queues its failed turns and draws its share of pairs
            self.groups.append(Controller(group_cfg, trainer, share, chat, hinter=hinter, replay=placement.replay,
                                          prompt_cursor=cursor, state=state))
        # built on first use: group 0's trainer and every generator, routed by their topology
        self._wsync: TopologySync | None = None

    def sync_generators(self) -> None:
        """Load group 0's (post-outer-step) weights into every generator; raises unless every generator's digest
        equals group 0's export (in the serving dtype)."""
        trainer = self.placement.groups[0]
        if self._wsync is None:
            self._wsync = TopologySync(trainer, self.placement.generators, self.cfg.weight_dir,
                                       keep=sync_keep(self.cfg.max_staleness), dtype=self.cfg.serving_dtype,
                                       anchor_every=self.cfg.anchor_every)
        report = self._wsync.sync()
        exported = rank0(trainer.weights_digest.call(self.cfg.serving_dtype).get())
        if report.digest != exported:
            raise RuntimeError(f"weight sync v{report.version}: the generators hold different weights than "
                               "replica group 0")

    def run(self) -> list[StepRecord]:
        """`cfg.steps` optimizer steps on every group, each group in its own thread.

        A group whose rollouts all tie (nothing to train) generates again rather
        than skip: DiLoCo syncs after the same number of inner steps on every
        group, so each group must take every step. The quorum keeps the groups
        in step; records are merged per step and emitted in order.
        """
        self.sync_generators()
        history: list[StepRecord] = []
        pending: dict[int, list[StepRecord]] = {}
        lock = threading.Lock()
        first = self.groups[0].version

        def drive(g: int, stop: threading.Event) -> None:
            c, ties = self.groups[g], 0
            while c.version < first + self.cfg.steps and not stop.is_set():
                record = c.step(sync_generators=False)
                if "skipped" in record.metrics:
                    ties += 1
                    if ties > MAX_TIED_RETRIES:
                        raise RuntimeError(f"replica group {g}: {ties} batches in a row had nothing to train")
                    continue
                ties = 0
                # a sync ended: report; generators follow group 0
                if record.step % self.per_sync == 0:
                    self.placement.manager.report.call_one(g, rank0(c.trainer.diloco_status.call().get())).get()
                    if g == 0:
                        self.sync_generators()
                with lock:
                    pending.setdefault(record.step, []).append(record)
                    self._emit_ready(pending, history)

        run_groups(drive, len(self.groups), lambda: self.placement.manager.shutdown.call_one().get())
        return history

    def _emit_ready(self, pending: dict[int, list[StepRecord]], history: list[StepRecord]) -> None:
        """Emit every step all groups have finished, in order (each group reported its sync before)."""
        while pending and len(pending[min(pending)]) == len(self.groups):
            step = min(pending)
            record = self._merge(pending.pop(step))
            if step % self.per_sync == 0:
                record.metrics.update(self._status_metrics())
            history.append(record)
            if self.on_step is not None:
                self.on_step(record)

    def _status_metrics(self) -> dict[str, float]:
        s = self.placement.manager.status.call_one().get()
        return {"diloco/outer_step": float(s["outer_step"]), "diloco/quorum": float(s["quorum_size"]),
                "diloco/bytes_sent": float(s["bytes_sent"])}

    def _merge(self, records: Sequence[StepRecord]) -> StepRecord:
        """One record for the step: the groups' metrics merged (`merge_metrics`), rollouts pooled."""
        metrics = merge_metrics([r.metrics for r in records])
        groups = sum(r.groups for r in records)
        reward = sum(r.reward_mean * r.groups for r in records) / max(1, groups)
        metrics["reward/mean"] = reward
        return StepRecord(records[0].step, metrics, reward, [s for r in records for s in r.staleness],
                          0, groups, max(r.seconds for r in records), pair_keys=[p for r in records for p in r.pair_keys],
                          rollouts=[x for r in records for x in r.rollouts])
