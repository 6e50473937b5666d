"""A host's remote pull: RDMA-read the runs of trainer ranks on other hosts (or stream their deltas) into its segment."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from composer_mesh.actors.weight_sync.delta import Delta, apply_delta
from composer_mesh.actors.weight_sync.encoder import DeltaChunk, DeltaPlan
from composer_mesh.actors.weight_sync.mapping import one_thread
from composer_mesh.actors.weight_sync.pull_status import pulling
from composer_mesh.actors.weight_sync.reader import PinnedSegment
from composer_mesh.actors.weight_sync.segment import Piece, SegmentLayout
from composer_mesh.actors.weight_sync.writer import SegmentWriter


@dataclass
class RemoteSource:
    """One trainer rank's runs and the RDMA buffers over them (same order); with deltas on, the plan of its runs'
    changes since the version it published last (`DeltaPlan`) and the `DeltaEncoderActor` on its process that
    serves them chunk by chunk as its background encoding produces them."""

    rank: int
    pieces: list[Piece]
    buffers: list
    delta: DeltaPlan | None = None
    encoder: Any = None


def _pin_base(root: str, host: str, layout: SegmentLayout, sources: list[RemoteSource]) -> PinnedSegment | None:
    """The sealed base version every delta of `sources` was taken against, pinned on `host`; None when the host
    does not hold it (behind, new, or a restarted trainer's lineage) or the sources disagree on it."""
    bases = {(s.delta.base_version, s.delta.base_token) for s in sources if s.delta is not None}
    if len(bases) != 1 or any(s.delta is None for s in sources):
        return None
    version, token = bases.pop()
    try:
        base = PinnedSegment.open(root, host, version, token)
    except FileNotFoundError:
        return None
    if base.layout != layout:
        base.release()
        return None
    return base


# appliers of the ranks' chunks: one thread per core a host's reader may use (a host reads a few ranks at most)
_APPLY = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="delta-apply")


def _apply_chunk(writer: SegmentWriter, base: PinnedSegment, s: RemoteSource, chunk: DeltaChunk, checksum: int) -> int | None:
    """Write `chunk`'s runs of source `s` into `writer` as `base` XOR their decoded bits; the source's checksum
    continued over them, or None when the chunk does not decode."""
    part = Delta(s.delta.version, s.delta.base_version, s.delta.base_token, s.delta.itemsize, chunk.runs,
                 chunk.nbytes, 0)
    try:
        return apply_delta(writer.payload, base.payload, part, chunk.data, checksum)
    except ValueError:
        return None


def _pull_deltas(writer: SegmentWriter, base: PinnedSegment, sources: list[RemoteSource],
                 timeout_s: float = 600.0) -> tuple[int, list, dict[int, tuple[int, int]]]:
    """Stream every source's delta chunk by chunk (chunk k+1 is asked for before chunk k is applied, so the
    trainer's encoding, the transfer and this host's applying overlap) and write its runs as `base` XOR the
    delta. Returns (bytes received, the sources to read whole: their checksum after applying did not match, a chunk
    did not decode, or their background encoding failed, {rank: (changed, elements)} of the deltas applied)."""

    def ask(s: RemoteSource, index: int) -> Any:
        return s.encoder.chunk.call_one(s.delta.version, s.delta.token, index, timeout_s)

    transferred, mismatched, counts = 0, [], {}
    checksums, changed = {s.rank: 0 for s in sources}, {s.rank: 0 for s in sources}
    asked, index = {s.rank: ask(s, 0) for s in sources}, 0
    live = {s.rank: s for s in sources}
    while live:
        chunks: dict[int, DeltaChunk] = {}
        for rank in list(live):
            try:
                chunks[rank] = asked[rank].get()
            except Exception:
                # its background encoding failed (the trainer raises it at its next publication): read it whole
                mismatched.append(live.pop(rank))
        index += 1
        asked = {rank: ask(live[rank], index) for rank, chunk in chunks.items() if not chunk.last}
        # each rank's chunk on its own thread (numba, LZ4, numpy and xxhash release the GIL): the ranks' runs are
        # disjoint, and the applying is what this host's share of the sync costs
        with one_thread():
            futures = {rank: _APPLY.submit(_apply_chunk, writer, base, live[rank], chunk, checksums[rank])
                       for rank, chunk in chunks.items()}
            applied = {rank: f.result() for rank, f in futures.items()}
        for rank, chunk in chunks.items():
            s, checksum = live[rank], applied[rank]
            transferred += chunk.nbytes
            if checksum is None:
                # undecodable: counted with the checksum mismatches, read whole
                mismatched.append(live.pop(rank))
                asked.pop(rank, None)
                continue
            checksums[rank] = checksum
            changed[rank] += chunk.changed
            if chunk.last:
                live.pop(rank)
                if checksum != chunk.checksum:
                    mismatched.append(s)
                else:
                    counts[rank] = (changed[rank], s.delta.elements)
    base.verify()
    return transferred, mismatched, counts


def pull_pieces(root: str, host: str, version: int, token: str, layout: SegmentLayout,
                sources: list[RemoteSource], parties: int, keep: int, bucket_bytes: int,
                use_delta: bool = False) -> dict:
    """RDMA-read remote runs into `host`'s segment, in batches of about `bucket_bytes`; count the bytes.

    use_delta: apply the sources' deltas to the host's own sealed copy of their base version instead, when the
    host holds it (else, or for a source whose checksum then disagrees, the full runs are read)."""
    # lazy: monarch.rdma loads its transport backend; the controller imports this module and never pulls
    from monarch.rdma import RDMAAction

    start = time.perf_counter()
    transferred, mismatched, delta, counts = 0, 0, False, {}
    with pulling(root, host, version, token), SegmentWriter(root, host, version, token, layout, keep) as writer:
        base = _pin_base(root, host, layout, sources) if use_delta and sources else None
        if base is not None:
            with base:
                transferred, again, counts = _pull_deltas(writer, base, sources)
            mismatched, delta = len(again), not again
            sources = again
        action, pending = RDMAAction(), 0
        for source in sources:
            if len(source.buffers) != len(source.pieces):
                raise ValueError(f"trainer rank {source.rank} exposed {len(source.buffers)} buffers "
                                 f"for {len(source.pieces)} runs")
            for piece, buf in zip(source.pieces, source.buffers):
                action.read_remote(writer.payload[piece.offset : piece.offset + piece.nbytes], buf)
                # the transfer layer's count of bytes entering this host
                transferred += piece.nbytes
                pending += piece.nbytes
                if pending >= bucket_bytes:
                    action.submit(timeout=600).get()
                    action, pending = RDMAAction(), 0
        if pending:
            action.submit(timeout=600).get()
        published = writer.done(parties)
    return {"bytes_remote": transferred, "published": published, "pull_s": time.perf_counter() - start,
            "delta": delta, "checksum_mismatches": mismatched, "changed": counts}

