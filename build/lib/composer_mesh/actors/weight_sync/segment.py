"""The shared-memory segment format: versioned slots of full TorchTitan tensors at fixed offsets.

Each host keeps a ring of `keep + 1` segment files ("slots") under
`<root>/<host>/` (tmpfs, i.e. memory); version v goes into slot v mod (keep + 1).
A segment holds every TorchTitan parameter as a *full* tensor at a fixed
offset (`SegmentLayout`), after a header (`Header`: version, sealed flag,
sync token) and the layout as JSON. Trainer ranks write their own shards into
it (`actors.weight_sync.writer`); generators map it and read full tensors as
zero-copy views (`actors.weight_sync.reader`).

Version barrier: readers and writers hold a shared `flock` on a slot file
while they touch it. The first writer of a sync (known by the sync's token)
claims the slot with the exclusive lock, so it waits until every reader and
writer of the version that lived there has let go, and marks the header
unsealed (version, token). The writers (the host's trainer ranks, or its
remote reader) count themselves in under the slot's lock file; the last one
writes the sealed header. A reader waits for a sealed header with its
(version, token), takes the shared lock, checks the header again, reads, and
checks it once more (`PinnedSegment.verify`). So a reader never sees half a
version or a mix of two, and a writer never overwrites a version being read.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

MAGIC = b"CMWSEG02"
# every tensor starts on a cache line
ALIGN = 64
PAGE = 4096
# RDMA batch and HF bucket size
DEFAULT_BUCKET_BYTES = 64 << 20
# magic, version, sealed, payload offset, payload bytes, layout json bytes, sync token
HEADER = struct.Struct("<8sqqqqq16s")

# where segments live unless a sync names a folder: shared memory where the host has it
DEFAULT_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


@dataclass(frozen=True)
class Slot:
    """One full TorchTitan tensor in a segment: `nbytes` at `offset` of the payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SegmentLayout:
    """Where every parameter lives in a segment; identical on every rank (derived from global shapes)."""

    slots: tuple[Slot, ...]
    nbytes: int

    @staticmethod
    def from_model(model: nn.Module, dtype: torch.dtype | None = None) -> "SegmentLayout":
        """Every parameter of `model` in `dtype` (the generators' serving dtype; None: the parameter's own):
        writers cast as they copy, so a bf16-serving run moves and keeps half the bytes of fp32 slots."""
        slots, offset = [], 0
        # deduplicated: tied weights once, under their first name
        for name, p in model.named_parameters():
            name = clean_name(name)
            slot_dtype = dtype or p.dtype
            nbytes = p.numel() * slot_dtype.itemsize
            slots.append(Slot(name, str(slot_dtype).removeprefix("torch."), tuple(p.shape), offset, nbytes))
            offset += round_up(nbytes, ALIGN)
        return SegmentLayout(tuple(slots), offset)

    def to_json(self) -> bytes:
        return json.dumps([[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.slots]).encode()

    @staticmethod
    def from_json(raw: bytes) -> "SegmentLayout":
        slots = tuple(Slot(n, d, tuple(sh), o, b) for n, d, sh, o, b in json.loads(raw))
        end = max((s.offset + round_up(s.nbytes, ALIGN) for s in slots), default=0)
        return SegmentLayout(slots, end)

    @property
    def model_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


@dataclass(frozen=True)
class Piece:
    """A contiguous byte run `[offset, offset + nbytes)` of a segment's payload."""

    offset: int
    nbytes: int


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Merge touching runs (sorted by offset)."""
    out: list[Piece] = []
    for p in sorted(pieces, key=lambda p: p.offset):
        if out and out[-1].offset + out[-1].nbytes == p.offset:
            out[-1] = Piece(out[-1].offset, out[-1].nbytes + p.nbytes)
        else:
            out.append(p)
    return out


def clean_name(name: str) -> str:
    """A parameter name without activation-checkpoint / compile wrapper prefixes (as the export names it)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def path_safe(name: str) -> str:
    """`name` with every character but letters, digits and `-_.` replaced by `_` (one path component)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def host_dir(root: str | os.PathLike, host: str) -> Path:
    """The folder of `host`'s slots (host labels are made path-safe: one folder, no traversal)."""
    return Path(root) / path_safe(host)


def slot_path(root: str | os.PathLike, host: str, slot: int) -> Path:
    """The file of ring slot `slot` on `host`."""
    return host_dir(root, host) / f"slot{slot:03d}.seg"


def round_up(n: int, to: int) -> int:
    """`n` rounded up to a multiple of `to`."""
    return -(-n // to) * to


def payload_offset(layout_json: bytes) -> int:
    """Where the payload starts: the first page after the header and the layout."""
    return round_up(HEADER.size + len(layout_json), PAGE)


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a slot names ("bfloat16"); a clear error for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"segment names an unknown dtype {name!r}")
    return dtype


def pack_token(token: str) -> bytes:
    """A sync token as the header's 16 bytes (NUL-padded)."""
    raw = token.encode()
    if not raw or len(raw) > 16:
        raise ValueError(f"sync token must be 1..16 bytes, got {token!r}")
    return raw.ljust(16, b"\0")


@dataclass(frozen=True)
class Header:
    """A slot's header: which version (of which sync) it holds and whether that version is complete."""

    magic: bytes
    version: int
    sealed: int
    payload_at: int
    nbytes: int
    layout_len: int
    token: bytes

    @staticmethod
    def read(fd: int) -> "Header | None":
        raw = os.pread(fd, HEADER.size, 0)
        return Header(*HEADER.unpack(raw)) if len(raw) == HEADER.size else None

    @property
    def complete(self) -> bool:
        """A sealed version of this format."""
        return self.magic == MAGIC and self.sealed == 1

    def holds(self, version: int, token: str | None) -> bool:
        """Sealed `version` (of the sync `token`, when given)."""
        return self.complete and self.version == version and (token is None or self.token == pack_token(token))


def slot_views(payload: torch.Tensor, layout: SegmentLayout) -> Iterator[tuple[Slot, torch.Tensor]]:
    """(slot, full tensor view) for every slot of `layout` over a segment's payload bytes."""
    for s in layout.slots:
        yield s, payload[s.offset : s.offset + s.nbytes].view(dtype_of(s.dtype)).view(s.shape)

