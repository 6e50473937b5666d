"""Rollout exchange: each trainer rank receives only its data-parallel shard of a training batch.

`TrainerActor.train_step` takes the global batch and every rank slices its own
part, so the controller ships every row to every rank. `train_step_sharded`
slices on the controller instead (`TrainBatch.shard`, the same split) and sends
rank r only shard r (`TrainerActor.train_step_shard`): bytes sent per step drop
from world × batch to one batch, and the result is identical.
"""

from __future__ import annotations

from typing import Any

from composer_mesh.titan_ext.batch import TrainBatch


def shard_points(trainer: Any) -> list[tuple[Any, int, int]]:
    """(mesh point, data-parallel rank, data-parallel size) of every trainer process."""
    return [(point, info["rank"], info["world"]) for point, info in trainer.host_info.call().get().items()]


def train_step_sharded(trainer: Any, batch: TrainBatch, points: list[tuple[Any, int, int]] | None = None
                       ) -> dict[str, float]:
    """One collective train step with rank r receiving only `batch.shard(r, world)`; rank 0's metrics.

    points: `shard_points(trainer)`, when the caller keeps them (they change only with the trainer mesh)."""
    points = shard_points(trainer) if points is None else points
    futures = {rank: trainer.slice(**point).train_step_shard.call_one(batch.shard(rank, world))
               for point, rank, world in points}
    # issued to all ranks before waiting: collective
    results = {rank: f.get() for rank, f in futures.items()}
    return results[0]
