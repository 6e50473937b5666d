"""The endpoint weight sync, kept as a test oracle for the topology-aware sync (`actors.weight_sync`).

The trainer's rank 0 writes each exported HF-named bucket (`titan_ext.hf.adapters`)
to `<root>/v<version>/bucket_<i>.safetensors` and returns a `WeightManifest`
(`EndpointTrainer.publish_weights`); every generator maps the files, copies the
tensors into its running engine and reports the digest of what it now holds
(`EndpointGenerator.update_weights`). `sync_weights` raises when a generator's
digest differs from the trainer's. Older versions beyond `keep` are deleted
after a publish. It shares no code with the segment path beyond the engines'
`load_weights` and the digest, which makes it the reference that path is
checked against (tests and `benchmarks/weight_sync.py`).

The actor classes are pickled by value (`cloudpickle.register_pickle_by_value`),
so their processes need not import this file from the tests folder; globals
the pickled functions use are modules or importable functions (`safe_open`, a
Rust class, is reached through its module: cloudpickle cannot pickle it).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import cloudpickle
import safetensors
import torch
import torch.distributed as dist
from monarch.actor import endpoint
from safetensors.torch import save_file

from composer_mesh.actors.generator import GeneratorActor
from composer_mesh.actors.mesh_utils import rank0
from composer_mesh.actors.trainer import TrainerActor
from composer_mesh.actors.weight_sync.digest import weights_digest

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(frozen=True)
class WeightManifest:
    """Where version `version`'s weights are, and the digest of all of them."""

    version: int
    files: tuple[str, ...]
    names: tuple[str, ...]
    digest: str
    nbytes: int


def publish_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]], directory: str | Path, version: int,
                    keep: int = 2) -> WeightManifest:
    """Write every bucket under `directory/v<version>` (atomically renamed) and prune old versions."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(directory)
    final = root / f"v{version}"
    tmp = root / f".v{version}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files, names, hashed, nbytes = [], [], [], 0
    for i, bucket in enumerate(buckets):
        tensors = {name: t.detach().contiguous().cpu() for name, t in bucket}
        path = tmp / f"bucket_{i:04d}.safetensors"
        save_file(tensors, str(path))
        files.append(final / path.name)
        names += list(tensors)
        hashed += list(tensors.items())
        nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(set(names)) != len(names):
        raise ValueError("a weight name appears in two buckets")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    versions = sorted((int(p.name[1:]) for p in root.glob("v*") if p.name[1:].isdigit()), reverse=True)
    for old in versions[keep:]:
        shutil.rmtree(root / f"v{old}", ignore_errors=True)
    return WeightManifest(version, tuple(str(f) for f in files), tuple(names), weights_digest(hashed), nbytes)


def read_manifest(manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the manifest, file by file (memory-mapped reads)."""
    for path in manifest.files:
        if not Path(path).is_file():
            raise FileNotFoundError(f"weights of version {manifest.version} are gone: {path} (pruned or another host)")
        with safetensors.safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class EndpointTrainer(TrainerActor):
    """`TrainerActor` plus `publish_weights`: the collective HF export, written by rank 0."""

    @endpoint
    def publish_weights(self, directory: str, keep: int = 2) -> WeightManifest | None:
        """Export HF-named weights; rank 0 writes them under `directory` and returns the manifest (others: None)."""
        t = self._t()
        buckets = t.export_weights()
        if dist.get_rank() == 0:
            manifest = publish_buckets(buckets, directory, t.step, keep=keep)
        else:
            # the gathers are collective: every rank walks every bucket
            for _ in buckets:
                pass
            manifest = None
        dist.barrier()
        return manifest


class EndpointGenerator(GeneratorActor):
    """`GeneratorActor` plus `update_weights`: a manifest loaded in place."""

    @endpoint
    def update_weights(self, manifest: WeightManifest) -> dict:
        """Load `manifest` in place; returns {"version", "digest"} of what the engine now holds."""
        self.engine.check_coverage(manifest.names, manifest.version)
        self.engine.load_weights(read_manifest(manifest))
        self.version = manifest.version
        return {"version": self.version, "digest": self.engine.digest(manifest.names)}


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
