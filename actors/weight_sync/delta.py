"""Delta weight sync: a trainer rank's serving-dtype runs encoded against the version it published last.

With the small learning rates of RL, most bf16 values do not change from one
step to the next, so what crosses hosts can be what changed instead of every
byte. Each trainer rank keeps the bytes it published last (`DeltaBase`, one
private copy of its shard in the serving dtype) and sends, per run (one
tensor's local shard), the smaller of:

- XOR: the run XOR its base, zstd-compressed (`zstd_level`): unchanged elements are
  zero bits and compress to almost nothing;
- FULL: the run itself (what an fp32 run under Adam, where every element
  changes, comes down to).

Why XOR + zstd and its level: docs/weight_sync.md "Delta sync". XOR is on raw
bits, so -0.0, NaN payloads and every rounding are carried exactly.
The receiving host writes each run as its own sealed copy of the base
version (named by version *and* sync token: the very bytes the trainer
encoded against) XOR the decoded bits (`apply_delta`); a checksum (xxh3-64,
chained run by run) of the rank's runs after applying must equal the
trainer's, or the caller falls back to the full runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import xxhash
import zstandard

from composer_mesh.actors.weight_sync.segment import Piece

XOR, FULL = "xor", "full"


def zstd_level(itemsize: int) -> int:
    """zstd level of the XOR sections of `itemsize`-byte elements: -1 for 16-bit serving dtypes (faster than 1,
    and their sparse XORs stay small), 1 for fp32, whose dense mantissa XORs a negative level packs worse (docs/weight_sync.md
    "Delta sync")."""
    return -1 if itemsize <= 2 else 1


@dataclass(frozen=True)
class RunDelta:
    """How one run is encoded in the delta buffer: `size` bytes at `at`."""

    # one tensor's local shard in the segment payload
    run: Piece
    encoding: str
    # elements that differ from the base
    changed: int
    at: int
    size: int


@dataclass
class Delta:
    """A rank's runs of version `version` as changes against `base_version` (sync `base_token`): the
    description a reader needs; the `nbytes` encoded bytes travel separately, in one transfer. `checksum` is
    `runs_checksum` of the rank's runs in order."""

    version: int
    base_version: int
    base_token: str
    itemsize: int
    runs: list[RunDelta]
    nbytes: int
    checksum: int

    @property
    def changed(self) -> int:
        return sum(r.changed for r in self.runs)

    @property
    def elements(self) -> int:
        return sum(r.run.nbytes for r in self.runs) // self.itemsize


def runs_checksum(payload_U8: torch.Tensor, runs: list[Piece], checksum: int = 0) -> int:
    """Checksum of `runs` of a segment payload, in order (no copy), continuing from `checksum` (that of the runs
    before them, so a stream of runs is checked chunk by chunk): each run's xxh3-64 seeded with the one before
    (xxh3 is several times faster than CRC-32, and both ends compute it on the sync's path)."""
    for r in runs:
        checksum = xxhash.xxh3_64_intdigest(payload_U8[r.offset : r.offset + r.nbytes].numpy(), seed=checksum)
    return checksum


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # raw bits per element size


def _bits(raw_U8: torch.Tensor, itemsize: int) -> torch.Tensor:
    if itemsize not in _INT:
        raise ValueError(f"no raw-bit view for {itemsize}-byte elements")
    return raw_U8.view(_INT[itemsize])


def encode_run(new_U8: torch.Tensor, old_U8: torch.Tensor, itemsize: int,
               compressor: zstandard.ZstdCompressor) -> tuple[str, int, bytes | torch.Tensor]:
    """(encoding, changed elements, bytes to send) for one run: XOR + zstd unless that is no smaller.
    `old_U8` is overwritten with `new_U8` (it is the sender's base: XORed in place, no temporary)."""
    xor = _bits(old_U8, itemsize).bitwise_xor_(_bits(new_U8, itemsize))
    # numpy's count is faster than torch's on int16
    changed = int(np.count_nonzero(xor.numpy()))
    packed = compressor.compress(old_U8.numpy())
    old_U8.copy_(new_U8)
    if len(packed) >= new_U8.numel():
        return FULL, changed, new_U8
    return XOR, changed, packed


class DeltaBase:
    """The bytes one trainer rank published last (its runs, concatenated, in the serving dtype) and which
    publication that was (version, sync token): what its next delta is taken against."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.token = ""
        self.runs: list[Piece] = []
        self.copy_U8 = torch.empty(0, dtype=torch.uint8)

    def matches(self, runs: list[Piece]) -> bool:
        """Whether the base holds these very runs (else a delta against it is not possible)."""
        return self.version is not None and runs == self.runs

    def encode_runs(self, payload_U8: torch.Tensor, runs: list[Piece], version: int, token: str,
                    itemsize: int) -> Iterator[tuple[Piece, str, int, torch.Tensor]]:
        """Per run of `payload_U8`, in order: (run, encoding, changed elements, section bytes `[size]` uint8)
        against the base, which each run then replaces; once every run is out, the base is version `version` of
        sync `token`. The base must `match` the runs. Stopped or failed half-way, the base is dropped."""
        if not self.matches(runs):
            raise ValueError(f"v{version}: the delta base holds other runs (refresh it first)")
        compressor = zstandard.ZstdCompressor(level=zstd_level(itemsize))
        finished, at = False, 0
        try:
            for run in runs:
                new = payload_U8[run.offset : run.offset + run.nbytes]
                encoding, k, data = encode_run(new, self.copy_U8[at : at + run.nbytes], itemsize, compressor)
                at += run.nbytes
                yield run, encoding, k, torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(
                    data, bytes) else data
            finished = True
        finally:
            if finished:
                self.version, self.token = version, token
            else:
                # some runs of the copy are the new version (or an XOR): no base until the next refresh
                self.drop()

    def refresh(self, payload_U8: torch.Tensor, runs: list[Piece], version: int, token: str) -> None:
        """Make `runs` of `payload_U8` (version `version` of sync `token`) the base, without a delta."""
        self._refresh(payload_U8, runs)
        self.version, self.token = version, token

    def _refresh(self, payload_U8: torch.Tensor, runs: list[Piece]) -> None:
        """Copy `runs` of `payload_U8` in (reusing the copy's memory when their total is unchanged)."""
        total = sum(r.nbytes for r in runs)
        if self.copy_U8.numel() != total:
            self.copy_U8 = torch.empty(total, dtype=torch.uint8)
        at = 0
        for run in runs:
            self.copy_U8[at : at + run.nbytes].copy_(payload_U8[run.offset : run.offset + run.nbytes])
            at += run.nbytes
        self.runs = list(runs)

    def drop(self) -> None:
        """Forget the base (deltas off): its memory is freed and the next delta needs a new one."""
        self.__init__()


def apply_delta(target_U8: torch.Tensor, base_U8: torch.Tensor, delta: Delta, buffer_U8: torch.Tensor) -> None:
    """Write every run of `delta` into `target_U8`: base XOR the decoded bits (read from the same runs of
    `base_U8`, the base version's payload), or the run itself where it was sent whole."""
    decompressor = zstandard.ZstdDecompressor()
    scratch = torch.empty(max((rd.run.nbytes for rd in delta.runs), default=0), dtype=torch.uint8)
    for rd in delta.runs:
        lo, hi = rd.run.offset, rd.run.offset + rd.run.nbytes
        section = buffer_U8[rd.at : rd.at + rd.size]
        if rd.encoding == FULL:
            target_U8[lo:hi].copy_(section)
        elif rd.encoding == XOR:
            xor = scratch[: rd.run.nbytes]
            _decompress_into(decompressor, section, xor)
            torch.bitwise_xor(_bits(base_U8[lo:hi], delta.itemsize), _bits(xor, delta.itemsize),
                              out=_bits(target_U8[lo:hi], delta.itemsize))
        else:
            raise ValueError(f"unknown run encoding {rd.encoding!r}")


def _decompress_into(decompressor: zstandard.ZstdDecompressor, packed_U8: torch.Tensor, out_U8: torch.Tensor) -> None:
    """Decompress `packed_U8` straight into `out_U8` (no intermediate bytes); it must fill it exactly."""
    view, got = memoryview(out_U8.numpy()), 0
    try:
        with decompressor.stream_reader(packed_U8.numpy()) as reader:
            while got < len(view):
                n = reader.readinto(view[got:])
                if n == 0:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise ValueError(f"delta run: not a zstd frame of {len(view)} bytes expected ({exc})") from None
    if got != len(view) or extra:
        raise ValueError(f"delta run: decoded {'more than ' if extra else ''}{got} bytes, {len(view)} expected")
