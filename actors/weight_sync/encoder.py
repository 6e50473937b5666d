"""Delta encoding off the trainer's critical path: one background thread per trainer rank, chunks served as they come.

`TrainerActor.publish_shards` writes and seals its shards (what the next
`train_step` waits for), then hands the sealed version to its process's
`BackgroundEncoder` and returns. The encoder's thread starts at the first
reader's request (so it slows no rank's publication, which the step waits
for), waits for the host's seal, then XORs and compresses the
runs against the rank's `DeltaBase` (`actors.weight_sync.delta`) and cuts
the result into chunks of about `chunk_bytes` of input. A `DeltaEncoderActor`
on the same process serves them to the readers (`chunk`), each as soon as it
is encoded and in the reply itself (a delta is a few percent of the bytes:
one round trip per chunk, no buffer to register), so a reader applies chunk k
while chunk k+1 is encoded, and the trainer actor's own queue (the next
`train_step`) never waits for the encoding.

The sealed versions the thread reads (the new one and its base, the rank's
previous publication: `DeltaBase` keeps no copy) stay unchanged while it
runs: a slot is reused only `keep` versions later, and every publication
first waits for the previous encoding (`BackgroundEncoder.finish`). A failed encoding is raised
there, at the trainer's next publication, naming the version; its readers
never see it as a delta (`chunk` raises, and they read that rank whole).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from monarch.actor import Actor, endpoint

from composer_mesh.actors.chaos import fail_point
from composer_mesh.actors.weight_sync.delta import DeltaBase, RunDelta
from composer_mesh.actors.weight_sync.segment import Piece

# input bytes per chunk: small enough to pipeline a shard of a few tens of MB, large enough that the chunks'
# round trips are small against their encoding (bench shape, 73 MB a rank: end-to-end ratio 0.65 at 4 MiB,
# 0.56-0.60 at 16, 0.53-0.56 at 32; docs/weight_sync.md)
CHUNK_BYTES = 32 << 20
# how often, and how long, an encoding waits for its `ready` (the host's seal: the other ranks' copies, milliseconds)
READY_POLL_S = 0.0005
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DeltaPlan:
    """What a reader knows of a rank's delta at publish time: version `version` of sync `token` as changes
    against `base_version` of sync `base_token` (the very bytes the reader must hold), over `runs` in order."""

    version: int
    token: str
    base_version: int
    base_token: str
    itemsize: int
    runs: list[Piece]

    @property
    def elements(self) -> int:
        return sum(r.nbytes for r in self.runs) // self.itemsize


@dataclass
class DeltaChunk:
    """One chunk of a rank's delta: its runs' encodings (`at` within `data`, its encoded bytes); on the `last`
    chunk, `checksum`, the checksum (`runs_checksum`) of all the rank's runs after applying. `data` is `bytes`
    because a reply carries bytes at twice the speed of a tensor (1 MiB: 1.1-1.4 ms against 2.3-3.0)."""

    runs: list[RunDelta]
    data: bytes
    last: bool
    checksum: int | None

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @property
    def changed(self) -> int:
        return sum(r.changed for r in self.runs)


class Superseded(RuntimeError):
    """A publication whose host was never sealed (another rank failed it) before this rank published again:
    nothing was read or changed, so the base stays and nobody pulls it."""


@dataclass
class EncodeJob:
    """One publication's encoding (or, with no `plan`, the base's refresh) on the encoder's thread."""

    plan: DeltaPlan | None
    # the encoder's thread for this job: started by the first reader's `chunk`, else by the next publication
    thread: threading.Thread | None = None
    # whether a reader asked for a chunk (a delta nobody asked for is never encoded)
    asked: bool = False
    # the runs of each chunk, in order, their encoded bytes, and whether it is the last
    chunks: list[tuple[list[RunDelta], bytes, bool]] = field(default_factory=list)
    # `runs_checksum` of all the runs, set with the last chunk
    checksum: int | None = None
    error: BaseException | None = None
    finished: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)
    # set by the next publication: a job still waiting for its host's seal then gives up (`Superseded`)
    cancel: threading.Event = field(default_factory=threading.Event)

    def start(self, asked: bool) -> None:
        """Start the job's thread unless it runs already; `asked`: a reader wants its chunks."""
        with self.cond:
            self.asked = self.asked or asked
            if self.thread is not None and self.thread.ident is None:
                self.thread.start()

    def chunk(self, index: int, timeout_s: float) -> tuple[list[RunDelta], bytes, bool, int | None]:
        """Chunk `index` once encoded (the first call starts the encoding): (runs, bytes, last, checksum on the
        last); raises when the encoding failed."""
        self.start(asked=True)
        with self.cond:
            ready = self.cond.wait_for(lambda: len(self.chunks) > index or self.finished, timeout_s)
            if self.error is not None:
                raise RuntimeError(f"background delta encode of {self.name()} failed: "
                                   f"{type(self.error).__name__}: {self.error}") from self.error
            if not ready:
                raise TimeoutError(f"delta chunk {index} of {self.name()} not encoded within {timeout_s} s")
            if index >= len(self.chunks):
                raise IndexError(f"{self.name()} has {len(self.chunks)} delta chunks, not {index + 1}")
            runs, data, last = self.chunks[index]
            return runs, data, last, self.checksum if last else None

    def name(self) -> str:
        """The publication it encodes, for errors."""
        return f"v{self.plan.version} (sync {self.plan.token})" if self.plan else "the base refresh"


class BackgroundEncoder:
    """One trainer rank's delta base and the thread that encodes each publication against it."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.base = DeltaBase()
        self.chunk_bytes = chunk_bytes
        self.job: EncodeJob | None = None

    def finish(self) -> None:
        """Wait for the running encoding; raise, once, when it failed (the base is then gone: the next delta
        publication is an anchor). A job no reader started only makes its version the base. An encoding still
        waiting for its host's seal is dropped instead: every rank returns from a publication only after
        writing it, so a version unsealed now never will be."""
        job = self.job
        if job is not None:
            job.cancel.set()
            job.start(asked=False)
            job.thread.join()
        if job is not None and isinstance(job.error, Superseded):
            self.job = None
        elif job is not None and job.error is not None:
            self.job = None
            raise RuntimeError(f"{job.name()}: the background delta encode failed, so that version reached "
                               f"other hosts whole; the base is dropped and the next publication is an anchor "
                               f"({type(job.error).__name__}: {job.error})") from job.error

    def submit(self, payload_U8: torch.Tensor, runs: list[Piece], version: int, token: str, itemsize: int,
               encode: bool, ready: Callable[[], bool] | None = None) -> DeltaPlan | None:
        """Make `runs` of `payload_U8` (this rank's sealed version `version` of sync `token`) the next base; with
        `encode` and a base of the same runs, as a delta against it (its plan is returned; chunks come from
        `job.chunk`). Nothing runs until a reader asks for a chunk, so the encoding never slows a publication
        (this rank's or another rank's, which the training step waits for); the next publication only makes it the
        base if nobody did. `payload_U8` must stay unchanged until the encoding after this one has finished (it is
        that one's base, read in place: the trainer's sealed slot). With `ready`, the job waits until it returns
        True (the trainer's: every rank on the host has written its shards)."""
        self.finish()
        plan = None
        if encode and self.base.matches(payload_U8, runs):
            plan = DeltaPlan(version, token, self.base.version, self.base.token, itemsize, list(runs))
        job = EncodeJob(plan)
        job.thread = threading.Thread(target=self._run, args=(job, payload_U8, runs, version, token, itemsize, ready),
                                      name=f"delta-encode-v{version}", daemon=True)
        self.job = job
        return plan

    def drop(self) -> None:
        """Deltas off: wait for the running encoding and free the base."""
        try:
            self.finish()
        finally:
            self.job = None
            self.base.drop()

    @staticmethod
    def _emit(job: EncodeJob, runs: list[RunDelta], sections: list[np.ndarray], last: bool, checksum: int) -> None:
        """Hand a chunk to the readers waiting on `job`."""
        data = b"".join(sections)
        with job.cond:
            if last:
                job.checksum = checksum
            job.chunks.append((runs, data, last))
            job.cond.notify_all()

    def _run(self, job: EncodeJob, payload_U8: torch.Tensor, runs: list[Piece], version: int, token: str,
             itemsize: int, ready: Callable[[], bool] | None) -> None:
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            # `ready` first: a seal that came before the cancel still counts
            while ready is not None and not ready():
                if job.cancel.is_set():
                    raise Superseded(f"v{version}: published again before its host was sealed")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"v{version}: the host's segment was not sealed within {READY_TIMEOUT_S} s")
                time.sleep(READY_POLL_S)
            with job.cond:
                asked = job.asked
            if job.plan is None or not asked:
                # an anchor, or a delta no reader asked for before this rank published again (their hosts read
                # it whole, or not at all): this version is the base, with nothing to encode
                self.base.refresh(payload_U8, runs, version, token)
                return
            fail_point("trainer", "delta_encode")
            checksum, pending, sections, at, input_bytes = 0, [], [], 0, 0
            encoded = self.base.encode_runs(payload_U8, runs, version, token, itemsize)
            for n, (rd, section, checksum) in enumerate(encoded):
                pending.append(dataclasses.replace(rd, at=at))
                sections.append(section)
                at += section.size
                input_bytes += rd.run.nbytes
                if input_bytes >= self.chunk_bytes or n == len(runs) - 1:
                    self._emit(job, pending, sections, n == len(runs) - 1, checksum)
                    pending, sections, at, input_bytes = [], [], 0, 0
            if not runs:
                self._emit(job, [], [], True, checksum)
        except BaseException as exc:  # noqa: BLE001 - kept for the next publication and the readers
            if not isinstance(exc, Superseded):
                self.base.drop()
            job.error = exc
        finally:
            with job.cond:
                job.finished = True
                job.cond.notify_all()


_ENCODER: BackgroundEncoder | None = None


def process_encoder() -> BackgroundEncoder:
    """This process's encoder: the trainer rank's (`TrainerActor`) and the one `DeltaEncoderActor` serves."""
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = BackgroundEncoder()
    return _ENCODER


class DeltaEncoderActor(Actor):
    """Serves this process's delta chunks to readers on other hosts, beside the trainer actor (whose queue may
    hold a `train_step`): `chunk` waits for the chunk, not for the actor."""

    @endpoint
    def chunk(self, version: int, token: str, index: int, timeout_s: float = 300.0) -> DeltaChunk:
        """Chunk `index` of this rank's delta of version `version` (sync `token`), once encoded."""
        job = process_encoder().job
        if job is None or job.plan is None or (job.plan.version, job.plan.token) != (version, token):
            raise RuntimeError(f"no delta of v{version} (sync {token}) is being encoded here: a newer publication "
                               "replaced it, or the trainer restarted")
        return DeltaChunk(*job.chunk(index, timeout_s))
