"""Hosts × processes of the trainer and generator meshes, and the weight route plan between them.

`Topology` is plain data: for every process of a mesh, its rank and host
label. `probe` fills it from running actors (each answers `host_info`, whose
host label is Monarch's: the host part of `HYPERACTOR_PROCESS_NAME`, i.e. the
hostname on real hosts and the fake host's key under `monarch.job.ProcessJob`;
`actors.mesh_utils.host_label`).

`plan_routes` is pure: for each generator host it names the trainer ranks on
the same host (they write their shards straight into the host's segment) and
the trainer ranks elsewhere, whose shards one reader process on the host pulls
(RDMA) into the same segment, after which every generator on the host reads it
locally. Each byte therefore crosses into a host at most once, however many
generators the host runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class ProcInfo:
    """One process of a mesh: its rank in the mesh (the process-group rank for the trainer) and host."""

    rank: int
    host: str
    pid: int = 0


@dataclass(frozen=True)
class MeshTopology:
    procs: tuple[ProcInfo, ...]

    @property
    def hosts(self) -> tuple[str, ...]:
        """Distinct hosts in first-rank order."""
        return tuple(dict.fromkeys(p.host for p in sorted(self.procs, key=lambda p: p.rank)))

    def ranks_on(self, host: str) -> tuple[int, ...]:
        return tuple(sorted(p.rank for p in self.procs if p.host == host))

    @property
    def shape(self) -> dict[str, int]:
        """{host: processes on it}."""
        return {h: len(self.ranks_on(h)) for h in self.hosts}


@dataclass(frozen=True)
class Topology:
    trainer: MeshTopology
    generators: MeshTopology


@dataclass(frozen=True)
class HostRoute:
    """How one generator host receives the weights.

    local_sources: trainer ranks on this host (write their shards into its segment);
    remote_sources: trainer ranks on other hosts (their shards are pulled by `reader`);
    reader: the generator rank that pulls, or None when every source is local;
    generators: the generator ranks reading this host's segment.
    """

    host: str
    local_sources: tuple[int, ...]
    remote_sources: tuple[int, ...]
    reader: int | None
    generators: tuple[int, ...]

    @property
    def parties(self) -> int:
        """Writers of the segment: the local trainer ranks and the reader (the last one seals)."""
        return len(self.local_sources) + (1 if self.reader is not None else 0)


@dataclass(frozen=True)
class RoutePlan:
    routes: tuple[HostRoute, ...]
    # trainer host -> its ranks (every rank writes its own host's segment)
    source_hosts: dict[str, tuple[int, ...]]

    def route_of(self, host: str) -> HostRoute | None:
        return next((r for r in self.routes if r.host == host), None)

    def parties_on(self, host: str) -> int:
        """Writers of `host`'s segment (a trainer-only host: its trainer ranks, sealed for RDMA sources)."""
        route = self.route_of(host)
        return route.parties if route is not None else len(self.source_hosts[host])

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """Trainer ranks whose shards some host pulls (they expose RDMA buffers)."""
        return tuple(sorted({r for route in self.routes for r in route.remote_sources}))

    def cross_host_bytes(self, bytes_by_rank: dict[int, int]) -> int:
        """Bytes entering generator hosts from other hosts, given the bytes each trainer rank owns."""
        return sum(bytes_by_rank[r] for route in self.routes for r in route.remote_sources)


def plan_routes(topology: Topology) -> RoutePlan:
    """One route per generator host: local trainer ranks write, one reader pulls the rest, everyone reads locally."""
    if not topology.trainer.procs or not topology.generators.procs:
        raise ValueError("a route plan needs at least one trainer and one generator process")
    sources = {h: topology.trainer.ranks_on(h) for h in topology.trainer.hosts}
    routes = []
    for host in topology.generators.hosts:
        gens = topology.generators.ranks_on(host)
        local = sources.get(host, ())
        remote = tuple(sorted(r for h, ranks in sources.items() if h != host for r in ranks))
        routes.append(HostRoute(host, local, remote, gens[0] if remote else None, gens))
    return RoutePlan(tuple(routes), sources)


def probe(trainer: Any, generators: Sequence[Any]) -> Topology:
    """The topology of running actors: the trainer mesh (process-group ranks) and the generator list
    (rank = index in the list, as the controller addresses them); each answers `host_info()`."""
    infos = list(trainer.host_info.call().get().values())
    trainer_topo = MeshTopology(tuple(sorted((ProcInfo(i["rank"], i["host"], i["pid"]) for i in infos),
                                             key=lambda p: p.rank)))
    futures = [g.host_info.call_one() for g in generators]
    gens = tuple(ProcInfo(i, info["host"], info["pid"]) for i, info in enumerate(f.get() for f in futures))
    return Topology(trainer_topo, MeshTopology(gens))
