"""A host's remote pull: RDMA-read the runs of trainer ranks on other hosts (or their deltas) into its segment."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from composer_mesh.actors.weight_sync.delta import Delta, apply_delta, runs_crc
from composer_mesh.actors.weight_sync.mapping import one_thread
from composer_mesh.actors.weight_sync.pull_status import pulling
from composer_mesh.actors.weight_sync.reader import PinnedSegment
from composer_mesh.actors.weight_sync.segment import Piece, SegmentLayout
from composer_mesh.actors.weight_sync.writer import SegmentWriter


@dataclass
class RemoteSource:
    """One trainer rank's runs and the RDMA buffers over them (same order); with deltas on, its runs' changes
    since the version it published last (`Delta`) and the RDMA buffer of their bytes (`monarch.rdma.RDMABuffer`,
    None when the delta has none)."""

    rank: int
    pieces: list[Piece]
    buffers: list
    delta: Delta | None = None
    delta_buffer: Any = None


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


def _pull_deltas(writer: SegmentWriter, base: PinnedSegment, sources: list[RemoteSource]) -> tuple[int, list]:
    """Read every source's delta bytes (one RDMA batch) and write its runs as `base` XOR the delta; returns
    (bytes read, the sources whose CRC after applying did not match: to be pulled whole)."""
    # lazy: monarch.rdma loads its transport backend; the controller imports this module and never pulls
    from monarch.rdma import RDMAAction

    action, received = RDMAAction(), {}
    for s in sources:
        received[s.rank] = torch.empty(s.delta.nbytes, dtype=torch.uint8)
        if s.delta.nbytes:
            action.read_remote(received[s.rank], s.delta_buffer)
    action.submit(timeout=600).get()
    mismatched = []
    with one_thread():
        for s in sources:
            try:
                apply_delta(writer.payload, base.payload, s.delta, received[s.rank])
            except ValueError:
                # undecodable: counted with the CRC mismatches, read whole
                mismatched.append(s)
                continue
            if runs_crc(writer.payload, [rd.run for rd in s.delta.runs]) != s.delta.crc:
                mismatched.append(s)
    base.verify()
    return sum(s.delta.nbytes for s in sources), mismatched


def pull_pieces(root: str, host: str, version: int, token: str, layout: SegmentLayout,
                sources: list[RemoteSource], parties: int, keep: int, bucket_bytes: int,
                use_delta: bool = False) -> dict:
    """RDMA-read remote runs into `host`'s segment, in batches of about `bucket_bytes`; count the bytes.

    use_delta: apply the sources' deltas to the host's own sealed copy of their base version instead, when the
    host holds it (else, or for a source whose CRC then disagrees, the full runs are read)."""
    # lazy: monarch.rdma loads its transport backend; the controller imports this module and never pulls
    from monarch.rdma import RDMAAction

    start = time.perf_counter()
    transferred, mismatched, delta = 0, 0, False
    with pulling(root, host, version, token), SegmentWriter(root, host, version, token, layout, keep) as writer:
        base = _pin_base(root, host, layout, sources) if use_delta and sources else None
        if base is not None:
            with base:
                transferred, again = _pull_deltas(writer, base, sources)
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
            "delta": delta, "crc_mismatches": mismatched}

