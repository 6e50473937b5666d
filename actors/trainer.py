"""`TrainerActor`: `titan_ext.trainer.Trainer` on the trainer mesh, one actor per rank.

Every endpoint is collective: call it on the whole mesh (`.call(...)`), each
rank does its part and the ranks agree on the result (rank 0's is the one to
read). `train_step` takes the *global* `TrainBatch` and trains on this rank's
share (`TrainBatch.shard`), so the controller never needs to know the data-
parallel layout. The policy version is the number of optimizer steps taken.

`score` gives per-token logprobs and entropies of given sequences under the
current policy (no gradient), for teacher gating; with `reference=True` under
DPO's reference π_ref, the frozen initial weights the trainer keeps
(`Trainer.reference`, sharded like the policy).
Weights reach generators through `publish_shards` (`actors.weight_sync`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from monarch.actor import Actor, endpoint, this_proc
from monarch.rdma import RDMABuffer

from composer_mesh.actors.chaos import kill_point
from composer_mesh.actors.mesh_utils import host_label
from composer_mesh.actors.phase_memory import PhaseMemory, bound_malloc_retention
from composer_mesh.actors.weight_sync.encoder import DeltaEncoderActor, DeltaPlan, process_encoder
from composer_mesh.actors.weight_sync.digest import weights_digest
from composer_mesh.actors.weight_sync.segment import Piece, SegmentLayout, coalesce
from composer_mesh.actors.weight_sync.writer import SegmentWriter, write_shards
from composer_mesh.losses.logprobs import chunked_token_stats
from composer_mesh.titan_ext.batch import IGNORE_INDEX, TrainBatch
from composer_mesh.titan_ext.spec import TrainerSpec

if TYPE_CHECKING:
    from composer_mesh.titan_ext.trainer import Trainer


@dataclass
class ScoreBatch:
    """Sequences to score: `[N, S]` ids, positions, and the next-token label at each position (-100 = skip)."""

    tokens_NS: torch.Tensor
    positions_NS: torch.Tensor
    labels_NS: torch.Tensor

    def __post_init__(self) -> None:
        shape = tuple(self.tokens_NS.shape)
        if len(shape) != 2 or tuple(self.positions_NS.shape) != shape or tuple(self.labels_NS.shape) != shape:
            raise ValueError(
                f"tokens, positions and labels must share one [N, S] shape, got {shape}, "
                f"{tuple(self.positions_NS.shape)}, {tuple(self.labels_NS.shape)}"
            )


@dataclass
class ScoreResult:
    """Per-token log π(label) and entropy H(π) `[N, S]` (0 where the label is -100), and per-row sums `[N]`."""

    logprobs_NS: torch.Tensor
    entropy_NS: torch.Tensor
    logprob_sums_N: torch.Tensor
    tokens_N: torch.Tensor  # scored tokens per row
    version: int


@dataclass
class ShardReport:
    """What one trainer rank wrote for a weight version: its byte runs of the host segment, and RDMA
    buffers over them when other hosts pull them (`expose`)."""

    rank: int
    host: str
    version: int
    layout: SegmentLayout
    pieces: list[Piece]
    # monarch.rdma.RDMABuffer per piece, or [] when not exposed
    buffers: list
    published: bool  # this rank sealed the host's segment
    write_s: float
    # exposed ranks with deltas on: changes since this rank's previous publication, encoded in the background
    delta: DeltaPlan | None = None
    # the DeltaEncoderActor on this rank's process that serves the delta's chunks (None without a delta)
    encoder: Any = None


class TrainerActor(Actor):
    """Endpoints: setup, train_step, score, save_checkpoint, load_checkpoint,
    weights_digest, policy_version; topology-aware sync: host_info, publish_shards, train_step_shard."""

    def __init__(self, spec: TrainerSpec) -> None:
        self.spec = spec
        self.trainer: Trainer | None = None
        # version -> mapping + RDMA buffers kept alive
        self._exposed: dict[int, tuple[SegmentWriter, list]] = {}
        # exposed ranks with deltas on: the serving-dtype runs published last, and the thread encoding against them
        self._encoder = process_encoder()
        # the actor serving its chunks to readers (spawned on first use)
        self._encoder_actor: Any = None
        self.memory = PhaseMemory()
        bound_malloc_retention()

    def _t(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError("call setup() on the trainer mesh first")
        return self.trainer

    @endpoint
    def setup(self) -> dict:
        """Join the process group and build model, optimizer and schedule (resumes from a checkpoint if one exists)."""
        kill_point("trainer", "setup")
        if self.trainer is None:
            if self.spec.torch_threads:
                torch.set_num_threads(self.spec.torch_threads)
            # lazy: the controller imports this module to spawn the actor (titan_ext.spec)
            from composer_mesh.titan_ext.trainer import Trainer

            with self.memory.phase("load"):
                self.trainer = Trainer(self.spec)
            # a checkpoint inside a step is a phase of its own
            self.trainer.phase = self.memory.phase
        return {
            "rank": dist.get_rank(), "world": dist.get_world_size(), "step": self.trainer.step, "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in self.trainer.model.parameters()),
        }

    @endpoint
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; metrics are reduced over ranks."""
        t = self._t()
        with self.memory.phase("step"):
            return t.train_step(batch.shard(dist.get_rank(), dist.get_world_size()))

    @endpoint
    def score(self, batch: ScoreBatch, reference: bool = False) -> ScoreResult:
        """Logprobs and entropies of `batch` (every rank runs the whole batch) under the current weights,
        or with `reference=True` under DPO's π_ref: the trainer's frozen initial weights when it keeps
        them (`trainer.dpo_reference = "frozen"`), else the current weights."""
        t = self._t()
        model = t.reference if reference and t.reference is not None else t.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                hidden_NSD = t.hidden_states(batch.tokens_NS, batch.positions_NS, model)
                labels_NS = batch.labels_NS.to(t.device)
                N, S, D = hidden_NSD.shape
                stats = chunked_token_stats(
                    hidden_NSD.reshape(N * S, D), t.head_weight(model), labels_NS.reshape(-1),
                    want_entropy=True, chunk_tokens=t.spec.loss.chunk_tokens or None,
                )
        finally:
            model.train(was_training)
        valid_NS = (labels_NS != IGNORE_INDEX).cpu()
        logprobs_NS = torch.where(valid_NS, stats.logprobs.reshape(N, S).float().cpu(), 0.0)
        entropy_NS = torch.where(valid_NS, stats.entropy.reshape(N, S).float().cpu(), 0.0)
        return ScoreResult(logprobs_NS, entropy_NS, logprobs_NS.sum(-1), valid_NS.sum(-1), t.step)

    @endpoint
    def save_checkpoint(self) -> str:
        with self.memory.phase("checkpoint"):
            return str(self._t().save_checkpoint())

    @endpoint
    def save_hf(self, out_dir: str) -> str:
        """Write the current weights as a servable HF directory (all ranks gather; rank 0 writes)."""
        with self.memory.phase("export"):
            return str(self._t().save_hf_dir(out_dir))

    @endpoint
    def memory_phases(self) -> dict[str, dict[str, int]]:
        """This rank's peak memory per phase so far (`actors.phase_memory`)."""
        return self.memory.report()

    @endpoint
    def load_checkpoint(self, step: int) -> int:
        t = self._t()
        t.load_checkpoint(step)
        return t.step

    @endpoint
    def weights_digest(self, dtype: str | None = None) -> str:
        """Digest of the full HF-named weights as exported (collective), cast to `dtype` when given (a serving
        dtype), for checks against generators."""
        cast = getattr(torch, dtype) if dtype else None
        return weights_digest(kv for bucket in self._t().export_weights(cast) for kv in bucket)

    @endpoint
    def policy_version(self) -> int:
        return self._t().step

    # ---- topology-aware weight sync and rollout exchange (actors.weight_sync, mesh.rollout_exchange) ----

    @endpoint
    def host_info(self) -> dict:
        self._t()
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "host": host_label(), "pid": os.getpid(),
                # what generators need to name the tensors
                "shadow": (self.spec.model, self.spec.parallelism)}

    @endpoint
    def publish_shards(self, root: str, token: str, parties: dict[str, int], keep: int = 2,
                       expose: tuple[int, ...] = (), dtype: str = "float32",
                       delta: Literal["off", "anchor", "delta"] = "off") -> ShardReport:
        """Copy this rank's shards of the current weights into this host's segment for version `step`
        (no collective), cast to the serving `dtype`; the last of `parties[host]` writers seals it. Ranks in
        `expose` keep RDMA buffers over their runs for readers on other hosts (until `keep` newer versions exist).

        delta (exposed ranks; `actors.weight_sync.delta`): "delta" also encodes the runs against this rank's previous
        publication (when it has one) for readers to apply; "anchor" only keeps this version as the next base;
        "off" keeps no base. The encoding runs in the background
        (`actors.weight_sync.encoder`): this returns once the shards are sealed; a failed encoding is raised by the
        rank's next publication."""
        t = self._t()
        kill_point("trainer", "first_sync")
        exposed = dist.get_rank() in expose
        if exposed:
            # the previous encoding reads a sealed version whose slot this one may reuse; a failure is raised here
            self._encoder.finish()
        start = time.perf_counter()
        self.memory.begin()
        with SegmentWriter(root, host_label(), t.step, token, SegmentLayout.from_model(t.model, getattr(torch, dtype)),
                           keep) as writer:
            runs = write_shards(t.model, writer)
            # the device-to-host copies are done before the seal
            if torch.device(t.device).type == "cuda":
                torch.cuda.synchronize()
            published = writer.done(parties[host_label()])
        pieces = coalesce(runs)
        buffers: list = []
        plan, encoder = None, None
        if exposed:
            buffers = [RDMABuffer(writer.payload[p.offset : p.offset + p.nbytes]) for p in pieces]
            # a version published again (a covering publication) replaces its buffers; its pulls are done
            stale = self._exposed.pop(t.step, (None, []))[1]
            self._exposed[t.step] = (writer, buffers)
            for old in sorted(self._exposed)[:-keep]:
                stale += self._exposed.pop(old)[1]
            for buf in stale:
                buf.drop().get()
            # last, so the encoding thread does not slow the above, which the next step waits for; the sealed
            # version stays unchanged while it runs: its slot is reused only `keep` versions later
            plan = self._delta(writer, runs, t.step, token, getattr(torch, dtype).itemsize, delta)
            if plan is not None:
                if self._encoder_actor is None:
                    self._encoder_actor = this_proc().spawn("delta_encoder", DeltaEncoderActor)
                encoder = self._encoder_actor
        self.memory.end(self.memory.first_or("first_sync", "sync"))
        return ShardReport(dist.get_rank(), host_label(), t.step, writer.layout, pieces, buffers, published,
                           time.perf_counter() - start, plan, encoder)

    def _delta(self, writer: SegmentWriter, runs: list[Piece], version: int, token: str, itemsize: int,
               mode: str) -> DeltaPlan | None:
        """Start this rank's delta against its base in the background (mode "delta", when it has one; its plan),
        making this version the next base; the encoding waits for the host's seal, so it never slows another
        rank's copy."""
        if mode == "off":
            self._encoder.drop()
            return None
        if mode not in ("anchor", "delta"):
            raise ValueError(f"delta must be 'off', 'anchor' or 'delta', got {mode!r}")
        return self._encoder.submit(writer.payload, runs, version, token, itemsize, encode=mode == "delta",
                                    ready=writer.sealed)

    @endpoint
    def train_step_shard(self, shard: TrainBatch) -> dict[str, float]:
        """`train_step` on a batch that is already this rank's data-parallel shard (`mesh.rollout_exchange`)."""
        kill_point("trainer", "step")
        with self.memory.phase("step"):
            return self._t().train_step(shard)
