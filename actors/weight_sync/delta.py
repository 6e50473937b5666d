"""Delta weight sync: a trainer rank's serving-dtype runs encoded against the version it published last.

With the small learning rates of RL, most bf16 values do not change from one
step to the next, so what crosses hosts can be what changed instead of every
byte. Each trainer rank keeps the bytes it published last (`DeltaBase`, one
private copy of its shard in the serving dtype) and sends, per run (one
tensor's local shard), the smaller of:

- XOR: the run XOR its base, LZ4-compressed block by block (`BLOCK_BYTES` of
  input each, so a block's XOR is counted and compressed while it is in
  cache; fp32 blocks as byte planes, `byte_planes`): unchanged elements are
  zero bits and compress to almost nothing (LZ4's floor: 1/255 of the bytes);
- FULL: the run itself (what an fp32 run under Adam, where every element
  changes, comes down to).

Why XOR + LZ4 blocks: docs/weight_sync.md "Delta sync". XOR is on raw
bits, so -0.0, NaN payloads and every rounding are carried exactly.
The receiving host writes each run as its own sealed copy of the base
version (named by version *and* sync token: the very bytes the trainer
encoded against) XOR the decoded bits (`apply_delta`, block by block); a checksum (xxh3-64,
chained run by run) of the rank's runs after applying must equal the
trainer's, or the caller falls back to the full runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import lz4.block
import numpy as np
import torch
import xxhash

from composer_mesh.actors.weight_sync.segment import Piece

XOR, FULL = "xor", "full"


# input bytes per LZ4 block: a block's XOR stays in cache between the XOR, the count and LZ4 on the trainer, and
# between LZ4 and the XOR into the slot on the reader; large enough that the per-block calls cost nothing
BLOCK_BYTES = 256 << 10


def byte_planes(itemsize: int) -> bool:
    """Whether an XOR block of `itemsize`-byte elements is compressed as byte planes (every element's byte 0,
    then every byte 1, ...): for fp32 (4 bytes), whose XORs are dense in the low mantissa bytes and zero in the
    high ones, planes give LZ4 runs of zeros (0.55 of the bytes at 0.57 GB/s against 0.65 at 0.18 GB/s
    interleaved; docs/weight_sync.md); 16-bit XORs are sparse and compress as they are."""
    return itemsize >= 4


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
    # XOR: the compressed size of each block of `block_bytes` input bytes (the last may be shorter), in order
    blocks: tuple[int, ...] = ()
    block_bytes: int = BLOCK_BYTES


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


def encode_run(new_U8: torch.Tensor, old_U8: torch.Tensor, itemsize: int, scratch_U8: torch.Tensor,
               block_bytes: int = BLOCK_BYTES) -> tuple[str, int, bytes | torch.Tensor, tuple[int, ...]]:
    """(encoding, changed elements, bytes to send, compressed size per block) for one run: XOR + LZ4 per block of
    `block_bytes` unless that is no smaller. `old_U8` (the sender's base) is overwritten with `new_U8` block by
    block; `scratch_U8` (at least `block_bytes`) holds each block's XOR."""
    if block_bytes % itemsize or scratch_U8.numel() < block_bytes:
        raise ValueError(f"block_bytes {block_bytes} must be a multiple of {itemsize} and fit the scratch")
    new, old = _bits(new_U8, itemsize).numpy(), _bits(old_U8, itemsize).numpy()
    scratch = _bits(scratch_U8[:block_bytes], itemsize).numpy()
    per, packed, sizes, changed = block_bytes // itemsize, [], [], 0
    for lo in range(0, new.size, per):
        hi = min(lo + per, new.size)
        xor = scratch[: hi - lo]
        np.bitwise_xor(old[lo:hi], new[lo:hi], out=xor)
        # numpy's count is faster than torch's on int16
        changed += int(np.count_nonzero(xor))
        planes = np.ascontiguousarray(xor.view(np.uint8).reshape(-1, itemsize).T) if byte_planes(itemsize) else xor
        packed.append(lz4.block.compress(planes, store_size=False))
        sizes.append(len(packed[-1]))
        old[lo:hi] = new[lo:hi]
    if sum(sizes) >= new_U8.numel():
        return FULL, changed, new_U8, ()
    return XOR, changed, b"".join(packed), tuple(sizes)


class DeltaBase:
    """The bytes one trainer rank published last (its runs, concatenated, in the serving dtype) and which
    publication that was (version, sync token): what its next delta is taken against."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.version: int | None = None
        self.token = ""
        self.runs: list[Piece] = []
        self.copy_U8 = torch.empty(0, dtype=torch.uint8)
        # one block's XOR (allocated on the first delta)
        self._scratch_U8 = torch.empty(0, dtype=torch.uint8)

    def matches(self, runs: list[Piece]) -> bool:
        """Whether the base holds these very runs (else a delta against it is not possible)."""
        return self.version is not None and runs == self.runs

    def encode_runs(self, payload_U8: torch.Tensor, runs: list[Piece], version: int, token: str,
                    itemsize: int) -> Iterator[tuple[RunDelta, torch.Tensor]]:
        """Per run of `payload_U8`, in order: its `RunDelta` (`at` 0: the caller places it) and section bytes
        `[size]` uint8 against the base, which each run then replaces; once every run is out, the base is version
        `version` of sync `token`. The base must `match` the runs. Stopped or failed half-way, the base is dropped."""
        if not self.matches(runs):
            raise ValueError(f"v{version}: the delta base holds other runs (refresh it first)")
        if self._scratch_U8.numel() < self.block_bytes:
            self._scratch_U8 = torch.empty(self.block_bytes, dtype=torch.uint8)
        finished, at = False, 0
        try:
            for run in runs:
                new = payload_U8[run.offset : run.offset + run.nbytes]
                encoding, k, data, blocks = encode_run(new, self.copy_U8[at : at + run.nbytes], itemsize,
                                                       self._scratch_U8, self.block_bytes)
                at += run.nbytes
                section = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, bytes) else data
                yield RunDelta(run, encoding, k, 0, section.numel(), blocks, self.block_bytes), section
            finished = True
        finally:
            if finished:
                self.version, self.token = version, token
            else:
                # some runs of the copy are the new version: no base until the next refresh
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
        self.__init__(self.block_bytes)


def apply_delta(target_U8: torch.Tensor, base_U8: torch.Tensor, delta: Delta, buffer_U8: torch.Tensor) -> None:
    """Write every run of `delta` into `target_U8`: base XOR the decoded bits (read from the same runs of
    `base_U8`, the base version's payload), block by block, or the run itself where it was sent whole. Raises
    ValueError on a section that does not decode to its run's size."""
    for rd in delta.runs:
        lo, hi = rd.run.offset, rd.run.offset + rd.run.nbytes
        section = buffer_U8[rd.at : rd.at + rd.size]
        if rd.encoding == FULL:
            target_U8[lo:hi].copy_(section)
        elif rd.encoding == XOR:
            _apply_xor(target_U8[lo:hi], base_U8[lo:hi], section, rd, delta.itemsize)
        else:
            raise ValueError(f"unknown run encoding {rd.encoding!r}")


def _apply_xor(target_U8: torch.Tensor, base_U8: torch.Tensor, section_U8: torch.Tensor, rd: RunDelta,
               itemsize: int) -> None:
    """One XOR run: each LZ4 block decoded (one block of bytes, in cache) and XORed with the base into the target."""
    base, target = _bits(base_U8, itemsize).numpy(), _bits(target_U8, itemsize).numpy()
    packed, per = section_U8.numpy(), rd.block_bytes // itemsize
    expected = -(-base.size // per) if per else -1
    if len(rd.blocks) != expected or sum(rd.blocks) != packed.size:
        raise ValueError(f"delta run: {len(rd.blocks)} blocks of {sum(rd.blocks)} bytes in all, {expected} blocks "
                         f"over a {packed.size}-byte section expected")
    at = 0
    for i, size in enumerate(rd.blocks):
        lo, hi = i * per, min((i + 1) * per, base.size)
        want = (hi - lo) * itemsize
        try:
            raw = lz4.block.decompress(packed[at : at + size], uncompressed_size=want)
        except lz4.block.LZ4BlockError as exc:
            raise ValueError(f"delta run: block {i} is not an LZ4 block of the {want} bytes expected ({exc})") from None
        if len(raw) != want:
            raise ValueError(f"delta run: block {i} decoded {len(raw)} bytes, {want} expected")
        xor = np.frombuffer(raw, dtype=np.uint8)
        if byte_planes(itemsize):
            xor = np.ascontiguousarray(xor.reshape(itemsize, -1).T)
        np.bitwise_xor(base[lo:hi], xor.view(base.dtype).reshape(-1), out=target[lo:hi])
        at += size
