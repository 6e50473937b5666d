"""Delta weight sync: a trainer rank's serving-dtype runs encoded against the version it published last.

With the small learning rates of RL, most bf16 values do not change from one
step to the next, so what crosses hosts can be what changed instead of every
byte. Each trainer rank remembers where the runs it published last are
(`DeltaBase`: a view of its previous sealed slot, which stays unchanged for
`keep` more versions, so no copy is kept) and sends, per run (one tensor's
local shard), the first of these that applies:

- SPARSE: the run's changed 64-bit words against its base, block by block
  (`actors.weight_sync.sparse`: word gap, lane mask, changed lanes' XOR),
  for 16- and 32-bit elements while it stays under `SPARSE_MAX` of the
  bytes: what a bf16 run under RL's learning rates comes down to;
- XOR: the run XOR its base, LZ4-compressed block by block (`BLOCK_BYTES` of
  input each, so a block's XOR is counted and compressed while it is in
  cache; fp32 blocks as byte planes, `byte_planes`): unchanged elements are
  zero bits and compress to almost nothing (LZ4's floor: 1/255 of the bytes);
  for runs too dense for SPARSE (an fp32 run under Adam changes in every
  element's low bytes);
- FULL: the run itself (random bits).

Why these encodings: docs/weight_sync.md "Delta sync". All are on raw
bits, so -0.0, NaN payloads and every rounding are carried exactly.
The receiving host writes each run as its own sealed copy of the base
version (named by version *and* sync token: the very bytes the trainer
encoded against) XOR the decoded bits (`apply_delta`, block by block while
the block is in cache); a checksum (xxh3-64,
chained run by run) of the rank's runs after applying must equal the
trainer's, or the caller falls back to the full runs.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Iterator

import lz4.block
import numpy as np
import torch
import xxhash

from composer_mesh.actors.weight_sync.segment import Piece

SPARSE, XOR, FULL = "sparse", "xor", "full"


# input bytes per LZ4 block: a block's XOR stays in cache between the XOR, the count and LZ4 on the trainer, and
# between LZ4 and the XOR into the slot on the reader; large enough that the per-block calls cost nothing
BLOCK_BYTES = 256 << 10
# the largest SPARSE section, as a fraction of its run's bytes: past it (about 30 % of bf16 elements changed) the
# run is encoded as XOR + LZ4 instead, which a run too dense for SPARSE gives up on within its first block
SPARSE_MAX = 0.5


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
               block_bytes: int = BLOCK_BYTES,
               checksum: int = 0) -> tuple[str, int, np.ndarray, tuple[int, ...], int]:
    """(encoding, changed elements, bytes to send `[size]` uint8, encoded size per block, checksum) for one run
    against `old_U8` (the same run of the base version): SPARSE when it fits `SPARSE_MAX` of the bytes, else XOR +
    LZ4 unless that is no smaller than the run (FULL). `scratch_U8` (at least `block_bytes`) holds an LZ4 block's
    XOR. The checksum is `runs_checksum` of the run continued from `checksum`, taken block by block while the block
    is in cache."""
    if block_bytes % 8 or scratch_U8.numel() < block_bytes:
        raise ValueError(f"block_bytes {block_bytes} must be a multiple of 8 and fit the scratch")
    if new_U8.numel() % itemsize:
        raise ValueError(f"a {new_U8.numel()}-byte run is no whole number of {itemsize}-byte elements")
    sparse = encode_sparse(new_U8, old_U8, itemsize, block_bytes, checksum)
    if sparse is not None:
        return sparse
    return encode_xor_lz4(new_U8, old_U8, itemsize, scratch_U8, block_bytes, checksum)


def encode_sparse(new_U8: torch.Tensor, old_U8: torch.Tensor, itemsize: int, block_bytes: int = BLOCK_BYTES,
                  checksum: int = 0) -> tuple[str, int, np.ndarray, tuple[int, ...], int] | None:
    """`encode_run`'s SPARSE encoding of one run, or None for an element size it does not split into words or a
    run that does not fit `SPARSE_MAX` of its bytes (given up at the first block past it)."""
    # lazy: numba (0.2 s to import) only in the processes that encode or apply a delta
    from composer_mesh.actors.weight_sync import sparse

    if itemsize not in sparse.ITEMSIZES:
        return None
    new, old = new_U8.numpy(), old_U8.numpy()
    # [section bytes] written up to SPARSE_MAX of the run (pages are touched only as far as it is written)
    out = np.empty(int(new.size * SPARSE_MAX) + sparse.ENTRY_MAX, dtype=np.uint8)
    sizes, changed, at = [], 0, 0
    digest = xxhash.xxh3_64(seed=checksum)
    for lo in range(0, new.size, block_bytes):
        hi = min(lo + block_bytes, new.size)
        digest.update(new[lo:hi])
        end, k = sparse.encode_block(new[lo:hi], old[lo:hi], itemsize, out, at, int(hi * SPARSE_MAX))
        if end < 0:
            return None
        sizes.append(end - at)
        changed, at = changed + k, end
    return SPARSE, changed, out[:at], tuple(sizes), digest.intdigest()


def encode_xor_lz4(new_U8: torch.Tensor, old_U8: torch.Tensor, itemsize: int, scratch_U8: torch.Tensor,
                   block_bytes: int = BLOCK_BYTES,
                   checksum: int = 0) -> tuple[str, int, np.ndarray, tuple[int, ...], int]:
    """`encode_run`'s XOR + LZ4 encoding of one run (LZ4 block by block of `block_bytes`, each block's XOR in
    `scratch_U8`), or FULL when that is no smaller than the run."""
    new, old = _bits(new_U8, itemsize).numpy(), _bits(old_U8, itemsize).numpy()
    scratch = _bits(scratch_U8[:block_bytes], itemsize).numpy()
    per, packed, sizes, changed = block_bytes // itemsize, [], [], 0
    digest = xxhash.xxh3_64(seed=checksum)
    for lo in range(0, new.size, per):
        hi = min(lo + per, new.size)
        digest.update(new[lo:hi])
        xor = scratch[: hi - lo]
        np.bitwise_xor(old[lo:hi], new[lo:hi], out=xor)
        # numpy's count is faster than torch's on int16
        changed += int(np.count_nonzero(xor))
        planes = np.ascontiguousarray(xor.view(np.uint8).reshape(-1, itemsize).T) if byte_planes(itemsize) else xor
        packed.append(lz4.block.compress(planes, store_size=False))
        sizes.append(len(packed[-1]))
    if sum(sizes) >= new_U8.numel():
        return FULL, changed, new_U8.numpy(), (), digest.intdigest()
    return XOR, changed, np.frombuffer(b"".join(packed), dtype=np.uint8), tuple(sizes), digest.intdigest()


class DeltaBase:
    """Where the runs one trainer rank published last are (a view of that publication's sealed payload, in the
    serving dtype) and which publication that was (version, sync token): what its next delta is taken against.

    No copy is kept: the caller guarantees the viewed payload stays unchanged until the next encoding against it
    has finished (the trainer's: a sealed slot is rewritten only `keep` versions later, and every publication
    first waits for the previous encoding). A publication written over the base's own memory (a version published
    again into its slot) cannot be a delta: `matches` says no."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.version: int | None = None
        self.token = ""
        self.runs: list[Piece] = []
        # [payload bytes] the base version's payload (a view: no memory of its own)
        self.payload_U8 = torch.empty(0, dtype=torch.uint8)
        # one block's XOR (allocated on the first delta)
        self._scratch_U8 = torch.empty(0, dtype=torch.uint8)

    def matches(self, payload_U8: torch.Tensor, runs: list[Piece]) -> bool:
        """Whether a delta of `runs` of `payload_U8` against the base is possible: the base holds these very runs,
        elsewhere in memory (a payload written over the base's bytes has destroyed them)."""
        return (self.version is not None and runs == self.runs
                and not _overlap(payload_U8, self.payload_U8))

    def encode_runs(self, payload_U8: torch.Tensor, runs: list[Piece], version: int, token: str,
                    itemsize: int) -> Iterator[tuple[RunDelta, np.ndarray, int]]:
        """Per run of `payload_U8`, in order: its `RunDelta` (`at` 0: the caller places it), section bytes
        `[size]` uint8 against the base and `runs_checksum` of the runs so far; once every run is out, the base is
        `payload_U8`, version `version` of sync `token`. The base must `match`. Stopped or failed half-way, the
        base is dropped."""
        if not self.matches(payload_U8, runs):
            raise ValueError(f"v{version}: the delta base holds other runs or shares the payload's memory "
                             "(refresh it first)")
        if self._scratch_U8.numel() < self.block_bytes:
            self._scratch_U8 = torch.empty(self.block_bytes, dtype=torch.uint8)
        finished, checksum = False, 0
        try:
            for run in runs:
                lo, hi = run.offset, run.offset + run.nbytes
                encoding, k, data, blocks, checksum = encode_run(payload_U8[lo:hi], self.payload_U8[lo:hi], itemsize,
                                                                 self._scratch_U8, self.block_bytes, checksum)
                yield RunDelta(run, encoding, k, 0, data.size, blocks, self.block_bytes), data, checksum
            finished = True
        finally:
            if finished:
                self.refresh(payload_U8, runs, version, token)
            else:
                self.drop()

    def refresh(self, payload_U8: torch.Tensor, runs: list[Piece], version: int, token: str) -> None:
        """Make `runs` of `payload_U8` (version `version` of sync `token`) the base, without a delta."""
        self.payload_U8, self.runs = payload_U8, list(runs)
        self.version, self.token = version, token

    def drop(self) -> None:
        """Forget the base (deltas off, or an encoding failed): the next delta needs a new one."""
        self.__init__(self.block_bytes)


def _overlap(a_U8: torch.Tensor, b_U8: torch.Tensor) -> bool:
    """Whether two contiguous byte tensors share any memory."""
    if a_U8.numel() == 0 or b_U8.numel() == 0:
        return False
    a, b = a_U8.data_ptr(), b_U8.data_ptr()
    return a < b + b_U8.numel() and b < a + a_U8.numel()


def apply_delta(target_U8: torch.Tensor, base_U8: torch.Tensor, delta: Delta, buffer: torch.Tensor | bytes,
                checksum: int = 0) -> int:
    """Write every run of `delta` into `target_U8`: base XOR the decoded bits (read from the same runs of
    `base_U8`, the base version's payload, elsewhere in memory), block by block, or the run itself where it was
    sent whole. `buffer` holds the encoded runs (uint8 bytes: a tensor, or a chunk's `bytes` as received).
    Returns `runs_checksum` of the runs written, continued from `checksum` (taken block by block
    while the block is in cache). Raises ValueError on a section that does not decode to its run's size."""
    if _overlap(target_U8, base_U8):
        raise ValueError("apply_delta: the target shares memory with the base it is decoded against")
    buffer = buffer.numpy() if isinstance(buffer, torch.Tensor) else np.frombuffer(buffer, dtype=np.uint8)
    for rd in delta.runs:
        lo, hi = rd.run.offset, rd.run.offset + rd.run.nbytes
        section = buffer[rd.at : rd.at + rd.size]
        if rd.encoding == FULL:
            if section.size != hi - lo:
                raise ValueError(f"delta run: a {section.size}-byte section for a {hi - lo}-byte run whole, expected")
            target_U8[lo:hi].numpy()[:] = section
            checksum = runs_checksum(target_U8, [rd.run], checksum)
        elif rd.encoding == SPARSE:
            checksum = _apply_sparse(target_U8[lo:hi], base_U8[lo:hi], section, rd, delta.itemsize, checksum)
        elif rd.encoding == XOR:
            checksum = _apply_xor(target_U8[lo:hi], base_U8[lo:hi], section, rd, delta.itemsize, checksum)
        else:
            raise ValueError(f"unknown run encoding {rd.encoding!r}")
    return checksum


def _lz4_decompress_safe() -> Callable[[int, int, int, int], int]:
    """LZ4's C `LZ4_decompress_safe(src, dst, src_size, dst_capacity)` from the LZ4 that python-lz4 bundles (the
    very code `lz4.block.compress` encodes with): it decodes straight into the target's memory, where
    `lz4.block.decompress` returns a new object per block (an allocation and one more pass over every byte:
    0.30 of the applying's time, docs/weight_sync.md). Bounded by `dst_capacity` on any input; ctypes lets go
    of the GIL during the call."""
    fn = ctypes.CDLL(lz4.block._block.__file__).LZ4_decompress_safe
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return fn


_LZ4_DECOMPRESS = _lz4_decompress_safe()


def _check_blocks(target_U8: torch.Tensor, base_U8: torch.Tensor, section: np.ndarray, rd: RunDelta,
                  itemsize: int) -> None:
    """Refuse a run whose target, base, section and block sizes disagree, before a decoder writes through them."""
    if not (target_U8.is_contiguous() and section.flags.c_contiguous):
        raise ValueError("delta run: the target and the section must be contiguous bytes")
    # the decoders write sized from the base: the target must hold the whole run too
    if target_U8.numel() != base_U8.numel():
        raise ValueError(f"delta run: a {target_U8.numel()}-byte target for a {base_U8.numel()}-byte base run")
    per = rd.block_bytes // itemsize
    expected = -(-(base_U8.numel() // itemsize) // per) if per else -1
    if len(rd.blocks) != expected or sum(rd.blocks) != section.size:
        raise ValueError(f"delta run: {len(rd.blocks)} blocks of {sum(rd.blocks)} bytes in all, {expected} blocks "
                         f"over a {section.size}-byte section expected")


def _apply_sparse(target_U8: torch.Tensor, base_U8: torch.Tensor, section: np.ndarray, rd: RunDelta,
                  itemsize: int, checksum: int) -> int:
    """One SPARSE run, block by block: the base block copied into the target with the block's changed words XORed
    in (`sparse.apply_block`), then hashed while it is in cache. Returns the checksum continued over the run."""
    # lazy: numba, as in `encode_sparse`
    from composer_mesh.actors.weight_sync import sparse

    if itemsize not in sparse.ITEMSIZES or rd.block_bytes % 8:
        raise ValueError(f"delta run: no sparse words of {itemsize}-byte elements in {rd.block_bytes}-byte blocks")
    _check_blocks(target_U8, base_U8, section, rd, itemsize)
    target, base = target_U8.numpy(), base_U8.numpy()
    at, digest = 0, xxhash.xxh3_64(seed=checksum)
    for i, size in enumerate(rd.blocks):
        lo, hi = i * rd.block_bytes, min((i + 1) * rd.block_bytes, base.size)
        got = sparse.apply_block(target[lo:hi], base[lo:hi], itemsize, section, at, at + size)
        if got != at + size:
            raise ValueError(f"delta run: block {i} is not a sparse block of {size} bytes (code {got})")
        digest.update(target[lo:hi])
        at += size
    return digest.intdigest()


def _apply_xor(target_U8: torch.Tensor, base_U8: torch.Tensor, section: np.ndarray, rd: RunDelta,
               itemsize: int, checksum: int) -> int:
    """One XOR run, block by block: the block's XOR decoded into the target (through a scratch block for byte
    planes, which are transposed back), then the base XORed into it and the result hashed, while it is in cache.
    Returns the checksum continued over the run."""
    _check_blocks(target_U8, base_U8, section, rd, itemsize)
    base, target = _bits(base_U8, itemsize).numpy(), _bits(target_U8, itemsize).numpy()
    per = rd.block_bytes // itemsize
    planes = byte_planes(itemsize)
    # [block bytes] a byte-plane block before its transpose
    scratch = np.empty(rd.block_bytes if planes else 0, dtype=np.uint8)
    src, at, digest = section.ctypes.data, 0, xxhash.xxh3_64(seed=checksum)
    for i, size in enumerate(rd.blocks):
        lo, hi = i * per, min((i + 1) * per, base.size)
        want = (hi - lo) * itemsize
        into = scratch.ctypes.data if planes else target_U8.data_ptr() + lo * itemsize
        got = _LZ4_DECOMPRESS(src + at, into, size, want)
        if got < 0:
            raise ValueError(f"delta run: block {i} is not an LZ4 block of the {want} bytes expected")
        if got != want:
            raise ValueError(f"delta run: block {i} decoded {got} bytes, {want} expected")
        if planes:
            target[lo:hi].view(np.uint8).reshape(-1, itemsize)[:] = scratch[:want].reshape(itemsize, -1).T
        np.bitwise_xor(target[lo:hi], base[lo:hi], out=target[lo:hi])
        digest.update(target[lo:hi])
        at += size
    return digest.intdigest()
