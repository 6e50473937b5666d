"""The controller loop: rollouts → packed batch → train step → weight sync, sync or async.

Plain Python in the launching process, holding actor meshes. One step:

1. take `prompts_per_step` rollout groups (sync: generated now with the
   current weights; async: from a buffer the generators fill in the background);
2. GRPO advantages and dynamic sampling, hints for error sites (channel 2),
   preference pairs from the teacher-replay actor (channel 3, optional);
3. pack one global `TrainBatch` and call `train_step` on the trainer mesh;
4. publish the new weights. Sync mode loads them into every generator before
   the next step (on-policy: staleness 0). Async mode lets each generator
   worker pick up the newest published weights between its own `generate`
   calls, so generation overlaps training; a group sampled with policy
   version v is trained at trainer version t only if t − v ≤ `max_staleness`,
   older groups are dropped. The generator logprobs travel with every sample,
   so the loss's TIS / mismatch correction sees what the generator used.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch

from actors.episodes import ChatTokens
from actors.rollout import EpisodeRequest, RolloutGroup, SamplingParams
from actors.weights import WeightManifest
from configs.sections.loss import PolicyLossConfig
from mesh.packing import PairTokens, make_hint, pack_batch, pair_tokens, select_rollouts
from mesh.rollout_exchange import train_step_sharded
from mesh.weight_sync_baseline import rank0, sync_weights


@dataclass(frozen=True)
class ControllerConfig:
    steps: int
    prompts_per_step: int
    max_seq_len: int
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 0
    weight_dir: str = "/dev/shm/composer-mesh-weights"
    seed: int = 0
    hints: bool = True  # channel 2: hint the first error site of each failed rollout
    pairs_per_step: int = 0  # channel 3: preference pairs drawn from the replay actor per step
    dpo_reference: bool = True  # score pairs with the trainer's π_ref (DPO; TrainerActor.score(reference=True))
    sampling: SamplingParams | None = None  # None: each generator's configured sampling


@dataclass
class StepRecord:
    """What one step trained on and what the trainer reported."""

    step: int
    metrics: dict[str, float]
    reward_mean: float
    staleness: list[int]  # per trained group: trainer version − group policy version
    dropped_stale: int
    groups: int
    seconds: float


class _Prompts:
    """Thread-safe cursor over environment seeds: request i is problem seed `seed * 1_000_003 + i`."""

    def __init__(self, seed: int, start: int = 0) -> None:
        self.seed, self.next, self.lock = seed, start, threading.Lock()

    def take(self, n: int) -> list[EpisodeRequest]:
        with self.lock:
            ids = range(self.next, self.next + n)
            self.next += n
        return [EpisodeRequest(group_id=i, seed=self.seed * 1_000_003 + i) for i in ids]


class Controller:
    """Drives one trainer mesh, a list of generator actors (one per process) and an optional replay actor."""

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
    ) -> None:
        if cfg.mode == "async" and cfg.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.cfg = cfg
        self.trainer = trainer
        self.generators = list(generators)
        self.chat = chat
        self.hinter = hinter
        self.replay = replay
        self.on_step = on_step
        self.prompts = _Prompts(cfg.seed, prompt_cursor)
        self.version = rank0(trainer.policy_version.call().get())
        self._manifest: WeightManifest | None = None
        self._manifest_lock = threading.Lock()

    # ---- one step's data ---------------------------------------------------------------------

    def _per_generator(self, n: int) -> list[int]:
        k = len(self.generators)
        return [n // k + (1 if i < n % k else 0) for i in range(k)]

    def _generate_sync(self) -> list[RolloutGroup]:
        futures = [
            g.generate.call_one(self.prompts.take(n), self.cfg.sampling)
            for g, n in zip(self.generators, self._per_generator(self.cfg.prompts_per_step)) if n
        ]
        return [group for f in futures for group in f.get()]

    def _pairs(self) -> tuple[list[PairTokens], tuple[torch.Tensor, torch.Tensor] | None]:
        if self.replay is None or self.cfg.pairs_per_step == 0:
            return [], None
        raw = self.replay.next_pairs.call_one(self.cfg.pairs_per_step).get()
        pairs = [pair_tokens(self.chat, p.context, p.chosen, p.rejected) for p in raw]
        if not pairs or not self.cfg.dpo_reference:
            return pairs, None
        from actors.trainer import ScoreBatch
        from mesh.packing import pair_rows

        rows = pair_rows(pairs)
        refs = []
        for side in ("chosen", "rejected"):
            scored = rank0(self.trainer.score.call(ScoreBatch(
                rows[f"{side}_tokens_PS"], rows[f"{side}_positions_PS"], rows[f"{side}_labels_PS"],
            ), reference=True).get())
            refs.append(scored.logprob_sums_N)
        return pairs, (refs[0], refs[1])

    def _train(self, groups: list[RolloutGroup], staleness: list[int], dropped: int, start: float) -> StepRecord:
        selection = select_rollouts(groups, self.cfg.policy)
        hints = {}
        if self.cfg.hints and self.hinter is not None:
            for i, r in enumerate(selection.rollouts):
                hint = make_hint(self.chat, r, self.hinter)
                if hint is not None:
                    hints[i] = hint
        if self.replay is not None:  # channel 3 live: the run's own failed turns go to the teachers
            self.replay.add_rollouts.call_one([r for g in groups for r in g.rollouts]).get()
        pairs, ref = self._pairs()
        rewards = [r.reward for g in groups for r in g.rollouts]
        if not (selection.policy_rollouts or hints or pairs):
            metrics: dict[str, float] = {"skipped": 1.0}  # every group had equal rewards and no pairs came
        else:
            batch = pack_batch(selection, self.cfg.max_seq_len, hints, pairs, ref)
            metrics = train_step_sharded(self.trainer, batch)  # each rank receives only its shard
            self.version = int(metrics["step"])
        metrics.update({
            "reward/mean": sum(rewards) / max(1, len(rewards)),
            "rollouts/policy": float(selection.policy_rollouts), "rollouts/dropped_groups": float(selection.dropped_groups),
            "distill/hinted": float(len(hints)), "preference/pairs_in_batch": float(len(pairs)),
            "async/max_staleness": float(max(staleness, default=0)), "async/dropped_stale": float(dropped),
        })
        return StepRecord(self.version, metrics, metrics["reward/mean"], staleness, dropped, len(groups),
                          time.perf_counter() - start)

    def step(self, *, sync_generators: bool = True) -> StepRecord:
        """One sync-mode step: generate with the generators' current weights, train, then sync them
        (`mesh.replicas` drives one Controller per DiLoCo replica group with sync_generators=False)."""
        start = time.perf_counter()
        groups = self._generate_sync()
        record = self._train(groups, [self.version - g.policy_version for g in groups], 0, start)
        if sync_generators:
            self._sync_all()
        return record

    # ---- loops -------------------------------------------------------------------------------

    def run(self) -> list[StepRecord]:
        return self._run_sync() if self.cfg.mode == "sync" else self._run_async()

    def _emit(self, record: StepRecord, history: list[StepRecord]) -> None:
        history.append(record)
        if self.on_step is not None:
            self.on_step(record)

    def _run_sync(self) -> list[StepRecord]:
        history: list[StepRecord] = []
        self._sync_all()  # generators may hold older weights than a resumed trainer
        for _ in range(self.cfg.steps):
            start = time.perf_counter()
            groups = self._generate_sync()
            record = self._train(groups, [self.version - g.policy_version for g in groups], 0, start)
            self._sync_all()
            self._emit(record, history)
        return history

    def _sync_all(self) -> None:
        for g in self.generators:
            sync_weights(self.trainer, g, self.cfg.weight_dir)

    def _publish(self) -> None:
        manifest = rank0(self.trainer.publish_weights.call(self.cfg.weight_dir, 2 + self.cfg.max_staleness).get())
        with self._manifest_lock:
            self._manifest = manifest

    def _worker(self, gen: Any, n: int, out: "queue.Queue[Any]", stop: threading.Event) -> None:
        """Async generation: load the newest published weights, generate, hand the groups over, repeat."""
        loaded = -1
        try:
            while not stop.is_set():
                with self._manifest_lock:
                    manifest = self._manifest
                if manifest is not None and manifest.version != loaded:
                    result = gen.update_weights.call_one(manifest).get()
                    if result["digest"] != manifest.digest:
                        raise RuntimeError(f"generator holds different weights than published v{manifest.version}")
                    loaded = manifest.version
                out.put(gen.generate.call_one(self.prompts.take(n), self.cfg.sampling).get())
        except BaseException as exc:  # surfaces in the controller thread
            out.put(exc)

    def _run_async(self) -> list[StepRecord]:
        history: list[StepRecord] = []
        out: "queue.Queue[Any]" = queue.Queue()
        stop = threading.Event()
        per = max(1, self.cfg.prompts_per_step // len(self.generators))
        self._publish()  # the workers load the trainer's current weights before their first call
        workers = [threading.Thread(target=self._worker, args=(g, per, out, stop), daemon=True) for g in self.generators]
        for w in workers:
            w.start()
        buffer: list[RolloutGroup] = []
        failed = True
        try:
            for _ in range(self.cfg.steps):
                start = time.perf_counter()
                dropped = 0
                while True:
                    fresh = [g for g in buffer if self.version - g.policy_version <= self.cfg.max_staleness]
                    dropped += len(buffer) - len(fresh)
                    buffer = fresh
                    if len(buffer) >= self.cfg.prompts_per_step:
                        break
                    item = out.get()
                    if isinstance(item, BaseException):
                        raise RuntimeError("a generator worker failed") from item
                    buffer.extend(item)
                groups, buffer = buffer[: self.cfg.prompts_per_step], buffer[self.cfg.prompts_per_step :]
                record = self._train(groups, [self.version - g.policy_version for g in groups], dropped, start)
                self._publish()
                self._emit(record, history)
            failed = False
        finally:
            stop.set()
            for w in workers:  # after a failure, leave the daemon workers rather than wait on a stuck call
                w.join(timeout=0 if failed else 600)
        return history
