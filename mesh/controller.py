"""The controller loop: rollouts → packed batch → train step → weight sync, sync or async.

Plain Python in the launching process, holding actor meshes. One step:

1. take `prompts_per_step` rollout groups (sync: generated now with the
   current weights; async: from a buffer the generators fill in the background);
2. GRPO advantages and dynamic sampling, hints for error sites (channel 2 and
   RLSD: `mesh.hinting`), preference pairs from the teacher-replay actor
   (channel 3, optional; the rollouts it replays: `mesh.outcomes.replay_rollouts`);
3. pack one global `TrainBatch` and call `train_step` on the trainer mesh;
4. publish the new weights through `actors.weight_sync.sync.TopologySync` (trainer
   ranks write their own shards into per-host shared memory, hosts without
   trainer ranks pull them over RDMA; docs/weight_sync.md). Sync mode loads
   them into every generator before the next step (on-policy: staleness 0),
   digests checked to agree. Async mode publishes once per step and lets each
   generator worker load the newest published version between its own
   `generate` calls, so generation overlaps training; a group sampled with
   policy version v is trained at trainer version t only if t − v ≤
   `max_staleness`, older groups are dropped. The generator logprobs travel
   with every sample, so the loss's TIS / mismatch correction sees what the
   generator used.

Supervision (`mesh.supervision`, docs/supervision.md): with a `Supervisor`, a
generator that dies, or hangs past its call's `Deadline` (its process is then
killed), is replaced and its in-flight requests are re-issued
(same group id and seed; a group whose id is no longer outstanding is dropped,
so none is trained twice) after the replacement loaded the newest published
weights; a dead replay actor is replaced and restored; a dead trainer mesh is
restarted from its newest checkpoint and the controller rolls back to the
`ControllerState` saved for that version, then re-syncs the generators. The
weight sync is re-planned after every replacement. The state is saved once
per step, before `train_step`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch

from composer_mesh.actors.episodes import ChatTokens
from composer_mesh.actors.mesh_utils import rank0
from composer_mesh.actors.rollout import RolloutGroup, SamplingParams
from composer_mesh.actors.weight_sync.sync import Publication, TopologySync, TopologySyncReport, sync_keep, sync_metrics
from composer_mesh.configs.schema import JobConfig
from composer_mesh.configs.sections.loss import PolicyLossConfig
from composer_mesh.envs.tool_loop import offered_tools
from composer_mesh.mesh.errors import phase
from composer_mesh.mesh.evaluation import EvalConfig, evaluate
from composer_mesh.mesh.episode_metrics import episode_metrics, rollout_record
from composer_mesh.mesh.async_workers import AsyncWorkers
from composer_mesh.mesh.hinting import HintMaker
from composer_mesh.mesh.outcomes import replay_rollouts
from composer_mesh.mesh.packing import (
    PROMPT_TOO_LONG, PairTokens, drop_reasons, explain_drops, pack_batch, pair_rows, pair_tokens, select_rollouts,
)
from composer_mesh.mesh.rollout_exchange import shard_points, train_step_sharded
from composer_mesh.mesh.requests import RequestLedger
from composer_mesh.mesh.supervision import (
    ActorHung, ControllerState, Deadline, Supervisor, is_actor_failure, is_alive, load_state, oldest_checkpoint, save_state,
)

logger = logging.getLogger(__name__)


# tasks whose episodes are the multi-turn tool loop (tool schemas in every prompt; `[env.tool_loop]` warm start)
TOOL_TASKS = ("tool_loop", "coding")


@dataclass(frozen=True)
class ControllerConfig:
    steps: int
    prompts_per_step: int
    max_seq_len: int
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 0
    # shared-memory segment slots (actors.weight_sync)
    weight_dir: str = "/dev/shm/composer-mesh-weights"
    # the slots' dtype: generator.dtype
    serving_dtype: str = "float32"
    # cross-host deltas with a full anchor every this many syncs; 1 = always full
    anchor_every: int = 1
    seed: int = 0
    # channel 2 (and RLSD): hint the first error site of each rollout `hint_targets` selects (`mesh.hinting`)
    hints: bool = True
    hint_targets: Literal["failed", "all_fail_groups"] = "failed"
    # channel 2 (`[loss] alpha > 0`); off, hints serve RLSD only: a rollout outside the policy channel gets none
    distill_channel: bool = True
    # channel 1 (`[loss] policy_weight > 0`); off, rollouts train only through hints
    policy_channel: bool = True
    # channel 3: preference pairs drawn from the replay actor per step
    pairs_per_step: int = 0
    # channel 3: only the unsolved rollouts of groups passing at most this often go to the teachers (None: all)
    replay_pass_limit: float | None = None
    # score pairs with the trainer's π_ref (DPO; TrainerActor.score(reference=True))
    dpo_reference: bool = True
    # tool schemas a pair's context is rendered with (a tool-loop task's; () = none)
    pair_tools: tuple[dict, ...] = ()
    # None: each generator's configured sampling
    sampling: SamplingParams | None = None
    # where a ControllerState is saved each step (beside the trainer checkpoints); "" = memory only
    state_dir: str = ""
    # per `generate` call: past it the generator is taken as hung; None = no bound
    deadline: Deadline | None = None
    # sampled tokens one request can cost: group_size × max_new_tokens × max_turns
    tokens_per_request: int = 0
    # generator.max_new_tokens (named when a prompt leaves no room for them)
    max_new_tokens: int = 0
    # held-out evaluation (mesh.evaluation); every=0: off
    eval: EvalConfig = field(default_factory=EvalConfig)
    # a step record carries its episodes' text every this many steps (metrics.rollouts_every); 0 = never
    rollouts_every: int = 0

    @classmethod
    def from_job(cls, job: JobConfig, *, steps: int, weight_dir: str, state_dir: str, replay: bool) -> ControllerConfig:
        """The one place the recipe becomes controller settings: `steps` left to run, the shared-memory
        `weight_dir`, where states are saved (`state_dir`, "" = memory only), whether a replay actor feeds pairs."""
        trainer, gen = job.trainer, job.generator
        return cls(
            steps=steps, prompts_per_step=trainer.prompts_per_step, max_seq_len=trainer.max_seq_len,
            policy=job.loss.policy, mode=trainer.mode, max_staleness=trainer.max_staleness, seed=job.job.seed,
            hints=job.loss.alpha > 0 or job.loss.distill.rlsd, hint_targets=job.loss.distill.targets,
            distill_channel=job.loss.alpha > 0,
            replay_pass_limit=job.replay.group_pass_limit, policy_channel=job.loss.policy_weight > 0,
            weight_dir=weight_dir,
            serving_dtype=gen.dtype, anchor_every=job.mesh.weight_sync_anchor_every,
            pairs_per_step=trainer.prompts_per_step if replay else 0,
            dpo_reference=job.loss.preference.needs_reference, state_dir=state_dir,
            pair_tools=tuple(offered_tools(job.env.tool_loop.tools)) if job.env.task in TOOL_TASKS else (),
            deadline=Deadline(job.mesh.hang_floor_s, job.mesh.hang_s_per_token),
            tokens_per_request=gen.group_size * gen.max_new_tokens * gen.max_turns, max_new_tokens=gen.max_new_tokens,
            eval=EvalConfig(trainer.eval_every, trainer.eval_samples,
                            SamplingParams.from_config(gen, seed=job.job.seed), trainer.eval_split,
                            trainer.eval_hinted),
            rollouts_every=job.metrics.rollouts_every,
        )


@dataclass
class StepRecord:
    """What one step trained on and what the trainer reported."""

    step: int
    metrics: dict[str, float]
    reward_mean: float
    # per trained group: trainer version − group policy version
    staleness: list[int]
    dropped_stale: int
    groups: int
    seconds: float
    # prompt seeds of the groups this step consumed
    seeds: list[int] = field(default_factory=list)
    # controller steps done after this one
    iteration: int = 0
    # "trace_id#step" of the preference pairs this step trained on
    pair_keys: list[str] = field(default_factory=list)
    # the step's episodes as `mesh.episode_metrics.rollout_record`s, on the steps `rollouts_every` asks for
    rollouts: list[dict[str, Any]] = field(default_factory=list)


# the run's phases an actor death is reported in (mesh.errors.phase); placement names "setup"
GENERATION, TRAIN_STEP, WEIGHT_SYNC, EVALUATION = ("generation", "a train step (or its checkpoint)", "a weight sync",
                                                  "held-out evaluation")


class Controller:
    """Drives one trainer mesh, a list of generator actors (one per process) and an optional replay actor.

    `prompt_cursor`: first fresh prompt index (`mesh.replicas` gives each replica group its own);
    `supervisor`: replaces dead actors (None: any actor failure ends the run); `state`: continue from a
    saved `ControllerState` (its version must be the trainer's; it sets the cursor too)."""

    def __init__(
        self,
        cfg: ControllerConfig,
        trainer: Any,
        generators: Sequence[Any],
        chat: ChatTokens,
        *,
        hinter: Any = None,
        replay: Any = None,
        on_step: Callable[[StepRecord], None] | None = None,
        prompt_cursor: int = 0,
        supervisor: Supervisor | None = None,
        state: ControllerState | None = None,
    ) -> None:
        if cfg.mode == "async" and cfg.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.cfg = cfg
        self.trainer = trainer
        self.generators = list(generators)
        self.chat = chat
        self.hints = HintMaker(hinter, chat, cfg.hint_targets) if cfg.hints and hinter is not None else None
        self.replay = replay
        self.on_step = on_step
        self.supervisor = supervisor
        self.prompts = RequestLedger(cfg.seed, prompt_cursor)
        self.version = rank0(trainer.policy_version.call().get())
        self.iteration = 0
        # async: generated, not yet trained
        self.buffer: list[RolloutGroup] = []
        # async: guards `buffer`; a worker accepts its groups and adds them to the buffer under it, so a snapshot
        # (taken under it too) sees every generated group either outstanding or buffered, never in between
        self._arrived = threading.Condition()
        # built on first use (DiLoCo replica controllers never sync)
        self._wsync: TopologySync | None = None
        # async workers re-plan it after a respawn while the controller publishes
        self._wsync_lock = threading.RLock()
        # the trainer's (mesh point, rank, world), kept until it restarts
        self._shards: list | None = None
        self._last_state: ControllerState | None = None
        # the slowest answered `generate` call's seconds per token (feeds the deadline)
        self._s_per_token = 0.0
        # (trainer version, held-out metrics), oldest first
        self.evals: list[tuple[int, dict[str, float]]] = []
        self._begun = False  # sync mode: begin() ran
        # the iteration the current run() / advance() stops at (None: not known yet)
        self._end: int | None = None
        if state is not None:
            if state.version != self.version:
                raise ValueError(f"controller state is for version {state.version}, the trainer is at {self.version}")
            self._restore(state)

    # ---- state and recovery --------------------------------------------------------------------

    def _snapshot(self, version: int, iteration: int) -> ControllerState:
        replay = self.replay.snapshot.call_one().get() if self.replay is not None else None
        with self._arrived:
            cursor, pending = self.prompts.position()
            hints = self.hints.state_dict() if self.hints is not None else None
            return ControllerState(version, iteration, cursor, pending, list(self.buffer), replay, hints)

    def _save_state(self, version: int, iteration: int) -> None:
        """Remember (and, with `state_dir`, write atomically) the state a checkpoint at `version` resumes with;
        then the replay actor works ahead from it."""
        self._last_state = self._snapshot(version, iteration)
        if self.cfg.state_dir:
            # older states can never be resumed
            keep_from = oldest_checkpoint(Path(self.cfg.state_dir).parent)
            save_state(self.cfg.state_dir, self._last_state, keep_from=keep_from)
        self._work_ahead(iteration)

    def _work_ahead(self, iteration: int) -> None:
        """Have the replay actor make the next step's pairs in the background (actors.teacher_replay) from the
        state just saved or restored, unless `iteration` is the run's last (no step would take them)."""
        if self.replay is None or self.cfg.pairs_per_step == 0:
            return
        if self._end is None or iteration < self._end:
            self.replay.work_ahead.call_one(self.cfg.pairs_per_step).get()

    def _restore(self, state: ControllerState) -> None:
        with self._arrived:
            self.prompts.restore(state.prompt_cursor, state.pending)
            self.buffer = list(state.buffer)
        self.iteration = state.iteration
        if self.hints is not None and state.hints is not None:
            self.hints.load_state_dict(state.hints)
        if self.replay is not None and state.replay is not None:
            self.replay.restore.call_one(state.replay).get()
            # as the run that saved the state did next
            self._work_ahead(state.iteration)
        self._last_state = state

    def _replace_generator(self, index: int, exc: BaseException) -> None:
        """Swap a dead generator for a new one (weights not loaded) and re-plan the weight sync around it;
        re-raises what no restart can fix."""
        if self.supervisor is None or not is_actor_failure(exc):
            raise exc
        self.generators[index] = self.supervisor.replace("generator", index, exc)
        with self._wsync_lock:
            if self._wsync is not None:
                self._wsync = self._wsync.replaced(index, self.generators[index])

    def _recover(self, exc: BaseException, resync: Callable[[], None]) -> None:
        """After a failed step: replace dead actors, roll back to the last state that matches the trainer,
        and `resync` the generators' weights (again, if a failure interrupts that)."""
        while True:
            self._replace_dead(exc)
            try:
                resync()
                return
            except Exception as again:
                exc = again

    def _replace_dead(self, exc: BaseException) -> None:
        if self.supervisor is None:
            raise exc
        if not is_actor_failure(exc) and is_alive(self.trainer.policy_version.call):
            # a real error; when a trainer rank dies its peers' collectives raise one first (probed here)
            raise exc
        if self.replay is not None and not is_alive(self.replay.info.call_one):
            self.replay = self.supervisor.replace("replay", 0, exc)
        for i, g in enumerate(self.generators):
            if not is_alive(g.policy_version.call_one):
                self._replace_generator(i, exc)
        state = self._last_state
        if not is_alive(self.trainer.policy_version.call):
            self.trainer = self.supervisor.replace("trainer", 0, exc)
            # the next sync and train step probe the new trainer actors
            with self._wsync_lock:
                self._wsync = None
            self._shards = None
            self.version = rank0(self.trainer.policy_version.call().get())
            state = load_state(self.cfg.state_dir, self.version) if self.cfg.state_dir else None
            if state is None:
                raise RuntimeError(f"the trainer restarted at version {self.version} but no controller state "
                                   f"was saved for it in {self.cfg.state_dir or '(no state_dir)'}") from exc
            if self.replay is not None:
                self.replay.set_trainer.call_one(self.trainer).get()
        if state is None or state.version != self.version:
            raise RuntimeError(f"no controller state for trainer version {self.version}") from exc
        self._restore(state)

    # ---- one step's data ---------------------------------------------------------------------

    def _per_generator(self, n: int) -> list[int]:
        k = len(self.generators)
        return [n // k + (1 if i < n % k else 0) for i in range(k)]

    def _answer(self, index: int, future: Any, requests: int, issued: float) -> list[RolloutGroup]:
        """Generator `index`'s groups for a `generate` call of `requests` requests issued at `issued`
        (time.monotonic); raises `ActorHung` when the call outlives its deadline (cfg.deadline)."""
        tokens = requests * self.cfg.tokens_per_request
        if self.cfg.deadline is None or tokens == 0:
            return future.get()
        limit = self.cfg.deadline.seconds(tokens, self._s_per_token)
        try:
            groups = future.get(timeout=max(0.01, issued + limit - time.monotonic()))
        except TimeoutError as exc:
            raise ActorHung(f"generator {index} did not answer {requests} requests ({tokens} tokens) "
                            f"within its {limit:.1f} s deadline") from exc
        self._s_per_token = max(self._s_per_token, (time.monotonic() - issued) / tokens)
        return groups

    def _generate_sync(self) -> list[RolloutGroup]:
        """This step's groups. A dead generator's share is re-issued, unchanged, to its replacement:
        the same batch with the same weights and seed samples the same rollouts."""
        requests = self.prompts.take(self.cfg.prompts_per_step)
        shares, at = [], 0
        for i, n in enumerate(self._per_generator(len(requests))):
            if n:
                shares.append((i, requests[at : at + n]))
                at += n
        groups: list[RolloutGroup] = []
        while shares:
            issued = time.monotonic()
            calls = [(i, share, self.generators[i].generate.call_one(share, self.cfg.sampling)) for i, share in shares]
            lost = []
            for i, share, future in calls:
                try:
                    groups += self.prompts.accept(self._answer(i, future, len(share), issued))
                except Exception as exc:
                    self._replace_generator(i, exc)
                    self.prompts.lose(share)
                    lost.append((i, len(share)))
                    # the weights the others sampled with
                    self._load(i, self._covering(i))
            # re-queued requests come out first, in order
            shares = [(i, self.prompts.take(n)) for i, n in lost]
        return sorted(groups, key=lambda g: g.group_id)

    def _pairs(self) -> tuple[list[PairTokens], tuple[torch.Tensor, torch.Tensor] | None, list[str]]:
        """This step's preference pairs from the replay actor, their frozen-reference scores (DPO) and keys."""
        if self.replay is None or self.cfg.pairs_per_step == 0:
            return [], None, []
        raw = self.replay.next_pairs.call_one(self.cfg.pairs_per_step).get()
        pairs = [pair_tokens(self.chat, p.context, p.chosen, p.rejected, self.cfg.pair_tools) for p in raw]
        keys = [f"{p.trace_id}#{p.step}" for p in raw]
        if not pairs or not self.cfg.dpo_reference:
            return pairs, None, keys
        # lazy: start-up time: actors.trainer pulls in TorchTitan, which only a DPO-scored pair needs here
        from composer_mesh.actors.trainer import ScoreBatch

        rows = pair_rows(pairs)
        refs = []
        for side in ("chosen", "rejected"):
            scored = rank0(self.trainer.score.call(ScoreBatch(
                rows[f"{side}_tokens_PS"], rows[f"{side}_positions_PS"], rows[f"{side}_labels_PS"],
            ), reference=True).get())
            refs.append(scored.logprob_sums_N)
        return pairs, (refs[0], refs[1]), keys

    def _train(self, groups: list[RolloutGroup], staleness: list[int], dropped: int, start: float) -> StepRecord:
        start_train = time.perf_counter()
        all_rollouts = [r for g in groups for r in g.rollouts]
        selection = select_rollouts(groups, self.cfg.policy)
        drops = drop_reasons(groups, selection, dropped)
        if not self.cfg.policy_channel:
            selection = replace(selection, in_policy=[False] * len(selection.rollouts))
        hints = self.hints.make(groups) if self.hints is not None else {}
        if not self.cfg.distill_channel:
            hints = {i: h for i, h in hints.items() if selection.in_policy[i]}
        # channel 3 live: the run's own failed turns go to the teachers
        replay_start = time.perf_counter()
        if self.replay is not None:
            self.replay.add_rollouts.call_one(replay_rollouts(groups, self.cfg.replay_pass_limit)).get()
        pairs, ref, pair_keys = self._pairs()
        replay_s = time.perf_counter() - replay_start
        rewards = [r.reward for r in all_rollouts]
        trains = bool(selection.policy_rollouts or hints or pairs)
        # a checkpoint of this step resumes with it
        self._save_state(self.version + int(trains), self.iteration + 1)
        if not trains or drops.counts[PROMPT_TOO_LONG]:
            why = explain_drops(drops, self.cfg.max_seq_len, self.cfg.max_new_tokens)
            logger.warning("step %d%s: %s", self.iteration + 1, "" if trains else " trained nothing", why)
        if not trains:
            # every group was dropped and no pairs came
            metrics: dict[str, float] = {"skipped": 1.0, "distill/hinted_tokens": 0.0}
        else:
            batch = pack_batch(selection, self.cfg.max_seq_len, hints, pairs, ref)
            if self._shards is None:
                self._shards = shard_points(self.trainer)
            # each rank receives only its shard
            train_start = time.perf_counter()
            metrics = train_step_sharded(self.trainer, batch, self._shards)
            metrics["time/train_call_s"] = time.perf_counter() - train_start
            metrics["distill/hinted_tokens"] = float(batch.distill_tokens)
            self.version = int(metrics["step"])
        self.iteration += 1
        metrics.update({
            "reward/mean": sum(rewards) / max(1, len(rewards)),
            "rollouts/completion_tokens": float(sum(r.completion_tokens for r in all_rollouts)),
            "rollouts/turns": sum(len(r.turn_spans) for r in all_rollouts) / max(1, len(all_rollouts)),
            "rollouts/policy": float(selection.policy_rollouts), "rollouts/dropped_groups": float(selection.dropped_groups),
            "distill/hinted": float(len(hints)), "preference/pairs_in_batch": float(len(pairs)),
            **(self.hints.metrics() if self.hints is not None else {}),
            "time/generate_s": start_train - start, "time/replay_s": replay_s,
            "async/max_staleness": float(max(staleness, default=0)), "async/dropped_stale": float(dropped),
            **drops.metrics(), **episode_metrics(all_rollouts),
        })
        every = self.cfg.rollouts_every
        records = [rollout_record(r) for r in all_rollouts] if every and self.iteration % every == 0 else []
        return StepRecord(self.version, metrics, metrics["reward/mean"], staleness, dropped, len(groups),
                          time.perf_counter() - start, [g.seed for g in groups], self.iteration, pair_keys=pair_keys,
                          rollouts=records)

    def step(self, *, sync_generators: bool = True) -> StepRecord:
        """One sync-mode step: generate with the generators' current weights, train, then sync them
        (`mesh.replicas` drives one Controller per DiLoCo replica group with sync_generators=False)."""
        start = time.perf_counter()
        groups = self._generate_sync()
        record = self._train(groups, [self.version - g.policy_version for g in groups], 0, start)
        if sync_generators:
            record.metrics.update(sync_metrics(self._sync_all()))
        return record

    # ---- held-out evaluation (mesh.evaluation) -------------------------------------------------

    def _eval_before(self) -> None:
        """A fresh run's held-out baseline, with the weights the run starts from (generators synced)."""
        if self.cfg.eval.every > 0 and self.iteration == 0:
            with phase(EVALUATION):
                self.evals.append((self.version, evaluate(self.generators, self.cfg.eval)))

    def _eval_after(self, record: StepRecord, end: int) -> None:
        """Every `eval.every` iterations and after the last: held-out metrics into `record.metrics`
        (sync: the weights just trained; async: those the generators loaded, at most `max_staleness` behind)."""
        every = self.cfg.eval.every
        if every > 0 and (self.iteration % every == 0 or self.iteration == end):
            with phase(EVALUATION):
                metrics = evaluate(self.generators, self.cfg.eval)
            self.evals.append((self.version, metrics))
            record.metrics.update(metrics)

    # ---- loops -------------------------------------------------------------------------------

    def run(self) -> list[StepRecord]:
        """Run `cfg.steps` controller steps from the current iteration; returns their records."""
        if self.cfg.mode == "async":
            # a trainer restart before the first checkpoint rolls back here
            self._save_state(self.version, self.iteration)
            return self._run_async()
        history: list[StepRecord] = []
        end = self._end = self.iteration + self.cfg.steps
        self.begin()
        while self.iteration < end:
            record = self.advance(end)
            if record is not None:
                self._emit(record, history)
        return history

    def _emit(self, record: StepRecord, history: list[StepRecord]) -> None:
        history.append(record)
        if self.on_step is not None:
            self.on_step(record)

    def _kept(self, record: StepRecord | None) -> bool:
        """After a recovery: did the failed step's training survive (the rollback landed after it)?"""
        return record is not None and record.iteration == self.iteration and record.step == self.version

    def begin(self) -> None:
        """Sync mode, once before the first step (later calls do nothing): save the state a trainer restart
        before the first checkpoint rolls back to, bring the generators to the trainer's weights (a resumed
        trainer is ahead of them) and take the held-out baseline."""
        if self._begun:
            return
        self._begun = True
        self._save_state(self.version, self.iteration)
        with phase("the first weight sync"):
            try:
                self._sync_all()
            except Exception as exc:
                self._recover(exc, self._sync_all)
        self._eval_before()

    def advance(self, end: int) -> StepRecord | None:
        """One sync-mode step: generate, train, sync the generators, evaluate when due (`end`: the run's last
        iteration, evaluated after), replacing dead actors on the way. None when a recovery rolled the step
        back (the caller runs it again); `begin()` must have run."""
        self._end = end
        start = time.perf_counter()
        record = None
        try:
            with phase(GENERATION):
                groups = self._generate_sync()
            with phase(TRAIN_STEP):
                record = self._train(groups, [self.version - g.policy_version for g in groups], 0, start)
            with phase(WEIGHT_SYNC):
                record.metrics.update(sync_metrics(self._sync_all()))
            self._eval_after(record, end)
        except Exception as exc:
            # a kept step's row gets the figures of the sync that brought its weights
            def resync() -> None:
                report = self._sync_all()
                if record is not None:
                    record.metrics.update(sync_metrics(report))

            self._recover(exc, resync)
            if not self._kept(record):
                return None
        return record

    # ---- weight sync (actors.weight_sync, docs/weight_sync.md) ------------------------------------

    def _weights(self) -> TopologySync:
        """The weight sync of the live trainer and generators, built on first use and after a trainer restart
        (whose republished versions reuse the same slots: each sync has its own token, so no generator takes
        the old trainer's bytes of a version for the new one's)."""
        with self._wsync_lock:
            if self._wsync is None:
                self._wsync = TopologySync(self.trainer, self.generators, self.cfg.weight_dir,
                                           keep=sync_keep(self.cfg.max_staleness), dtype=self.cfg.serving_dtype,
                                           anchor_every=self.cfg.anchor_every)
            return self._wsync

    def _sync_all(self) -> TopologySyncReport:
        """Sync mode: every generator loads the trainer's current weights (their digests must agree)."""
        return self._weights().sync()

    def _publish(self) -> None:
        """Async mode: publish the trainer's current weights for the workers to load; returns once the shards
        are in host memory (after the previous publication's remote pulls, whose slots it reuses)."""
        with self._wsync_lock:
            self._weights().publish()

    def _published(self) -> Publication | None:
        wsync = self._wsync
        return wsync.published if wsync is not None else None

    def _sealed(self, index: int, publication: Publication) -> bool:
        """Whether generator `index`'s host holds `publication` whole (waits for its remote pull, if any);
        False when the pull failed: the worker keeps its weights and the controller's next publish recovers."""
        wsync = self._wsync
        return wsync is not None and publication.sealed(wsync.host_of(index))

    def _covering(self, index: int) -> Publication:
        """The newest publication generator `index` (a replacement) can load from its host."""
        with self._wsync_lock:
            return self._weights().covering([index])

    def _load(self, index: int, publication: Publication) -> int:
        """Load `publication` into generator `index`; raises unless it reports that version and the digest the
        other loads of it reported. Returns the version."""
        publication.check([publication.load(self.generators[index]).get()])
        return publication.version

    def _run_async(self) -> list[StepRecord]:
        history: list[StepRecord] = []
        end = self._end = self.iteration + self.cfg.steps
        try:
            # the workers load the trainer's current weights before their first call
            self._publish()
        except Exception as exc:
            self._recover(exc, self._publish)
        self._eval_before()
        workers = AsyncWorkers(self)
        workers.start()
        failed = True
        try:
            while self.iteration < end:
                start = time.perf_counter()
                record = None
                try:
                    with phase(GENERATION):
                        groups, dropped = workers.collect()
                    with phase(TRAIN_STEP):
                        record = self._train(groups, [self.version - g.policy_version for g in groups], dropped,
                                             start)
                    with phase(WEIGHT_SYNC):
                        self._publish()
                    # the weights each generator holds (eval/policy_version: oldest)
                    self._eval_after(record, end)
                except Exception as exc:
                    workers.stop(0)
                    self._recover(exc, self._publish)
                    workers.start()
                    if not self._kept(record):
                        continue
                self._emit(record, history)
            failed = False
        finally:
            workers.stop(0 if failed else 600)
        return history
