"""Versioned shared-memory weight segments: trainer shards in, generator parameters out.

Each host keeps a ring of `keep + 1` segment files ("slots") under
`<root>/<host>/` (tmpfs, i.e. memory); version v goes into slot v mod (keep + 1).
A segment holds every TorchTitan parameter as a *full* tensor at a fixed
offset (`SegmentLayout`). Each trainer rank copies only its own FSDP/EP shard
into the rows it owns (`write_shards`), so no rank gathers anything; a
generator maps the segment and sees full TorchTitan tensors as zero-copy views,
renames them to HF with the export's own code (`titan_ext.hf.adapters
.iter_hf_buckets` over a meta-built "shadow" model whose parameters are those
views) and copies them into its engine through `load_weights(named)`.

Slots are reused and every process keeps its mapping of a slot (and a
generator its shadow bound to it): after the first syncs no page is faulted,
zeroed or re-bound again, so a sync is two memory copies at memory speed.

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

GPU (not run on this CPU box): `write_shards` copies CUDA shards into the
shared pages with `copy_` (device-to-host), and generators copy them up into
their engines. There is no CUDA IPC path that skips host memory.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import struct
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

import torch
from torch import nn

MAGIC = b"CMWSEG02"
ALIGN = 64  # every tensor starts on a cache line
PAGE = 4096
DEFAULT_BUCKET_BYTES = 64 << 20
# magic, version, sealed, payload offset, payload bytes, layout json bytes, sync token
_HEADER = struct.Struct("<8sqqqqq16s")


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
        for name, p in model.named_parameters():  # deduplicated: tied weights once, under their first name
            name = clean_name(name)
            slot_dtype = dtype or p.dtype
            nbytes = p.numel() * slot_dtype.itemsize
            slots.append(Slot(name, str(slot_dtype).removeprefix("torch."), tuple(p.shape), offset, nbytes))
            offset += _round_up(nbytes, ALIGN)
        return SegmentLayout(tuple(slots), offset)

    def to_json(self) -> bytes:
        return json.dumps([[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.slots]).encode()

    @staticmethod
    def from_json(raw: bytes) -> "SegmentLayout":
        slots = tuple(Slot(n, d, tuple(sh), o, b) for n, d, sh, o, b in json.loads(raw))
        end = max((s.offset + _round_up(s.nbytes, ALIGN) for s in slots), default=0)
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
    from titan_ext.models import resolve_model
    from titan_ext.parallelize import prepare_model_config

    spec = resolve_model(model_cfg).spec  # reads hf_path's config.json only (the shape may come from it)
    prepare_model_config(spec.model, parallelism)
    with torch.device("meta"):
        return spec.model.build()


def _path_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def host_dir(root: str | os.PathLike, host: str) -> Path:
    """The folder of `host`'s slots (host labels are made path-safe: one folder, no traversal)."""
    return Path(root) / _path_safe(host)


def failure_path(root: str | os.PathLike, host: str, version: int, token: str) -> Path:
    """Where a failed pull of `version` (sync `token`) onto `host` leaves its error, for the loads waiting there."""
    return host_dir(root, host) / f"failed-v{version:08d}-{_path_safe(token)}.txt"


def mark_failed(root: str | os.PathLike, host: str, version: int, token: str, exc: BaseException) -> None:
    """Record that `version` will never be sealed on `host`: `PinnedSegment.open` then raises at once instead of
    waiting out its `timeout_s`."""
    path = failure_path(root, host, version, token)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(f"{type(exc).__name__}: {exc}"[:500])
    os.replace(tmp, path)


def puller_path(root: str | os.PathLike, host: str, version: int, token: str) -> Path:
    """Where the process pulling `version` (sync `token`) onto `host` leaves its pid while it pulls."""
    return host_dir(root, host) / f"pulling-v{version:08d}-{_path_safe(token)}.pid"


@contextmanager
def pulling(root: str | os.PathLike, host: str, version: int, token: str) -> Iterator[None]:
    """This process pulls `version` onto `host` for the block's duration. A pull that raises marks the version
    failed; one whose process dies (SIGKILL, the OOM killer) leaves its pid behind, and the loads waiting there
    see that process gone and fail at once (`PinnedSegment.open`) instead of waiting out their `timeout_s`."""
    marker = puller_path(root, host, version, token)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(os.getpid()))
    try:
        yield
    except BaseException as exc:  # the host's loads wait for this version: tell them it is not coming
        mark_failed(root, host, version, token, exc)
        raise
    finally:
        marker.unlink(missing_ok=True)


def _dead_puller(root: str | os.PathLike, host: str, version: int, token: str) -> int | None:
    """The pid of a process that was pulling `version` onto `host` and is gone, else None."""
    try:
        pid = int(puller_path(root, host, version, token).read_text())
    except (FileNotFoundError, ValueError):  # no pull running, or its pid half-written
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except PermissionError:  # alive, someone else's
        pass
    return None


def slot_path(root: str | os.PathLike, host: str, slot: int) -> Path:
    return host_dir(root, host) / f"slot{slot:03d}.seg"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _payload_offset(layout_json: bytes) -> int:
    return _round_up(_HEADER.size + len(layout_json), PAGE)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"segment names an unknown dtype {name!r}")
    return dtype


def _token(token: str) -> bytes:
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
        raw = os.pread(fd, _HEADER.size, 0)
        return Header(*_HEADER.unpack(raw)) if len(raw) == _HEADER.size else None

    @property
    def complete(self) -> bool:
        """A sealed version of this format."""
        return self.magic == MAGIC and self.sealed == 1

    def holds(self, version: int, token: str | None) -> bool:
        """Sealed `version` (of the sync `token`, when given)."""
        return self.complete and self.version == version and (token is None or self.token == _token(token))


@contextmanager
def _locked(path: Path) -> Iterator[IO[str]]:
    """`path` opened for update under an exclusive flock (a slot's claim and party count)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        yield f


class _Mapping:
    """A whole segment file mapped once (shared; read-only for readers) and a uint8 tensor over it.

    Mapped through its own open of the file: Python's mmap keeps a dup of the descriptor it was given, and a
    dup of a descriptor that holds the slot's flock would keep that lock alive as long as the mapping.
    """

    def __init__(self, path: Path, writable: bool) -> None:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.key = (st.st_dev, st.st_ino, st.st_size)
            self.mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only pages: a stray write faults loudly instead of going stale
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)  # [file bytes]


_MAPPINGS: dict[tuple[str, bool], _Mapping] = {}


def _mapping(path: Path, fd: int, writable: bool) -> _Mapping:
    """This process's mapping of the slot file open (and locked) at `fd`, reused while the file and its size
    are unchanged, so its pages are faulted once per process, not once per version. Mappings of files that
    were removed (a deleted root) are dropped, freeing their memory once no tensor views them."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size)
    cached = _MAPPINGS.get((str(path), writable))
    if cached is not None and cached.key == key:
        return cached
    for (other, w), m in list(_MAPPINGS.items()):
        try:
            gone = os.stat(other).st_ino != m.key[1]
        except FileNotFoundError:
            gone = True
        if gone:
            del _MAPPINGS[(other, w)]
    mapping = _Mapping(path, writable)
    if mapping.key != key:
        raise RuntimeError(f"{path} was replaced while being mapped")
    _MAPPINGS[(str(path), writable)] = mapping
    return mapping


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch ops in one thread: the copies here are memory-bound and several processes of a host copy at
    once; with a thread team per op, every one of the many small copies waits for a core another process holds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _views(payload: torch.Tensor, layout: SegmentLayout) -> Iterator[tuple[Slot, torch.Tensor]]:
    for s in layout.slots:
        yield s, payload[s.offset : s.offset + s.nbytes].view(_dtype(s.dtype)).view(s.shape)


class _SlotHold:
    """An open slot file whose flock this object holds: `release()` (or leaving a `with` block) closes the
    descriptor, which lets go of the lock; a writer released before `done()` never seals its version."""

    fd = -1

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "_SlotHold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


# ---- writing (trainer ranks, or a host's remote reader) -----------------------------------------


class SegmentWriter(_SlotHold):
    """A party writing version `version` of sync `token` into its slot on `host`; `done()` maybe seals it.

    keep: sealed versions a host keeps readable (its ring has keep + 1 slots);
    timeout_s: how long to wait for readers of the slot's previous version to let go.
    """

    def __init__(self, root: str | os.PathLike, host: str, version: int, token: str, layout: SegmentLayout,
                 keep: int, timeout_s: float = 300.0) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.version, self.token, self.layout = version, _token(token), layout
        self.path = slot_path(root, host, version % (keep + 1))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock_path = self.path.with_suffix(".lock")
        self.layout_json = layout.to_json()
        self.payload_at = _payload_offset(self.layout_json)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._claim(time.monotonic() + timeout_s)
            self.mapping = _mapping(self.path, self.fd, writable=True)
        except BaseException:
            self.release()
            raise
        self.payload = self.mapping.bytes[self.payload_at : self.payload_at + layout.nbytes]  # [layout.nbytes]

    def _claim(self, deadline: float) -> None:
        """Hold the slot (shared lock) for this sync; the first party empties it of the previous version."""
        while True:
            with _locked(self.lock_path):
                claimed = self._owns()
            if claimed:
                fcntl.flock(self.fd, fcntl.LOCK_SH)
                break
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no reader or writer of the old version left
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.path}: still read or written for an older version; cannot write "
                                       f"v{self.version} (raise keep, or look for a stuck generator)") from None
                time.sleep(0.001)
                continue
            with _locked(self.lock_path) as count:
                if not self._owns():
                    size = self.payload_at + self.layout.nbytes
                    if os.fstat(self.fd).st_size < size:
                        os.ftruncate(self.fd, size)  # grow only: other processes may map the old length
                    os.pwrite(self.fd, self._header(sealed=0), 0)
                    count.truncate(0)
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            break
        if not self._owns():  # a newer sync took the slot between our locks
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            raise RuntimeError(f"{self.path}: taken by a newer sync before v{self.version} was written")

    def _owns(self) -> bool:
        """The slot's header names this sync."""
        header = Header.read(self.fd)
        return header is not None and header.token == self.token

    def _header(self, sealed: int) -> bytes:
        return _HEADER.pack(MAGIC, self.version, sealed, self.payload_at, self.layout.nbytes, len(self.layout_json),
                            self.token)

    def views(self) -> Iterator[tuple[Slot, torch.Tensor]]:
        return _views(self.payload, self.layout)

    def done(self, parties: int) -> bool:
        """Count this party in and let go of the slot; the last of `parties` seals. True when this call sealed."""
        if parties < 1:
            raise ValueError(f"parties must be >= 1, got {parties}")
        try:
            with _locked(self.lock_path) as f:
                if not self._owns():
                    raise RuntimeError(f"{self.path}: taken by a newer sync while v{self.version} was written")
                count = len(f.read()) + 1
                f.write("x")
                f.flush()
                if count < parties:
                    return False
                os.pwrite(self.fd, self.layout_json, _HEADER.size)
                os.pwrite(self.fd, self._header(sealed=1), 0)  # the publish
                return True
        finally:
            self.release()


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
            full[index].copy_(local)  # device-to-host on GPU; casts to the slot's (serving) dtype
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


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Merge touching runs (sorted by offset)."""
    out: list[Piece] = []
    for p in sorted(pieces, key=lambda p: p.offset):
        if out and out[-1].offset + out[-1].nbytes == p.offset:
            out[-1] = Piece(out[-1].offset, out[-1].nbytes + p.nbytes)
        else:
            out.append(p)
    return out


# ---- reading (generators) -----------------------------------------------------------------------


class PinnedSegment(_SlotHold):
    """A sealed version held for reading (a shared lock on its slot, so no writer can reuse the slot): its
    views stay valid and unchanged until `release()` or the end of a `with` block."""

    def __init__(self, path: Path, fd: int, header: Header) -> None:
        self.fd = -1  # owned only once fully built (the caller closes it if this raises)
        self.path, self.version, self._header = path, header.version, header
        self.mapping = _mapping(path, fd, writable=False)
        raw = self.mapping.mm[_HEADER.size : _HEADER.size + header.layout_len]
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
            dead = _dead_puller(root, host, version, token) if token is not None else None
            if dead is not None:  # sealed just before it died? look once more
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
                fcntl.flock(fd, fcntl.LOCK_SH)  # a claiming writer holds the exclusive lock only for an instant
                header = Header.read(fd)  # checked again under the lock: the slot may have been claimed meanwhile
                if header is not None and header.holds(version, token):
                    return PinnedSegment(path, fd, header)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(TorchTitan name, full tensor view) for every parameter."""
        for slot, view in _views(self.payload, self.layout):
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
    from titan_ext.hf.adapters import iter_hf_buckets

    engine.check_coverage(hf_names, segment.version)
    segment.verify()
    loaded = 0

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:  # bucket by bucket, in one load (vLLM's is whole-model)
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
    from titan_ext.hf.adapters import iter_hf_buckets

    return [name for bucket in iter_hf_buckets(shadow, 1 << 62) for name, _ in bucket]


class SegmentLoader:
    """A generator's side of the sync: per trainer model config its HF names, and per slot a shadow model
    bound to that slot's mapping (views stay valid while the mapping lives, so binding happens once)."""

    def __init__(self) -> None:
        self._names: dict[Any, list[str]] = {}
        self._bound: dict[tuple[Any, str], tuple[_Mapping, SegmentLayout, nn.Module]] = {}

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


@dataclass
class RemoteSource:
    """One trainer rank's runs and the RDMA buffers over them (same order); with deltas on, its runs' changes
    since the version it published last (`actors.weight_delta.Delta`) and the RDMA buffer of their bytes."""

    rank: int
    pieces: list[Piece]
    buffers: list
    delta: Any = None  # actors.weight_delta.Delta | None
    delta_buffer: Any = None  # monarch.rdma.RDMABuffer over the delta's bytes (None when it has none)


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


def _pull_deltas(writer: "SegmentWriter", base: PinnedSegment, sources: list[RemoteSource]) -> tuple[int, list]:
    """Read every source's delta bytes (one RDMA batch) and write its runs as `base` XOR the delta; returns
    (bytes read, the sources whose CRC after applying did not match: to be pulled whole)."""
    from monarch.rdma import RDMAAction

    from actors.weight_delta import apply_delta, runs_crc

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
            except ValueError:  # undecodable: counted with the CRC mismatches, read whole
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
                transferred += piece.nbytes  # the transfer layer's count of bytes entering this host
                pending += piece.nbytes
                if pending >= bucket_bytes:
                    action.submit(timeout=600).get()
                    action, pending = RDMAAction(), 0
        if pending:
            action.submit(timeout=600).get()
        published = writer.done(parties)
    return {"bytes_remote": transferred, "published": published, "pull_s": time.perf_counter() - start,
            "delta": delta, "crc_mismatches": mismatched}
