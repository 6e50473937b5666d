"""Baseline weight publishing: HF-named buckets as safetensors files in host shared memory.

The trainer's rank 0 writes each exported bucket (`titan_ext.hf.adapters`) to
`<root>/v<version>/bucket_<i>.safetensors` (root defaults to /dev/shm, i.e.
memory) and returns a `WeightManifest`; generators on the host map the files
and copy the tensors into their live parameters. Older versions beyond
`keep` are deleted after a publish, so a generator still loading version v
when v+1 appears is safe with keep >= 2. One copy per host; crossing hosts is
the topology-aware path's job (RDMA), not this one's.

`weights_digest` hashes (name, dtype, shape, bytes) in name order: the trainer
digests what it exported, a generator what it holds under those names, and
equal digests mean bit-identical weights.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

DEFAULT_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


@dataclass(frozen=True)
class WeightManifest:
    """Where version `version`'s weights are, and the digest of all of them."""

    version: int
    files: tuple[str, ...]
    names: tuple[str, ...]
    digest: str
    nbytes: int


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) in name order."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def uncovered_names(state: dict[str, torch.Tensor], names: Iterable[str]) -> list[str]:
    """Sorted names of `state` whose storage address no name in `names` covers (tied weights: either name
    covers both; fused-weight views are separate addresses)."""
    covered = {state[n].data_ptr() for n in names if n in state}
    return sorted(n for n, t in state.items() if t.data_ptr() not in covered)


def first_names(state: dict[str, torch.Tensor]) -> list[str]:
    """One name per tensor of `state` (name -> live tensor): a tied tensor under its first name, in `state`'s
    order (the trainer's export names tied weights that way)."""
    first: dict[int, str] = {}
    for name, t in state.items():
        first.setdefault(t.data_ptr(), name)
    return list(first.values())


def check_coverage(state: dict[str, torch.Tensor], names: Iterable[str], version: int) -> None:
    """Refuse weights whose `names` are not exactly the engine's tensors (`state`: name -> live tensor).

    Coverage is by tensor address, so tied weights (one tensor, two names) are covered by either name
    and fused-weight views count separately. Checked before any copy: a refused version changes nothing.
    """
    names = list(names)
    unknown = [n for n in names if n not in state]
    uncovered = uncovered_names(state, names)
    if unknown or uncovered:
        raise ValueError(
            f"weights v{version} do not match the generator model: unknown {unknown[:5]}, "
            f"not covered {uncovered[:5]}"
        )


def publish_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]], directory: str | Path, version: int,
                    keep: int = 2) -> WeightManifest:
    """Write every bucket under `directory/v<version>` (atomically renamed) and prune old versions."""
    from safetensors.torch import save_file

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
    from safetensors import safe_open

    for path in manifest.files:
        if not Path(path).is_file():
            raise FileNotFoundError(f"weights of version {manifest.version} are gone: {path} (pruned or another host)")
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
