"""Route plans from topology descriptions (pure), and Monarch's host labels.

Independent reference: for every plan, a brute-force simulation moves each
trainer rank's bytes along the plan and checks that every generator ends up
with every rank's bytes, that bytes enter a host only from the routes'
remote sources, and that the count equals model bytes × hosts without a
trainer rank.
"""

from __future__ import annotations

import pytest

from composer_mesh.actors.weight_sync.routes import MeshTopology, ProcInfo, Topology, plan_routes


def topo(trainer: dict[str, int], generators: dict[str, int]) -> Topology:
    def mesh(shape: dict[str, int]) -> MeshTopology:
        procs, rank = [], 0
        for host, n in shape.items():
            for _ in range(n):
                procs.append(ProcInfo(rank, host))
                rank += 1
        return MeshTopology(tuple(procs))

    return Topology(mesh(trainer), mesh(generators))


def simulate(t: Topology, bytes_by_rank: dict[int, int]) -> tuple[dict[int, set[int]], int]:
    """Follow the plan: which trainer ranks' bytes each generator holds, and bytes that crossed hosts."""
    plan = plan_routes(t)
    host_of_rank = {p.rank: p.host for p in t.trainer.procs}
    held, crossed = {}, 0
    for route in plan.routes:
        segment = set()
        for r in route.local_sources:
            assert host_of_rank[r] == route.host
            segment.add(r)
        for r in route.remote_sources:
            assert host_of_rank[r] != route.host and route.reader in route.generators
            segment.add(r)
            crossed += bytes_by_rank[r]
        for g in route.generators:
            held[g] = set(segment)
    return held, crossed


@pytest.mark.parametrize("trainer, generators", [
    ({"a": 2}, {"a": 2}),  # one host
    # disaggregated, one generator host
    ({"a": 2}, {"b": 2}),
    # mixed, as the fake-host mesh test
    ({"a": 2}, {"a": 1, "b": 3, "c": 1}),
    ({"a": 4, "b": 4}, {"a": 2, "c": 2, "d": 8}),  # trainer over two hosts
    ({"a": 1, "b": 1, "c": 1}, {"b": 1, "c": 2}),
])
def test_plan_delivers_everything_and_crosses_each_host_once(trainer, generators):
    t = topo(trainer, generators)
    world = sum(trainer.values())
    bytes_by_rank = {r: 1000 + 7 * r for r in range(world)}
    model = sum(bytes_by_rank.values())
    held, crossed = simulate(t, bytes_by_rank)
    assert held == {g: set(range(world)) for g in range(sum(generators.values()))}
    # a host without trainer ranks receives the model once; a host with some receives the rest once
    expected = sum(model - sum(bytes_by_rank[p.rank] for p in t.trainer.procs if p.host == h)
                   for h in generators)
    plan = plan_routes(t)
    assert crossed == expected == plan.cross_host_bytes(bytes_by_rank)
    for route in plan.routes:
        assert route.parties == len(route.local_sources) + (route.reader is not None)
        assert (route.reader is None) == (not route.remote_sources)
        if route.reader is not None:
            # one reader per destination host
            assert route.reader == min(route.generators)
    assert plan.remote_ranks == tuple(sorted({r for route in plan.routes for r in route.remote_sources}))
    # a trainer-only host seals with its own ranks
    for host, ranks in plan.source_hosts.items():
        if plan.route_of(host) is None:
            assert plan.parties_on(host) == len(ranks)


def test_disaggregated_hosts_receive_model_bytes_times_hosts():
    t = topo({"t0": 2}, {"g0": 2, "g1": 2, "g2": 1})
    plan = plan_routes(t)
    assert plan.cross_host_bytes({0: 600, 1: 400}) == 1000 * 3
    assert [r.reader for r in plan.routes] == [0, 2, 4]
    assert t.generators.shape == {"g0": 2, "g1": 2, "g2": 1} and t.generators.hosts == ("g0", "g1", "g2")


def test_empty_meshes_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        plan_routes(Topology(MeshTopology(()), MeshTopology((ProcInfo(0, "a"),))))


def test_host_label_is_monarchs_host_part(monkeypatch):
    import socket

    from composer_mesh.actors.mesh_utils import host_label
    from composer_mesh.actors.weight_sync.segment import host_dir

    monkeypatch.setenv("HYPERACTOR_PROCESS_NAME", "anon-0 @ generator_1")
    assert host_label() == "generator_1"
    monkeypatch.setenv("HYPERACTOR_PROCESS_NAME", "anon-3 @ node-17.cluster")
    assert host_label() == "node-17.cluster"
    monkeypatch.delenv("HYPERACTOR_PROCESS_NAME")
    assert host_label() == socket.gethostname()
    assert host_dir("/r", "../evil host").name == ".._evil_host"  # one folder, no traversal
