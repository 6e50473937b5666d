"""Versioned shared-memory weight segments: trainer shards in, generator parameters out.

One segment per (host, version): a file under `<root>/<host>/` (tmpfs, i.e.
memory) holding every TorchTitan parameter as a *full* tensor at a fixed
offset (`SegmentLayout`). Each trainer rank copies only its own FSDP/EP shard
into the rows it owns (`write_shards`), so no rank gathers anything; a
generator maps the segment and sees full TorchTitan tensors as zero-copy views,
renames them to HF with the export's own code (`titan_ext.export
.iter_hf_buckets` over a meta-built "shadow" model whose parameters are those
views) and copies them into its engine through `load_weights(named)`.

Version barrier: a segment is written under a private temporary name; every
party that writes into it (the host's trainer ranks, or the host's remote
reader) reports done under a file lock, and the last one writes the sealed
header and atomically renames the file to `v<version>.seg`. Published files
are never written again; pruning only unlinks them, and a reader that opened
a version keeps its pages until it closes them (POSIX unlink semantics). So a
reader either cannot open a version or sees all of it: never half of one, and
never a mix of two. The header (magic, version, sealed flag, sizes) is
checked before and after every read as a second line of defence.

GPU (not run on this CPU box): `write_shards` copies CUDA shards into the
shared pages with `copy_` (device-to-host). `cuda_ipc_export` /
`cuda_ipc_import` share a device tensor between processes of one GPU host
(CUDA IPC) for generators that want to skip host memory; they refuse CPU
tensors and are not wired into `mesh.weight_sync` yet.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from actors.weights import check_coverage

MAGIC = b"CMWSEG01"
ALIGN = 64  # every tensor starts on a cache line
PAGE = 4096
DEFAULT_BUCKET_BYTES = 64 << 20
# magic, version, sealed, payload offset, payload bytes, layout json bytes
_HEADER = struct.Struct("<8sqqqqq")


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
    def from_model(model: nn.Module) -> "SegmentLayout":
        slots, offset = [], 0
        for name, p in model.named_parameters():  # deduplicated: tied weights once, under their first name
            name = clean_name(name)
            nbytes = p.numel() * p.element_size()
            slots.append(Slot(name, str(p.dtype).removeprefix("torch."), tuple(p.shape), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return SegmentLayout(tuple(slots), offset)

    def to_json(self) -> bytes:
        return json.dumps([[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.slots]).encode()

    @staticmethod
    def from_json(raw: bytes) -> "SegmentLayout":
        slots = tuple(Slot(n, d, tuple(sh), o, b) for n, d, sh, o, b in json.loads(raw))
        end = max((s.offset + -(-s.nbytes // ALIGN) * ALIGN for s in slots), default=0)
        return SegmentLayout(slots, end)

    @property
    def model_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


@dataclass(frozen=True)
class Piece:
    """A contiguous byte run `[offset, offset + nbytes)` of a segment's payload."""

    offset: int
    nbytes: int


def host_label() -> str:
    """This process's host as Monarch names it: the host part of HYPERACTOR_PROCESS_NAME ("<proc> @ <host>"),
    the hostname on real hosts and the host key on `monarch.job.ProcessJob` fake hosts; else the hostname."""
    name = os.environ.get("HYPERACTOR_PROCESS_NAME", "")
    _, sep, host = name.rpartition(" @ ")
    return host if sep and host else socket.gethostname()


def clean_name(name: str) -> str:
    """A parameter name without activation-checkpoint / compile wrapper prefixes (as the export names it)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def shadow_model(model_cfg: Any, parallelism: Any) -> nn.Module:
    """The trainer's TorchTitan model built on the meta device (names and shapes only, no memory)."""
    from dataclasses import replace

    from titan_ext.models import resolve_model
    from titan_ext.parallelize import prepare_model_config

    spec = resolve_model(replace(model_cfg, hf_path="")).spec
    prepare_model_config(spec.model, parallelism)
    with torch.device("meta"):
        return spec.model.build()


def segment_path(root: str | os.PathLike, host: str, version: int) -> Path:
    """The published file of `version` on `host` (host labels are path-safe: see `mesh.topology.host_label`)."""
    return Path(root) / _safe(host) / f"v{version:010d}.seg"


def _safe(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in host)


def _tmp_path(root: str | os.PathLike, host: str, version: int, token: str) -> Path:
    return Path(root) / _safe(host) / f".v{version:010d}-{token}.tmp"


def _payload_offset(layout_json: bytes) -> int:
    return -(-(_HEADER.size + len(layout_json)) // PAGE) * PAGE


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"segment names an unknown dtype {name!r}")
    return dtype


class _Mapping:
    """An mmap of a segment file and a uint8 tensor over its payload."""

    def __init__(self, path: Path, writable: bool, size: int | None = None) -> None:
        flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
        fd = os.open(path, flags, 0o600)
        try:
            if size is not None and os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # every party truncates to the same size: idempotent
            length = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, length, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
        finally:
            os.close(fd)  # the mapping keeps the pages (and an unlinked file) alive
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)  # [file bytes]


def _views(payload: torch.Tensor, layout: SegmentLayout) -> Iterator[tuple[Slot, torch.Tensor]]:
    for s in layout.slots:
        yield s, payload[s.offset : s.offset + s.nbytes].view(_dtype(s.dtype)).view(s.shape)


# ---- writing (trainer ranks, or a host's remote reader) -----------------------------------------


class SegmentWriter:
    """A party writing into the temporary segment of one (host, version, token); `done()` maybe seals it."""

    def __init__(self, root: str | os.PathLike, host: str, version: int, token: str, layout: SegmentLayout) -> None:
        self.root, self.host, self.version, self.token, self.layout = root, host, version, token, layout
        self.path = _tmp_path(root, host, version, token)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.layout_json = layout.to_json()
        self.payload_at = _payload_offset(self.layout_json)
        self.mapping = _Mapping(self.path, writable=True, size=self.payload_at + layout.nbytes)
        self.payload = self.mapping.bytes[self.payload_at :]  # [layout.nbytes] uint8

    def views(self) -> Iterator[tuple[Slot, torch.Tensor]]:
        return _views(self.payload, self.layout)

    def done(self, parties: int, keep: int) -> bool:
        """Count this party in; the last of `parties` seals and publishes. True when this call published."""
        if parties < 1 or keep < 1:
            raise ValueError(f"parties and keep must be >= 1, got {parties}, {keep}")
        lock = self.path.with_suffix(".lock")
        with open(lock, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            count = len(f.read()) + 1
            f.write("x")
            f.flush()
            if count < parties:
                return False
            header = _HEADER.pack(MAGIC, self.version, 1, self.payload_at, self.layout.nbytes, len(self.layout_json))
            self.mapping.bytes[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            self.mapping.bytes[_HEADER.size : _HEADER.size + len(self.layout_json)].copy_(
                torch.frombuffer(bytearray(self.layout_json), dtype=torch.uint8))
            self.mapping.mm.flush()
            os.replace(self.path, segment_path(self.root, self.host, self.version))  # the publish
        lock.unlink(missing_ok=True)
        prune(self.root, self.host, keep)
        return True


def prune(root: str | os.PathLike, host: str, keep: int) -> None:
    """Unlink all but the newest `keep` published versions (open readers keep theirs), and the leftovers of
    syncs that never sealed (temporary files of versions up to the newest published one)."""
    folder = Path(root) / _safe(host)
    published = sorted(folder.glob("v*.seg"))
    for old in published[:-keep]:
        old.unlink(missing_ok=True)
    newest = int(published[-1].name[1:11]) if published else -1
    for stale in [*folder.glob(".v*.tmp"), *folder.glob(".v*.lock")]:
        if int(stale.name[2:12]) <= newest:
            stale.unlink(missing_ok=True)


def local_shard(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]] | None:
    """This rank's piece of `param` and where it sits in the full tensor; None when another rank writes it.

    Plain tensors are whole. DTensors give their local shard and global offset;
    on replicated mesh dims (HSDP replicas) only coordinate 0 writes.
    """
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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
    """Copy this rank's shard of every parameter into the segment; returns the byte runs written (coalesced)."""
    params = {clean_name(n): p for n, p in model.named_parameters()}
    pieces: list[Piece] = []
    for slot, full in writer.views():
        part = local_shard(params[slot.name])
        if part is None:
            continue
        local, index = part
        if local.numel() == 0:
            continue
        dst = full[index]
        dst.copy_(local)  # device-to-host on GPU
        pieces += _runs(slot, full, index)
    return coalesce(pieces)


def _runs(slot: Slot, full: torch.Tensor, index: tuple[slice, ...]) -> list[Piece]:
    """The byte run of `full[index]` in the payload: contiguous when only dim 0 is sliced (FSDP2, EP)."""
    if any((s.start, s.stop) != (0, n) for s, n in zip(index[1:], full.shape[1:])):
        raise ValueError(f"{slot.name}: shard {index} is not contiguous; only dim-0 sharding is routed")
    if full.dim() == 0:
        return [Piece(slot.offset, slot.nbytes)]
    row = full.stride(0) * full.element_size()
    return [Piece(slot.offset + index[0].start * row, (index[0].stop - index[0].start) * row)]


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Merge touching runs (sorted by offset)."""
    out: list[Piece] = []
    for p in sorted(pieces, key=lambda p: p.offset):
        if out and out[-1].offset + out[-1].nbytes == p.offset:
            out[-1] = Piece(out[-1].offset, out[-1].nbytes + p.nbytes)
        else:
            out.append(p)
    return out


def cuda_ipc_export(snapshot: torch.Tensor) -> tuple:
    """A picklable CUDA IPC handle of a device tensor (send it to a process on the same GPU host)."""
    if not snapshot.is_cuda:
        raise RuntimeError("CUDA IPC needs a CUDA tensor; on CPU the shared-memory segment is the path")
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(snapshot)


def cuda_ipc_import(handle: tuple) -> torch.Tensor:
    """The device tensor behind `cuda_ipc_export`'s handle, mapped into this process (no copy)."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA IPC handles can only be opened where CUDA is available")
    rebuild, args = handle
    return rebuild(*args)


# ---- reading (generators) -----------------------------------------------------------------------


class PinnedSegment:
    """A published version, opened (pinned) for reading: its views stay valid until this object is dropped."""

    def __init__(self, path: Path, version: int) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"weights v{version} are not published at {path} (not sealed yet, or pruned)")
        self.path, self.version = path, version
        self.mapping = _Mapping(path, writable=False)
        raw = self.mapping.mm[: _HEADER.size]
        _, _, _, payload_at, nbytes, layout_len = self._check(raw)
        self.layout = SegmentLayout.from_json(self.mapping.mm[_HEADER.size : _HEADER.size + layout_len])
        self.payload = self.mapping.bytes[payload_at : payload_at + nbytes]
        self._header = bytes(raw)

    def _check(self, raw: bytes) -> tuple:
        fields = _HEADER.unpack(raw)
        magic, version, sealed = fields[:3]
        if magic != MAGIC or version != self.version or sealed != 1:
            raise RuntimeError(f"{self.path}: header {magic!r} v{version} sealed={sealed}, expected v{self.version}")
        return fields

    @staticmethod
    def open(root: str | os.PathLike, host: str, version: int, timeout_s: float = 0.0) -> "PinnedSegment":
        """Open `version` on `host`, waiting up to `timeout_s` for it to be sealed."""
        path = segment_path(root, host, version)
        deadline = time.monotonic() + timeout_s
        while not path.is_file() and time.monotonic() < deadline:
            time.sleep(0.002)
        return PinnedSegment(path, version)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(TorchTitan name, full tensor view) for every parameter."""
        for slot, view in _views(self.payload, self.layout):
            yield slot.name, view

    def verify(self) -> None:
        """The header is unchanged since open (the second check of the version barrier)."""
        raw = bytes(self.mapping.mm[: _HEADER.size])
        self._check(raw)
        if raw != self._header:
            raise RuntimeError(f"{self.path}: header changed while reading v{self.version}")


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


def load_segment(engine: Any, shadow: nn.Module, segment: PinnedSegment, hf_names: list[str],
                 bucket_bytes: int) -> int:
    """Copy a pinned segment into `engine` (HF-named buckets through `engine.load_weights`); returns bytes loaded.

    hf_names: the names the export produces (`hf_names_of(shadow)`), checked
    against the engine before any copy so a mismatch leaves the engine as it was.
    """
    from titan_ext.export import iter_hf_buckets

    check_coverage(engine.named_weights(), hf_names, segment.version)
    segment.verify()
    loaded = 0
    for bucket in iter_hf_buckets(bind_shadow(shadow, segment), bucket_bytes):
        engine.load_weights(bucket)
        loaded += sum(t.numel() * t.element_size() for _, t in bucket)
    segment.verify()
    return loaded


def hf_names_of(shadow: nn.Module) -> list[str]:
    """HF names the export gives `shadow` (run on the meta model: no data touched)."""
    from titan_ext.export import iter_hf_buckets

    return [name for bucket in iter_hf_buckets(shadow, 1 << 62) for name, _ in bucket]


class SegmentLoader:
    """A generator's side of the sync: one meta shadow model (and its HF names) per trainer model config."""

    def __init__(self) -> None:
        self._shadows: dict[Any, tuple[nn.Module, list[str]]] = {}

    def load(self, engine: Any, root: str, host: str, version: int, shadow: tuple, bucket_bytes: int,
             timeout_s: float) -> dict:
        """Load `version` of `host`'s segment into `engine`; returns {"version", "bytes", "load_s", "names"}."""
        start = time.perf_counter()
        if shadow not in self._shadows:
            model = shadow_model(*shadow)
            self._shadows[shadow] = (model, hf_names_of(model))
        model, names = self._shadows[shadow]
        segment = PinnedSegment.open(root, host, version, timeout_s)
        nbytes = load_segment(engine, model, segment, names, bucket_bytes)
        return {"version": version, "bytes": nbytes, "load_s": time.perf_counter() - start, "names": names}


@dataclass
class RemoteSource:
    """One trainer rank's runs and the RDMA buffers over them (same order)."""

    rank: int
    pieces: list[Piece]
    buffers: list


def pull_pieces(root: str, host: str, version: int, token: str, layout: SegmentLayout,
                sources: list[RemoteSource], parties: int, keep: int, bucket_bytes: int) -> dict:
    """RDMA-read remote runs into `host`'s segment, in batches of about `bucket_bytes`; count the bytes."""
    from monarch.rdma import RDMAAction

    start = time.perf_counter()
    writer = SegmentWriter(root, host, version, token, layout)
    transferred = 0
    action, pending = RDMAAction(), 0
    for source in sources:
        if len(source.buffers) != len(source.pieces):
            raise ValueError(f"trainer rank {source.rank} exposed {len(source.buffers)} buffers "
                             f"for {len(source.pieces)} runs")
        for piece, buf in zip(source.pieces, source.buffers):
            action.read_remote(writer.payload[piece.offset : piece.offset + piece.nbytes], buf)
            transferred += piece.nbytes  # the transfer layer's count of bytes entering this host
            pending += piece.nbytes
            if pending >= bucket_bytes:
                action.submit(timeout=600).get()
                action, pending = RDMAAction(), 0
    if pending:
        action.submit(timeout=600).get()
    published = writer.done(parties, keep)
    return {"bytes_remote": transferred, "published": published, "pull_s": time.perf_counter() - start}
