"""Topology-aware weight sync on real meshes: FSDP trainer (2 gloo ranks) → 4 generators on 3 fake hosts.

Digests are checked against the trainer's own collective export
(`TrainerActor.weights_digest`, the baseline's independent path): after every
sync, while the next training step runs, and on two fake hosts of a Monarch
`ProcessJob`, where the readers' counted RDMA bytes must equal model bytes ×
destination hosts. The version barrier is proved with real processes: readers
sleep mid-read while a writer publishes newer versions (and prunes theirs).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from actors.shm_weights import PinnedSegment, SegmentLayout, SegmentWriter, segment_path

VOCAB = 2048
VERSIONS = 12


# ---- version barrier: real writer and reader processes ---------------------------------------------

def _layout(n: int = 6, rows: int = 256) -> SegmentLayout:
    model = torch.nn.Module()
    for i in range(n):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(rows, 1024)))  # 1 MiB each
    return SegmentLayout.from_model(model)


def _publish(root: str, version: int, layout: SegmentLayout, keep: int) -> None:
    """Two parties (as two trainer ranks would) each fill half the rows of every tensor with `version`."""
    writers = [SegmentWriter(root, "h", version, f"t{version}", layout) for _ in range(2)]
    for part, w in enumerate(writers):
        for _, full in w.views():
            half = full.shape[0] // 2
            full[part * half : (part + 1) * half].fill_(float(version))
    assert [w.done(2, keep) for w in writers] == [False, True]


def _writer_proc(root: str, versions: int) -> None:
    layout = _layout()
    for v in range(2, versions + 1):
        _publish(root, v, layout, keep=1)  # keep=1: the version a reader holds is unlinked under it


def _reader_proc(root: str, seen: "mp.Queue") -> None:
    """Open the newest version, read half, sleep, read the rest: every value must be that version."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        published = sorted(segment_path(root, "h", 0).parent.glob("v*.seg"))
        if not published:
            time.sleep(0.01)
            continue
        version = int(published[-1].stem[1:])
        try:
            seg = PinnedSegment(published[-1], version)
        except FileNotFoundError:  # pruned between glob and open: not a torn read, just late
            time.sleep(0.01)
            continue
        values = []
        for i, (_, t) in enumerate(seg.tensors()):
            values.append(torch.unique(t.clone()).tolist())
            if i == 2:
                time.sleep(0.05)  # the writer publishes newer versions meanwhile
        seg.verify()
        seen.put((version, values))
        if version >= VERSIONS:
            return


def test_version_barrier_delayed_readers_never_see_torn_versions(tmp_path):
    root = str(tmp_path)
    layout = _layout()
    _publish(root, 1, layout, keep=1)
    pinned = PinnedSegment.open(root, "h", 1)
    first = [t.clone() for _, t in list(pinned.tensors())[:3]]

    ctx = mp.get_context("forkserver")  # real processes; torch imported once by the server, not per child
    ctx.set_forkserver_preload(["torch", "actors.shm_weights"])
    seen: "mp.Queue" = ctx.Queue()
    readers = [ctx.Process(target=_reader_proc, args=(root, seen)) for _ in range(2)]
    writer = ctx.Process(target=_writer_proc, args=(root, VERSIONS))
    for p in readers + [writer]:
        p.start()
    writer.join(60)
    for p in readers:
        p.join(60)
    assert writer.exitcode == 0 and all(p.exitcode == 0 for p in readers)
    reads = []
    while not seen.empty():
        reads.append(seen.get())
    assert len(reads) >= 2
    for version, values in reads:
        assert values == [[float(version)]] * len(layout.slots)  # whole and single-version
    assert len({v for v, _ in reads}) >= 2  # the readers overlapped several publishes

    # the reader pinned v1 before the writer published v2..v{VERSIONS} and unlinked v1: it still reads v1 whole
    assert not segment_path(root, "h", 1).exists()
    rest = [t.clone() for _, t in list(pinned.tensors())[3:]]
    pinned.verify()
    assert all(torch.equal(t, torch.full_like(t, 1.0)) for t in first + rest)
    with pytest.raises(FileNotFoundError, match="not published"):
        PinnedSegment.open(root, "h", 1)
    assert sorted(p.name for p in segment_path(root, "h", 0).parent.iterdir()) == [f"v{VERSIONS:010d}.seg"]


def test_unsealed_segment_is_invisible_and_bad_input_is_refused(tmp_path):
    layout = _layout(2)
    w = SegmentWriter(tmp_path, "h", 5, "tok", layout)
    with pytest.raises(FileNotFoundError, match="not published"):
        PinnedSegment.open(tmp_path, "h", 5, timeout_s=0.05)
    assert w.done(2, keep=2) is False  # one of two parties: still unpublished
    assert not segment_path(tmp_path, "h", 5).exists()
    with pytest.raises(ValueError, match="parties"):
        w.done(0, keep=2)
    stale = SegmentWriter(tmp_path, "h", 4, "crashed", layout)  # a sync of v4 that never sealed
    assert stale.path.exists()
    assert w.done(2, keep=2) is True
    assert not stale.path.exists()  # cleaned up once a newer version is published
    assert sorted(p.name for p in segment_path(tmp_path, "h", 0).parent.iterdir()) == ["v0000000005.seg"]
    seg = PinnedSegment.open(tmp_path, "h", 5)
    assert [n for n, _ in seg.tensors()] == ["w0", "w1"] and seg.layout == layout
    with pytest.raises(RuntimeError, match="expected v6"):
        PinnedSegment(segment_path(tmp_path, "h", 5), 6)  # a file under another version's name


# ---- fake hosts: FSDP trainer (2 procs) + 2 generators on host A, one generator on each of hosts B, C ----

@pytest.fixture(scope="module")
def generator_spec(tiny_assets):
    from actors.generator import GeneratorSpec
    from configs.sections.generator import GeneratorConfig

    return GeneratorSpec(model_dir=str(tiny_assets.dense_dir), generator=GeneratorConfig(engine="hf"))


@pytest.fixture(scope="module")
def meshes(tiny_trainer_spec, generator_spec, tmp_path_factory):
    """Monarch `ProcessJob` fake hosts: "trainer_0" runs the trainer mesh and two generator processes
    (same-host fan-out); "generator_0" and "generator_1" run one generator each (cross-host reads)."""
    from monarch.job import ProcessJob
    from monarch.spmd import setup_torch_elastic_env

    from actors.generator import GeneratorActor
    from actors.trainer import TrainerActor

    out = tmp_path_factory.mktemp("wsync")
    spec = tiny_trainer_spec(out / "ckpt")
    job = ProcessJob({"trainer": 1, "generator": 2})
    try:
        state = job.state(cached_path=None)
        trainer_procs = state.trainer.spawn_procs(per_host={"gpus": 2})
        setup_torch_elastic_env(trainer_procs)
        trainer = trainer_procs.spawn("trainer", TrainerActor, spec)
        local = state.trainer.spawn_procs(per_host={"gpus": 2}).spawn("generator", GeneratorActor, generator_spec)
        remote = state.generator.spawn_procs(per_host={"gpus": 1}).spawn("generator", GeneratorActor, generator_spec)
        trainer.setup.call().get()
        gens = [m.slice(**point) for m in (local, remote) for point, _ in m.info.call().get().items()]
        yield trainer, gens
    finally:
        job.kill()


def _batch(seed: int):
    from titan_ext.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    n, s = 5, 16  # 5 rows over 2 ranks: the shard pads, as TrainBatch.shard does on the ranks
    tokens = torch.randint(3, VOCAB, (n, s), generator=g)
    labels = torch.full((n, s), -100)
    labels[:, 3:-1] = tokens[:, 4:]
    mask = labels >= 0
    return TrainBatch(
        tokens_BL=tokens, positions_BL=torch.arange(s).expand(n, s).clone(), labels_BL=labels, policy_mask_BL=mask,
        advantages_BL=torch.randn(n, 1, generator=g).expand(n, s).clone(),
        generator_logprobs_BL=torch.full((n, s), -2.0) * mask, policy_tokens=int(mask.sum()),
    )


def test_sync_matches_trainer_digest_while_next_step_runs(meshes, tmp_path):
    from mesh.weight_sync import TopologySync
    from mesh.weight_sync_baseline import rank0

    trainer, gens = meshes
    sync = TopologySync(trainer, gens, str(tmp_path), keep=2)
    assert sync.topology.trainer.shape == {"trainer_0": 2}
    assert sync.topology.generators.shape == {"trainer_0": 2, "generator_0": 1, "generator_1": 1}
    routes = {r.host: r for r in sync.plan.routes}
    assert (routes["trainer_0"].local_sources, routes["trainer_0"].reader) == ((0, 1), None)
    assert routes["trainer_0"].generators == (0, 1)  # fan-out: two generators read one segment
    for host, g in (("generator_0", 2), ("generator_1", 3)):
        assert (routes[host].local_sources, routes[host].remote_sources, routes[host].reader) == ((), (0, 1), g)

    trainer.train_step.call(_batch(1)).get()
    digest1 = rank0(trainer.weights_digest.call().get())
    pending = sync.start()  # shards are in host memory now
    step = trainer.train_step.call(_batch(2))  # the next step runs while generators read v1
    report = pending.wait()
    metrics = rank0(step.get())
    assert report.version == 1 and metrics["step"] == 2.0
    assert report.digest == digest1 and report.generators == 4
    assert {g.policy_version.call_one().get() for g in gens} == {1}
    assert {g.weights_digest.call_one().get() for g in gens} == {digest1}
    # counted by the readers' transfer layer: one full copy into each of the two generator-only hosts
    assert report.cross_host_bytes == report.model_bytes * 2 > 0
    assert set(report.pull_s) == {"generator_0", "generator_1"}

    digest2 = rank0(trainer.weights_digest.call().get())
    assert digest2 != digest1
    report2 = sync.sync()
    assert (report2.version, report2.digest, report2.cross_host_bytes) == (2, digest2, report.cross_host_bytes)
    assert {g.weights_digest.call_one().get() for g in gens} == {digest2}
    for host in routes:  # every host keeps the newest `keep` versions
        assert sorted(p.name for p in segment_path(tmp_path, host, 0).parent.glob("v*.seg")) == [
            "v0000000001.seg", "v0000000002.seg"]


def test_rollout_exchange_sends_each_rank_only_its_shard(meshes):
    """Sharded on the controller == sliced on every rank: same metrics, bit-identical weights."""
    from mesh.rollout_exchange import shard_points, train_step_sharded
    from mesh.weight_sync_baseline import rank0

    trainer, _ = meshes
    step = int(rank0(trainer.policy_version.call().get()))
    trainer.save_checkpoint.call().get()
    batch = _batch(7)
    broadcast = rank0(trainer.train_step.call(batch).get())
    digest_broadcast = rank0(trainer.weights_digest.call().get())
    assert set(trainer.load_checkpoint.call(step).get().values()) == {step}
    sharded = train_step_sharded(trainer, batch)
    assert rank0(trainer.weights_digest.call().get()) == digest_broadcast
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    assert strip(sharded) == strip(broadcast)
    points = shard_points(trainer)
    assert sorted(r for _, r, _ in points) == [0, 1] and {w for _, _, w in points} == {2}
    assert batch.shard(0, 2).tokens_BL.shape[0] == 3  # each rank gets 3 of 5 (padded) rows, not 5
