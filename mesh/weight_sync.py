"""Topology-aware weight sync: trainer shards → host segments → generator parameters, by the route plan.

One sync of version v (`TopologySync.start`, then `PendingSync.wait`):
1. every trainer rank copies its own FSDP/EP shard into its host's segment
   (`TrainerActor.publish_shards`; no gather, no collective) — the snapshot to
   host memory, after which the next training step may run;
2. in the background, for each generator host whose weights live (partly) on
   other hosts, its one reader pulls those runs over Monarch RDMA into the
   host's segment (`GeneratorActor.pull_weights`; ibverbs on clusters, TCP
   fallback on CPU), and the last writer seals the segment;
3. every generator waits for its host's sealed v and copies it into its engine
   (`GeneratorActor.load_segment`), reporting the digest of what it holds.

Steps 2–3 are Monarch futures: `start()` returns once step 1 is done, so the
controller can issue the next `train_step` and call `wait()` afterwards. The
version barrier (slot locks and sealed headers, see `actors.shm_weights`) keeps
a generator from reading a half-written version. `sync_weights_topology` is the
one-call form; `mesh.weight_sync_baseline` stays the reference path.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from actors.shm_weights import DEFAULT_BUCKET_BYTES, RemoteSource
from actors.weights import DEFAULT_ROOT
from mesh.topology import RoutePlan, Topology, plan_routes, probe


@dataclass(frozen=True)
class TopologySyncReport:
    """One finished sync: every generator holds `version`; `digest` is theirs (all equal) when verified."""

    version: int
    generators: int
    digest: str | None
    model_bytes: int  # bytes of one full copy of the weights
    cross_host_bytes: int  # counted by the readers' transfer layer
    publish_s: float  # trainer shard copies (the part the next step waits for), as the controller sees it
    total_s: float  # until the last generator held the version
    write_s: float  # the slowest trainer rank's copy into the segment, inside the actor
    load_s: float  # the slowest generator's load into its engine, inside the actor
    pull_s: dict[str, float] = field(default_factory=dict)  # per reader host


@dataclass
class PendingSync:
    """A sync whose reads are in flight; `wait()` checks and reports."""

    version: int
    start: float
    publish_s: float
    write_s: float
    model_bytes: int
    pulls: dict[str, Any]
    loads: list[Any]
    verify: bool

    _pulled: dict[str, dict] | None = field(default=None, init=False, repr=False)

    def pulled(self) -> dict[str, dict]:
        """Wait for the remote pulls only (the trainer's exposed runs may be overwritten after this)."""
        if self._pulled is None:
            self._pulled = {host: f.get() for host, f in self.pulls.items()}
        return self._pulled

    def wait(self) -> TopologySyncReport:
        pulled = self.pulled()
        results = [f.get() for f in self.loads]
        bad = [i for i, r in enumerate(results) if r["version"] != self.version]
        digests = {r["digest"] for r in results}
        if bad or (self.verify and len(digests) != 1):
            raise RuntimeError(f"weight sync v{self.version}: generators disagree (wrong version {bad}, "
                               f"{len(digests)} distinct digests)")
        return TopologySyncReport(
            self.version, len(results), digests.pop() if self.verify else None, self.model_bytes,
            sum(p["bytes_remote"] for p in pulled.values()), self.publish_s, time.perf_counter() - self.start,
            self.write_s, max((r["load_s"] for r in results), default=0.0), {h: p["pull_s"] for h, p in pulled.items()},
        )


class TopologySync:
    """Weight sync for one trainer mesh and a list of generator actors, routed by their topology.

    root: shared-memory folder for the segments (one subfolder per host);
    keep: sealed versions readable per host (a ring of keep + 1 slots; >= 2 lets a slow generator finish v
    while v+1 lands; a writer waits for the readers of the slot it reuses);
    bucket_bytes: RDMA batch and HF bucket size; verify: generators report digests (sha256 of the
    weights; costs one pass over them).
    """

    def __init__(self, trainer: Any, generators: Sequence[Any], root: str = DEFAULT_ROOT, *, keep: int = 2,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: bool = True, timeout_s: float = 300.0) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.trainer, self.generators = trainer, list(generators)
        self.root, self.keep, self.bucket_bytes, self.verify, self.timeout_s = root, keep, bucket_bytes, verify, timeout_s
        self.topology: Topology = probe(trainer, self.generators)
        self.plan: RoutePlan = plan_routes(self.topology)
        self.shadow = next(iter(trainer.host_info.call().get().values()))["shadow"]
        self._last: PendingSync | None = None

    def start(self) -> PendingSync:
        """Snapshot the trainer's shards (returns when they are in host memory) and launch the reads.

        Waits first for the previous sync's remote pulls: they read trainer-host slots over RDMA, where the
        slot locks cannot see them."""
        if self._last is not None:
            self._last.pulled()
        start = time.perf_counter()
        token = uuid.uuid4().hex[:12]
        parties = {h: self.plan.parties_on(h) for h in set(self.plan.source_hosts) | {r.host for r in self.plan.routes}}
        reports = list(self.trainer.publish_shards.call(
            self.root, token, parties, self.keep, self.plan.remote_ranks).get().values())
        publish_s = time.perf_counter() - start
        version = {r.version for r in reports}
        if len(version) != 1:
            raise RuntimeError(f"trainer ranks are at different steps {sorted(version)}")
        version_ = version.pop()
        by_rank = {r.rank: r for r in reports}
        pulls = {}
        for route in self.plan.routes:
            if route.reader is None:
                continue
            sources = [RemoteSource(r, by_rank[r].pieces, by_rank[r].buffers) for r in route.remote_sources]
            pulls[route.host] = self.generators[route.reader].pull_weights.call_one(
                self.root, version_, token, reports[0].layout, sources, route.parties, self.keep, self.bucket_bytes)
        loads = [g.load_segment.call_one(self.root, version_, self.shadow, self.bucket_bytes, self.timeout_s,
                                         self.verify, token) for g in self.generators]
        self._last = PendingSync(version_, start, publish_s, max(r.write_s for r in reports),
                                 reports[0].layout.model_bytes, pulls, loads, self.verify)
        return self._last

    def sync(self) -> TopologySyncReport:
        return self.start().wait()


def sync_weights_topology(trainer: Any, generators: Sequence[Any], root: str = DEFAULT_ROOT,
                          **kwargs: Any) -> TopologySyncReport:
    """Probe, plan and run one sync (build a `TopologySync` once to reuse the plan across steps)."""
    return TopologySync(trainer, generators, root, **kwargs).sync()
