"""Sparse XOR words: the delta encoding of a block whose elements mostly did not change, in one native pass.

With RL's small learning rates about 2 % of the bf16 values change per
step, scattered. A block (`delta.BLOCK_BYTES` of one run) is read as 64-bit
words of `8 // itemsize` lanes (elements); each word whose XOR against the
base is non-zero is written as

    word gap (LEB128: words skipped since the previous entry, from the block's
    start) | lane mask (1 byte: which lanes changed) | each changed lane's XOR
    (itemsize bytes, little-endian)

A block's last word may be short (a run whose size is not a multiple of 8):
it has only the lanes that fit. Encoding is one pass over the new and base
bits (XOR, skip, count) with no intermediate XOR buffer, and decoding is a
copy of the base plus one XOR per changed word: against XOR + LZ4, on 73 MB
of bf16 with 2 % changed, 31-33 ms against 43-46 to encode, 22-24 against
about 40 to apply (each with its xxh3), 3.9 % of the bytes against 5.4 %
(docs/weight_sync.md "Sparse words instead of LZ4"). Numba compiles the
kernels once per machine (`cache=True`); they release the GIL.

Both kernels work on raw bytes, so every bit pattern (NaN payloads, -0.0)
is carried exactly. The decoder never reads or writes outside its arrays:
malformed input returns a negative code instead.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# element sizes whose words split into whole lanes (16- and 32-bit serving dtypes)
ITEMSIZES = (2, 4)
# the most bytes one entry takes: a 10-byte LEB128 gap, the mask, 8 bytes of lanes
ENTRY_MAX = 19


@njit(nogil=True, cache=True)
def _put_gap(out: np.ndarray, p: int, gap: int) -> int:
    """`gap` as LEB128 at `p` (7 bits a byte, low first, the high bit set on all but the last); the position after."""
    while gap >= 128:
        out[p] = np.uint8((gap & 127) | 128)
        p += 1
        gap >>= 7
    out[p] = np.uint8(gap)
    return p + 1


@njit(nogil=True, cache=True)
def _put_word(out: np.ndarray, p: int, x: np.uint64, itemsize: int, lanes: int) -> tuple[int, int]:
    """The mask and changed lanes of one non-zero XOR word at `p`: (position after it, lanes changed). Every lane
    is written and only a changed one is kept (no branch per lane: which lanes changed is random)."""
    mp = p
    p += 1
    mask, n = 0, 0
    bits = 8 * itemsize
    lane_mask = (np.uint64(1) << np.uint64(bits)) - np.uint64(1)
    for lane in range(lanes):
        v = (x >> np.uint64(bits * lane)) & lane_mask
        for k in range(itemsize):
            out[p + k] = np.uint8((v >> np.uint64(8 * k)) & np.uint64(0xFF))
        nz = int(v != 0)
        p += itemsize * nz
        mask |= nz << lane
        n += nz
    out[mp] = np.uint8(mask)
    return p, n


@njit(nogil=True, cache=True, inline="always")
def _encode_block(new_U8: np.ndarray, old_U8: np.ndarray, itemsize: int, out_U8: np.ndarray, at: int,
                 limit: int) -> tuple[int, int]:
    """Entries of `new_U8` XOR `old_U8` (one block, a whole number of `itemsize` elements) written into `out_U8`
    from `at`: (end position, elements changed), or (-1, elements so far) once the end would pass `limit`."""
    n = new_U8.size
    lanes = 8 // itemsize
    nw = n // 8
    a = new_U8[: nw * 8].view(np.uint64)
    b = old_U8[: nw * 8].view(np.uint64)
    stop = min(limit, out_U8.size) - ENTRY_MAX
    p, last, changed = at, 0, 0
    for w in range(nw):
        x = a[w] ^ b[w]
        if x == 0:
            continue
        if p > stop:
            return -1, changed
        p = _put_gap(out_U8, p, w - last)
        last = w + 1
        p, k = _put_word(out_U8, p, x, itemsize, lanes)
        changed += k
    if n > nw * 8:
        # the short last word: its lanes that exist, assembled byte by byte
        x = np.uint64(0)
        for j in range(n - nw * 8):
            x |= np.uint64(new_U8[nw * 8 + j] ^ old_U8[nw * 8 + j]) << np.uint64(8 * j)
        if x != 0:
            if p > stop:
                return -1, changed
            p = _put_gap(out_U8, p, nw - last)
            p, k = _put_word(out_U8, p, x, itemsize, (n - nw * 8) // itemsize)
            changed += k
    return p, changed


@njit(nogil=True, cache=True, inline="always")
def _apply_block(target_U8: np.ndarray, base_U8: np.ndarray, itemsize: int, src_U8: np.ndarray, at: int,
                end: int) -> int:
    """`target_U8` = `base_U8` XOR the entries in `src_U8[at:end]` (one block as `encode_block` wrote it). Returns
    `end` when the entries fill exactly that span, else a negative code (-1 truncated, -2 a gap past the block, -3
    a mask naming no or absent lanes, -4 an entry past `end`, -5 arrays or a span that disagree), with `target_U8`
    then partly written."""
    n = target_U8.size
    if base_U8.size != n or n % itemsize or end > src_U8.size or at < 0 or at > end:
        return -5
    lanes = 8 // itemsize
    bits = 8 * itemsize
    nw = n // 8
    words = nw + (1 if n > nw * 8 else 0)
    t = target_U8[: nw * 8].view(np.uint64)
    t[:] = base_U8[: nw * 8].view(np.uint64)
    for j in range(nw * 8, n):
        target_U8[j] = base_U8[j]
    p, w = at, 0
    while p < end:
        gap, shift = 0, 0
        while True:
            if p >= end or shift > 49:
                return -1
            c = int(src_U8[p])
            p += 1
            gap |= (c & 127) << shift
            if c < 128:
                break
            shift += 7
        w += gap
        if w >= words or p >= end:
            return -2 if w >= words else -1
        mask = int(src_U8[p])
        p += 1
        present = lanes if w < nw else (n - nw * 8) // itemsize
        if mask == 0 or mask >> present:
            return -3
        n_lanes = 0
        for lane in range(present):
            n_lanes += (mask >> lane) & 1
        if p + n_lanes * itemsize > end:
            return -4
        x = np.uint64(0)
        for lane in range(present):
            # no branch per lane: an unchanged lane reads in-bounds bytes and keeps none of them
            bit = (mask >> lane) & 1
            q = min(p, end - itemsize)
            v = np.uint64(0)
            for k in range(itemsize):
                v |= np.uint64(src_U8[q + k]) << np.uint64(8 * k)
            x |= (v * np.uint64(bit)) << np.uint64(bits * lane)
            p += itemsize * bit
        if w < nw:
            t[w] ^= x
        else:
            for j in range(n - nw * 8):
                target_U8[nw * 8 + j] ^= np.uint8((x >> np.uint64(8 * j)) & np.uint64(0xFF))
        w += 1
    return p



@njit(nogil=True, cache=True)
def encode_block(new_U8: np.ndarray, old_U8: np.ndarray, itemsize: int, out_U8: np.ndarray, at: int,
                 limit: int) -> tuple[int, int]:
    """`_encode_block` with `itemsize` (2 or 4) a constant in each inlined copy, so its lane loops unroll (1.3x
    faster than one generic copy)."""
    if itemsize == 2:
        return _encode_block(new_U8, old_U8, 2, out_U8, at, limit)
    return _encode_block(new_U8, old_U8, 4, out_U8, at, limit)


@njit(nogil=True, cache=True)
def apply_block(target_U8: np.ndarray, base_U8: np.ndarray, itemsize: int, src_U8: np.ndarray, at: int,
                end: int) -> int:
    """`_apply_block` with a constant `itemsize` (2 or 4) in each inlined copy, as `encode_block`."""
    if itemsize == 2:
        return _apply_block(target_U8, base_U8, 2, src_U8, at, end)
    return _apply_block(target_U8, base_U8, 4, src_U8, at, end)
