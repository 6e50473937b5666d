"""Reading a sealed version: pinning it, and copying it into a generator's engine under HF names.

A generator maps the segment and sees full TorchTitan tensors as zero-copy
views, renames them to HF with the export's own code (`titan_ext.hf.adapters
.iter_hf_buckets` over a meta-built "shadow" model whose parameters are those
views) and copies them into its engine through `load_weights(named)`.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from composer_mesh.actors.weight_sync.mapping import SlotHold, SlotMapping, map_slot, one_thread
from composer_mesh.actors.weight_sync.pull_status import dead_puller, failure_path
from composer_mesh.actors.weight_sync.segment import HEADER, Header, SegmentLayout, host_dir, slot_views


class PinnedSegment(SlotHold):
    """A sealed version held for reading (a shared lock on its slot, so no writer can reuse the slot): its
    views stay valid and unchanged until `release()` or the end of a `with` block."""

    def __init__(self, path: Path, fd: int, header: Header) -> None:
        # owned only once fully built (the caller closes it if this raises)
        self.fd = -1
        self.path, self.version, self._header = path, header.version, header
        self.mapping = map_slot(path, fd, writable=False)
        raw = self.mapping.mm[HEADER.size : HEADER.size + header.layout_len]
        self.layout = SegmentLayout.from_json(raw)
        self.payload = self.mapping.bytes[header.payload_at : header.payload_at + header.nbytes]
        self.fd = fd

    @staticmethod
    def open(root: str | os.PathLike, host: str, version: int, token: str | None = None,
             timeout_s: float = 0.0) -> "PinnedSegment":
        """Pin sealed `version` (of sync `token`, when given) on `host`, waiting up to `timeout_s` for it."""
        deadline = time.monotonic() + timeout_s
        while True:
            for path in sorted(host_dir(root, host).glob("slot*.seg")):
                pinned = PinnedSegment._try(path, version, token)
                if pinned is not None:
                    return pinned
            failed = failure_path(root, host, version, token) if token is not None else None
            if failed is not None and failed.exists():
                raise RuntimeError(f"weights v{version} will not reach {host}: its pull failed "
                                   f"({failed.read_text()})")
            dead = dead_puller(root, host, version, token) if token is not None else None
            # sealed just before it died? look once more
            if dead is not None:
                for path in sorted(host_dir(root, host).glob("slot*.seg")):
                    pinned = PinnedSegment._try(path, version, token)
                    if pinned is not None:
                        return pinned
                raise RuntimeError(f"weights v{version} will not reach {host}: the process pulling them "
                                   f"(pid {dead}) died mid-pull")
            if time.monotonic() >= deadline:
                raise FileNotFoundError(f"weights v{version} are not published on {host} under {root} "
                                        "(not sealed yet, or its slot was reused by a newer version)")
            time.sleep(0.002)

    @staticmethod
    def _try(path: Path, version: int, token: str | None) -> "PinnedSegment | None":
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            header = Header.read(fd)
            if header is not None and header.holds(version, token):
                # a claiming writer holds the exclusive lock only for an instant
                fcntl.flock(fd, fcntl.LOCK_SH)
                # checked again under the lock: the slot may have been claimed meanwhile
                header = Header.read(fd)
                if header is not None and header.holds(version, token):
                    return PinnedSegment(path, fd, header)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(TorchTitan name, full tensor view) for every parameter."""
        for slot, view in slot_views(self.payload, self.layout):
            yield slot.name, view

    def verify(self) -> None:
        """The header is unchanged since open (the second check of the version barrier)."""
        if self.fd < 0:
            raise RuntimeError(f"{self.path}: v{self.version} was released")
        if Header.read(self.fd) != self._header:
            raise RuntimeError(f"{self.path}: header changed while reading v{self.version}")


def newest_version(root: str | os.PathLike, host: str) -> int | None:
    """The newest sealed version on `host` (None when none is)."""
    versions = []
    for path in host_dir(root, host).glob("slot*.seg"):
        with open(path, "rb") as f:
            header = Header.read(f.fileno())
        if header is not None and header.complete:
            versions.append(header.version)
    return max(versions, default=None)


def bind_shadow(shadow: nn.Module, segment: PinnedSegment) -> nn.Module:
    """Make the meta-built `shadow` model's parameters the segment's views (ties stay tied)."""
    views = dict(segment.tensors())
    by_id: dict[int, nn.Parameter] = {}
    for name, p in shadow.named_parameters():
        if name not in views:
            raise ValueError(f"segment v{segment.version} has no tensor for parameter {name}")
        view = views[name]
        if tuple(view.shape) != tuple(p.shape):
            raise ValueError(f"{name}: segment shape {tuple(view.shape)} != model shape {tuple(p.shape)}")
        by_id[id(p)] = nn.Parameter(view, requires_grad=False)
    for module in shadow.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = by_id[id(p)]
    return shadow


def load_segment(engine: Any, bound: nn.Module, segment: PinnedSegment, hf_names: list[str],
                 bucket_bytes: int) -> int:
    """Copy a pinned segment into `engine` (HF-named buckets, one `engine.load_weights`); returns bytes loaded.

    bound: the shadow model bound to `segment` (`bind_shadow`); hf_names: the
    names the export produces (`hf_names_of`), checked against the engine before
    any copy so a mismatch leaves the engine as it was.
    """
    # lazy: the export and TorchTitan model code take seconds to import; the controller imports this module
    from composer_mesh.titan_ext.hf.adapters import iter_hf_buckets

    engine.check_coverage(hf_names, segment.version)
    segment.verify()
    loaded = 0

    # bucket by bucket, in one load (vLLM's is whole-model)
    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal loaded
        for bucket in iter_hf_buckets(bound, bucket_bytes):
            yield from bucket
            loaded += sum(t.numel() * t.element_size() for _, t in bucket)

    with one_thread():
        engine.load_weights(tensors())
    segment.verify()
    return loaded


def hf_names_of(shadow: nn.Module) -> list[str]:
    """HF names the export gives `shadow` (run on the meta model: no data touched)."""
    # lazy: the export and TorchTitan model code take seconds to import; the controller imports this module
    from composer_mesh.titan_ext.hf.adapters import iter_hf_buckets

    return [name for bucket in iter_hf_buckets(shadow, 1 << 62) for name, _ in bucket]


class SegmentLoader:
    """A generator's side of the sync: per trainer model config its HF names, and per slot a shadow model
    bound to that slot's mapping (views stay valid while the mapping lives, so binding happens once)."""

    def __init__(self) -> None:
        self._names: dict[Any, list[str]] = {}
        self._bound: dict[tuple[Any, str], tuple[SlotMapping, SegmentLayout, nn.Module]] = {}

    def _shadow(self, shadow: tuple, segment: PinnedSegment) -> nn.Module:
        if shadow not in self._names:
            self._names[shadow] = hf_names_of(shadow_model(*shadow))
        key = (shadow, str(segment.path))
        cached = self._bound.get(key)
        if cached is None or cached[0] is not segment.mapping or cached[1] != segment.layout:
            cached = (segment.mapping, segment.layout, bind_shadow(shadow_model(*shadow), segment))
            self._bound[key] = cached
        return cached[2]

    def load(self, engine: Any, root: str, host: str, version: int, shadow: tuple, bucket_bytes: int,
             timeout_s: float, token: str | None = None) -> dict:
        """Load `version` of `host`'s segment into `engine`; returns {"version", "bytes", "load_s", "names"}."""
        start = time.perf_counter()
        with PinnedSegment.open(root, host, version, token, timeout_s) as segment:
            nbytes = load_segment(engine, self._shadow(shadow, segment), segment, self._names[shadow], bucket_bytes)
        return {"version": version, "bytes": nbytes, "load_s": time.perf_counter() - start,
                "names": self._names[shadow]}


def shadow_model(model_cfg: Any, parallelism: Any) -> nn.Module:
    """The trainer's TorchTitan model built on the meta device (names and shapes only, no memory)."""
    # lazy: the export and TorchTitan model code take seconds to import; the controller imports this module
    from composer_mesh.titan_ext.models import resolve_model
    from composer_mesh.titan_ext.parallelize import prepare_model_config

    # reads hf_path's config.json only (the shape may come from it)
    spec = resolve_model(model_cfg).spec
    prepare_model_config(spec.model, parallelism)
    with torch.device("meta"):
        return spec.model.build()

