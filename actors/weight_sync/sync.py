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
version barrier (slot locks and sealed headers, see `actors.weight_sync.segment`)
keeps a generator from reading a half-written version. `sync_weights_topology`
is the one-call form. The controller's main loop and the DiLoCo loop
(`mesh.replicas`) both sync through `TopologySync`.

The controller (`mesh.controller`) uses the parts separately: `publish()` is
steps 1–2 (a `Publication`; it first waits for the previous publication's
remote pulls), `Publication.sealed` / `load` / `check` are step 3 for one
generator (async workers load between their own `generate` calls),
`replaced` re-plans after a generator respawn and `covering` gives the
publication a replacement can load.
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from composer_mesh.actors.weight_sync.pull import RemoteSource
from composer_mesh.actors.weight_sync.routes import MeshTopology, ProcInfo, RoutePlan, Topology, plan_routes, probe
from composer_mesh.actors.weight_sync.segment import DEFAULT_BUCKET_BYTES, DEFAULT_ROOT


@dataclass(frozen=True)
class TopologySyncReport:
    """One finished sync: every generator holds `version`; `digest` is theirs (all equal) when verified."""

    version: int
    generators: int
    digest: str | None
    # bytes of one full copy of the weights
    model_bytes: int
    # counted by the readers' transfer layer
    cross_host_bytes: int
    # trainer shard copies (the part the next step waits for), as the controller sees it
    publish_s: float
    # until the last generator held the version
    total_s: float
    # the slowest trainer rank's copy into the segment, inside the actor
    write_s: float
    # the slowest generator's load into its engine, inside the actor
    load_s: float
    pull_s: dict[str, float] = field(default_factory=dict)  # per reader host
    # per reader host: it applied a delta (else full runs)
    delta: dict[str, bool] = field(default_factory=dict)
    # elements that changed since their last publication, in the pulled ranks' deltas readers applied
    changed: int = 0
    # elements of those ranks' runs (0: no delta was applied, e.g. an anchor)
    elements: int = 0


def sync_metrics(report: TopologySyncReport) -> dict[str, float]:
    """A sync's figures for a step's metrics row: wall time, bytes that crossed hosts, how many reader hosts
    applied a delta, and (when a delta was encoded) the fraction of the pulled elements that changed."""
    metrics = {"time/sync_s": report.total_s, "sync/cross_host_mb": report.cross_host_bytes / 1e6,
               "sync/delta_hosts": float(sum(report.delta.values()))}
    if report.elements:
        metrics["sync/changed_fraction"] = report.changed / report.elements
    return metrics


def check_loads(version: int, results: list[dict], verify: bool, digest: str | None = None) -> str | None:
    """The digest generators report after loading `version` (None unless `verify`); raises when one holds
    another version or, verifying, when their digests differ from each other or from `digest` (known before)."""
    bad = [i for i, r in enumerate(results) if r["version"] != version]
    digests = {r["digest"] for r in results} | ({digest} if digest is not None else set())
    if bad or (verify and len(digests) > 1):
        raise RuntimeError(f"weight sync v{version}: generators disagree (wrong version {bad}, "
                           f"{len(digests)} distinct digests)")
    return digests.pop() if verify and digests else None


@dataclass
class Publication:
    """Version `version` of sync `token` in the segments of `hosts` under `root`: every trainer rank's shards
    are in host memory, the remote pulls (`pulls`, per reader host) in flight. Any generator on one of `hosts`
    can `load` it once its host's segment is `sealed`; `check` holds every load of it to the same digest (the
    first verified one). Safe to share between threads (async workers load it while the controller publishes)."""

    version: int
    token: str
    root: str
    hosts: frozenset[str]
    pulls: dict[str, Any]
    model_bytes: int
    start: float
    publish_s: float
    write_s: float
    # the trainer's (ModelConfig, ParallelismConfig), to name the tensors as its export does
    shadow: tuple
    bucket_bytes: int
    timeout_s: float
    verify: bool
    digest: str | None = None
    _digest_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # one thread gets a future
    _pulls_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def load(self, generator: Any) -> Any:
        """Have `generator` copy this version from its host's segment into its engine (a future of its report)."""
        return generator.load_segment.call_one(self.root, self.version, self.shadow, self.bucket_bytes,
                                               self.timeout_s, self.verify, self.token)

    def check(self, results: list[dict]) -> str | None:
        """Raise unless every load report is of this version and (verifying) of this version's digest."""
        with self._digest_lock:
            self.digest = check_loads(self.version, results, self.verify, self.digest)
            return self.digest

    def wait_pulls(self) -> dict[str, dict]:
        """The readers' reports, once every remote pull has landed (after which the trainer's exposed runs,
        read remotely where the slot locks cannot see them, may be overwritten)."""
        with self._pulls_lock:
            return {host: f.get() for host, f in self.pulls.items()}

    @property
    def changed(self) -> int:
        """Elements that changed in the ranks' deltas some reader applied (see TopologySyncReport); waits for
        the pulls, as the encoding runs in the background."""
        return sum(c for c, _ in self._counts().values())

    @property
    def elements(self) -> int:
        return sum(e for _, e in self._counts().values())

    def _counts(self) -> dict[int, tuple[int, int]]:
        """{trainer rank: (changed, elements)} of its delta, from every reader that applied one."""
        return {rank: c for pulled in self.wait_pulls().values() for rank, c in pulled["changed"].items()}

    def sealed(self, host: str) -> bool:
        """Whether `host` holds this version whole: True at once where the trainer ranks wrote it, after the
        host's pull elsewhere; False when that pull failed (its reader died: the version never appears there,
        and the next `publish` raises the failure)."""
        if host not in self.hosts:
            return False
        pull = self.pulls.get(host)
        if pull is None:
            return True
        with self._pulls_lock:
            try:
                pull.get()
            except Exception:
                return False
        return True


@dataclass
class PendingSync:
    """A sync whose reads are in flight; `wait()` checks and reports."""

    publication: Publication
    loads: list[Any]

    def wait(self) -> TopologySyncReport:
        pub = self.publication
        pulled = pub.wait_pulls()
        results = [f.get() for f in self.loads]
        digest = pub.check(results)
        return TopologySyncReport(
            pub.version, len(results), digest, pub.model_bytes, sum(p["bytes_remote"] for p in pulled.values()),
            pub.publish_s, time.perf_counter() - pub.start, pub.write_s,
            max((r["load_s"] for r in results), default=0.0), {h: p["pull_s"] for h, p in pulled.items()},
            {h: p["delta"] for h, p in pulled.items()}, pub.changed, pub.elements,
        )


def sync_keep(max_staleness: int) -> int:
    """Sealed versions a run's TopologySync keeps readable per host: the newest, the one a slow generator may
    still be reading, and one per step of allowed staleness (its ring holds this + 1 slots)."""
    return 2 + max_staleness


class TopologySync:
    """Weight sync for one trainer mesh and a list of generator actors, routed by their topology.

    root: shared-memory folder for the segments (one subfolder per host);
    keep: sealed versions readable per host (a ring of keep + 1 slots; >= 2 lets a slow generator finish v
    while v+1 lands; a writer waits for the readers of the slot it reuses);
    bucket_bytes: RDMA batch and HF bucket size; verify: generators report digests (sha256 of the
    weights; costs one pass over them);
    anchor_every: cross-host pulls carry deltas (`actors.weight_sync.delta`) with a full anchor every this many
    publications, on the first, and for a host whose reader is new (`replaced`); a host that does not hold a
    delta's base version gets the full runs too; 1 = always full (the trainer keeps no base copy).
    """

    def __init__(self, trainer: Any, generators: Sequence[Any], root: str = DEFAULT_ROOT, *, keep: int = 2,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: bool = True, timeout_s: float = 300.0,
                 dtype: str = "float32", anchor_every: int = 1) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {anchor_every}")
        self.anchor_every = anchor_every
        # publications by this sync: the first is an anchor
        self._publications = 0
        # hosts whose reader is new: their next pull is full
        self._anchor_hosts: set[str] = set()
        self.trainer, self.generators = trainer, list(generators)
        self.root, self.keep, self.bucket_bytes = root, keep, bucket_bytes
        self.verify, self.timeout_s = verify, timeout_s
        # the slots' dtype: the generators' serving dtype
        self.dtype = dtype
        self.topology: Topology = probe(trainer, self.generators)
        self.plan: RoutePlan = plan_routes(self.topology)
        self.shadow = next(iter(trainer.host_info.call().get().values()))["shadow"]
        # the newest version published (its pulls may be in flight)
        self.published: Publication | None = None

    def publish(self) -> Publication:
        """Snapshot the trainer's shards into every host's segment (returns once they are in host memory) and
        launch the remote pulls. Waits first for the previous publication's pulls: they read trainer-host slots
        over RDMA, where the slot locks cannot see them. A failed wait drops that publication, so a retry after
        recovery publishes."""
        if self.published is not None:
            try:
                self.published.wait_pulls()
            except Exception:
                self.published = None
                raise
        start = time.perf_counter()
        token = uuid.uuid4().hex[:12]
        parties = {h: self.plan.parties_on(h) for h in set(self.plan.source_hosts) | {r.host for r in self.plan.routes}}
        mode = self._delta_mode()
        reports = list(self.trainer.publish_shards.call(
            self.root, token, parties, self.keep, self.plan.remote_ranks, self.dtype, mode).get().values())
        self._publications += 1
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
            sources = [RemoteSource(r, by_rank[r].pieces, by_rank[r].buffers, by_rank[r].delta, by_rank[r].encoder)
                       for r in route.remote_sources]
            use_delta = mode == "delta" and route.host not in self._anchor_hosts
            pulls[route.host] = self.generators[route.reader].pull_weights.call_one(
                self.root, version_, token, reports[0].layout, sources, route.parties, self.keep, self.bucket_bytes,
                use_delta)
            self._anchor_hosts.discard(route.host)
        self.published = Publication(
            version_, token, self.root, frozenset(parties), pulls, reports[0].layout.model_bytes, start, publish_s,
            max(r.write_s for r in reports), self.shadow, self.bucket_bytes, self.timeout_s, self.verify)
        return self.published

    def _delta_mode(self) -> str:
        """What the trainer ranks pulled from other hosts do this publication (`TrainerActor.publish_shards`)."""
        # nothing crosses hosts: keep no base copy
        if self.anchor_every == 1 or not self.plan.remote_ranks:
            return "off"
        return "anchor" if self._publications % self.anchor_every == 0 else "delta"

    def start(self) -> PendingSync:
        """Snapshot the trainer's shards (returns when they are in host memory) and launch the reads."""
        pub = self.publish()
        return PendingSync(pub, [pub.load(g) for g in self.generators])

    def sync(self) -> TopologySyncReport:
        return self.start().wait()

    def replaced(self, index: int, generator: Any) -> "TopologySync":
        """This sync with generator `index` swapped for `generator` (a respawn): the plan redone with the new
        one's host (only it is probed: the others may be busy generating); the publications are kept."""
        info = generator.host_info.call_one().get()
        procs = list(self.topology.generators.procs)
        procs[index] = ProcInfo(index, info["host"], info["pid"])
        new = copy.copy(self)
        # a new reader: its host's next pull is an anchor
        new._anchor_hosts = self._anchor_hosts | {info["host"]}
        new.generators = [*self.generators[:index], generator, *self.generators[index + 1:]]
        new.topology = Topology(self.topology.trainer, MeshTopology(tuple(procs)))
        new.plan = plan_routes(new.topology)
        return new

    def host_of(self, index: int) -> str:
        return self.topology.generators.procs[index].host

    def covering(self, indices: Sequence[int]) -> Publication:
        """The newest publication, for generators `indices` (replacements) to load: the last one if their hosts
        hold it whole, else a new one (none yet, or a replacement landed on a host it did not reach)."""
        pub = self.published
        if pub is not None and all(pub.sealed(self.host_of(i)) for i in indices):
            return pub
        return self.publish()


def sync_weights_topology(trainer: Any, generators: Sequence[Any], root: str = DEFAULT_ROOT,
                          **kwargs: Any) -> TopologySyncReport:
    """Probe, plan and run one sync (build a `TopologySync` once to reuse the plan across steps)."""
    return TopologySync(trainer, generators, root, **kwargs).sync()
