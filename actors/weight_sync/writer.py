"""Writing a version into a host's segment: the slot claim and seal, and each trainer rank's own shards.

Each trainer rank copies only its own FSDP/EP shard into the rows it owns
(`write_shards`), so no rank gathers anything; the last writer of a host
seals the version (`SegmentWriter.done`). On GPU the copies are
device-to-host (`copy_`).
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from composer_mesh.actors.weight_sync.mapping import SlotHold, locked, map_slot, one_thread
from composer_mesh.actors.weight_sync.segment import (
    HEADER, MAGIC, Header, Piece, SegmentLayout, Slot, clean_name, pack_token, payload_offset, slot_path, slot_views,
)


class SegmentWriter(SlotHold):
    """A party writing version `version` of sync `token` into its slot on `host`; `done()` maybe seals it.

    keep: sealed versions a host keeps readable (its ring has keep + 1 slots);
    timeout_s: how long to wait for readers of the slot's previous version to let go.
    """

    def __init__(self, root: str | os.PathLike, host: str, version: int, token: str, layout: SegmentLayout,
                 keep: int, timeout_s: float = 300.0) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.version, self.token, self.layout = version, pack_token(token), layout
        self.path = slot_path(root, host, version % (keep + 1))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock_path = self.path.with_suffix(".lock")
        self.layout_json = layout.to_json()
        self.payload_at = payload_offset(self.layout_json)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._claim(time.monotonic() + timeout_s)
            self.mapping = map_slot(self.path, self.fd, writable=True)
        except BaseException:
            self.release()
            raise
        # [layout.nbytes]
        self.payload = self.mapping.bytes[self.payload_at : self.payload_at + layout.nbytes]

    def _claim(self, deadline: float) -> None:
        """Hold the slot (shared lock) for this sync; the first party empties it of the previous version."""
        while True:
            with locked(self.lock_path):
                claimed = self._owns()
            if claimed:
                fcntl.flock(self.fd, fcntl.LOCK_SH)
                break
            try:
                # no reader or writer of the old version left
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.path}: still read or written for an older version; cannot write "
                                       f"v{self.version} (raise keep, or look for a stuck generator)") from None
                time.sleep(0.001)
                continue
            with locked(self.lock_path) as count:
                if not self._owns():
                    size = self.payload_at + self.layout.nbytes
                    if os.fstat(self.fd).st_size < size:
                        # grow only: other processes may map the old length
                        os.ftruncate(self.fd, size)
                    os.pwrite(self.fd, self._header(sealed=0), 0)
                    count.truncate(0)
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            break
        # a newer sync took the slot between our locks
        if not self._owns():
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            raise RuntimeError(f"{self.path}: taken by a newer sync before v{self.version} was written")

    def _owns(self) -> bool:
        """The slot's header names this sync."""
        header = Header.read(self.fd)
        return header is not None and header.token == self.token

    def _header(self, sealed: int) -> bytes:
        return HEADER.pack(MAGIC, self.version, sealed, self.payload_at, self.layout.nbytes, len(self.layout_json),
                            self.token)

    def views(self) -> Iterator[tuple[Slot, torch.Tensor]]:
        return slot_views(self.payload, self.layout)

    def done(self, parties: int) -> bool:
        """Count this party in and let go of the slot; the last of `parties` seals. True when this call sealed."""
        if parties < 1:
            raise ValueError(f"parties must be >= 1, got {parties}")
        try:
            with locked(self.lock_path) as f:
                if not self._owns():
                    raise RuntimeError(f"{self.path}: taken by a newer sync while v{self.version} was written")
                count = len(f.read()) + 1
                f.write("x")
                f.flush()
                if count < parties:
                    return False
                os.pwrite(self.fd, self.layout_json, HEADER.size)
                os.pwrite(self.fd, self._header(sealed=1), 0)  # the publish
                return True
        finally:
            self.release()

    def sealed(self) -> bool:
        """Whether this version is sealed in its slot (every party is done); callable after `done()` too."""
        with open(self.path, "rb") as f:
            header = Header.read(f.fileno())
        # `holds` takes the sync token unpacked; the writer keeps it packed
        return header is not None and header.holds(self.version, None) and header.token == self.token


def local_shard(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]] | None:
    """This rank's piece of `param` and where it sits in the full tensor; None when another rank writes it.

    Plain tensors are whole. DTensors give their local shard and global offset;
    on replicated mesh dims (HSDP replicas) only coordinate 0 writes.
    """
    if not isinstance(param, DTensor):
        return param.detach(), tuple(slice(0, n) for n in param.shape)
    mesh, placements = param.device_mesh, param.placements
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    if any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coord)):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    local = param.to_local().detach()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"local shard shape {tuple(local.shape)} != expected {tuple(shape)} (padded shard?)")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def write_shards(model: nn.Module, writer: SegmentWriter) -> list[Piece]:
    """Copy this rank's shard of every parameter into the segment; returns the byte run of each (in slot order;
    `coalesce` merges them for transfers)."""
    params = {clean_name(n): p for n, p in model.named_parameters()}
    pieces: list[Piece] = []
    with one_thread():
        for slot, full in writer.views():
            part = local_shard(params[slot.name])
            if part is None:
                continue
            local, index = part
            if local.numel() == 0:
                continue
            # device-to-host on GPU; casts to the slot's (serving) dtype
            full[index].copy_(local)
            pieces += _runs(slot, full, index)
    return pieces


def _runs(slot: Slot, full: torch.Tensor, index: tuple[slice, ...]) -> list[Piece]:
    """The byte run of `full[index]` in the payload: contiguous when only dim 0 is sliced (FSDP2, EP)."""
    if any((s.start, s.stop) != (0, n) for s, n in zip(index[1:], full.shape[1:])):
        raise ValueError(f"{slot.name}: shard {index} is not contiguous; only dim-0 sharding is routed")
    if full.dim() == 0:
        return [Piece(slot.offset, slot.nbytes)]
    row = full.stride(0) * full.element_size()
    return [Piece(slot.offset + index[0].start * row, (index[0].stop - index[0].start) * row)]

