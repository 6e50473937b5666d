"""Baseline weight sync: trainer → generators through host shared memory, digest-checked.

After an optimizer step the trainer mesh exports HF-named buckets and its rank
0 writes them as safetensors under a shared-memory folder
(`TrainerActor.publish_weights`); every generator loads that manifest into its
running engine (`GeneratorActor.update_weights`) and reports the digest of
what it now holds. A generator whose digest differs from the trainer's is an
error, never a silent divergence. Correct on one host (all procs see the
folder); the topology-aware path (RDMA, one copy per host) replaces it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from actors.weights import WeightManifest


def rank0(values: Any) -> Any:
    """The value rank 0 returned from a mesh-wide `.call()`."""
    return next(iter(values.values()))


@dataclass(frozen=True)
class SyncReport:
    manifest: WeightManifest
    generators: int
    publish_s: float
    load_s: float


def sync_weights(trainer_mesh: Any, generator_mesh: Any, directory: str, keep: int = 2) -> SyncReport:
    """Publish the trainer's current weights and load them into every generator; raises on a digest mismatch."""
    start = time.perf_counter()
    manifest: WeightManifest = rank0(trainer_mesh.publish_weights.call(directory, keep).get())
    published = time.perf_counter()
    results = list(generator_mesh.update_weights.call(manifest).get().values())
    bad = [i for i, r in enumerate(results) if r["digest"] != manifest.digest or r["version"] != manifest.version]
    if bad:
        raise RuntimeError(f"weight sync v{manifest.version}: generators {bad} hold different weights than the trainer")
    return SyncReport(manifest, len(results), published - start, time.perf_counter() - published)
