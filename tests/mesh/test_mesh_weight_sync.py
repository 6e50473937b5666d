"""Topology-aware weight sync on real meshes: FSDP trainer (2 gloo ranks) → 4 generators on 3 fake hosts.

Digests are checked against the trainer's own collective export
(`TrainerActor.weights_digest`, the baseline's independent path): after every
sync, while the next training step runs, and on two fake hosts of a Monarch
`ProcessJob`, where the readers' counted RDMA bytes must equal model bytes ×
destination hosts. The pieces the controller uses one generator at a time
(publish, then each generator loads when it is ready; a respawn re-plans and
loads only the replacement) are checked on the same hosts. The version barrier
is proved with real processes: readers sleep mid-read while a writer publishes
newer versions into the reused slots.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from composer_mesh.actors.weight_sync.reader import PinnedSegment, newest_version
from composer_mesh.actors.weight_sync.segment import SegmentLayout, host_dir
from composer_mesh.actors.weight_sync.writer import SegmentWriter
from composer_mesh.titan_ext.batch import TrainBatch

VOCAB = 2048  # the tiny model's vocabulary
VERSIONS = 12


# ---- version barrier: real writer and reader processes ---------------------------------------------

def _layout(n: int = 6, rows: int = 256) -> SegmentLayout:
    model = torch.nn.Module()
    for i in range(n):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(rows, 1024)))  # 1 MiB each
    return SegmentLayout.from_model(model)


def _publish(root: str, version: int, layout: SegmentLayout, keep: int) -> None:
    """Two parties (as two trainer ranks would) each fill half the rows of every tensor with `version`."""
    writers = [SegmentWriter(root, "h", version, f"t{version}", layout, keep) for _ in range(2)]
    for part, w in enumerate(writers):
        for _, full in w.views():
            half = full.shape[0] // 2
            full[part * half : (part + 1) * half].fill_(float(version))
    assert [w.done(2) for w in writers] == [False, True]


def _writer_proc(root: str, versions: int) -> None:
    layout = _layout()
    for v in range(2, versions + 1):
        # keep=1: two slots, each reused every other version
        _publish(root, v, layout, keep=1)


def _reader_proc(root: str, seen: "mp.Queue") -> None:
    """Pin the newest version, read half, sleep, read the rest: every value must be that version."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        version = newest_version(root, "h")
        try:
            seg = PinnedSegment.open(root, "h", version)
        except FileNotFoundError:
            # its slot was reused between the two calls: not a torn read, just late
            continue
        with seg:
            values = []
            for i, (_, t) in enumerate(seg.tensors()):
                values.append(torch.unique(t.clone()).tolist())
                if i == 2:
                    # the writer publishes newer versions meanwhile
                    time.sleep(0.05)
            seg.verify()
        seen.put((version, values))
        if version >= VERSIONS:
            return


def test_version_barrier_delayed_readers_never_see_torn_versions(tmp_path):
    root = str(tmp_path)
    layout = _layout()
    _publish(root, 1, layout, keep=1)
    # held by this process: v3 needs its slot
    pinned = PinnedSegment.open(root, "h", 1)
    first = [t.clone() for _, t in list(pinned.tensors())[:3]]

    # real processes; torch imported once by the server, not per child
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "composer_mesh.actors.weight_sync.reader", "composer_mesh.actors.weight_sync.writer"])
    seen: "mp.Queue" = ctx.Queue()
    writer = ctx.Process(target=_writer_proc, args=(root, VERSIONS))
    readers = [ctx.Process(target=_reader_proc, args=(root, seen)) for _ in range(2)]
    for p in [writer, *readers]:
        p.start()
    deadline = time.monotonic() + 30
    while newest_version(root, "h") != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    # the writer sealed v2 into the free slot, then waits for this reader to let go of v1's slot
    assert newest_version(root, "h") == 2 and writer.is_alive()
    rest = [t.clone() for _, t in list(pinned.tensors())[3:]]
    pinned.verify()
    assert all(torch.equal(t, torch.full_like(t, 1.0)) for t in first + rest)
    pinned.release()
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
    # the readers overlapped several publishes
    assert len({v for v, _ in reads}) >= 2
    with pytest.raises(FileNotFoundError, match="not published"):
        # its slot now holds a newer version
        PinnedSegment.open(root, "h", 1)
    assert sorted(p.name for p in host_dir(root, "h").glob("*.seg")) == ["slot000.seg", "slot001.seg"]


def test_unsealed_segment_is_invisible_and_bad_input_is_refused(tmp_path):
    layout = _layout(2)
    w = SegmentWriter(tmp_path, "h", 5, "tok", layout, keep=2)
    with pytest.raises(FileNotFoundError, match="not published"):
        PinnedSegment.open(tmp_path, "h", 5, timeout_s=0.05)
    # a second party of the same sync
    w2 = SegmentWriter(tmp_path, "h", 5, "tok", layout, keep=2)
    # one of two parties: still unpublished
    assert w.done(2) is False
    assert newest_version(tmp_path, "h") is None
    with pytest.raises(ValueError, match="parties"):
        w2.done(0)
    assert w2.done(2) is True
    with pytest.raises(ValueError, match="keep"):
        SegmentWriter(tmp_path, "h", 6, "tok6", layout, keep=0)
    with pytest.raises(ValueError, match="token"):
        SegmentWriter(tmp_path, "h", 6, "x" * 17, layout, keep=2)

    # a sync of v7 that never sealed
    crashed = SegmentWriter(tmp_path, "h", 7, "crashed", layout, keep=2)
    crashed.release()
    assert newest_version(tmp_path, "h") == 5
    seg = PinnedSegment.open(tmp_path, "h", 5, token="tok")
    assert [n for n, _ in seg.tensors()] == ["w0", "w1"] and seg.layout == layout
    with pytest.raises(FileNotFoundError, match="not published"):
        # same version, another sync (a restarted trainer)
        PinnedSegment.open(tmp_path, "h", 5, token="other")
    with pytest.raises(FileNotFoundError, match="not published"):
        PinnedSegment.open(tmp_path, "h", 6)

    # v8 reuses v5's slot (keep=2: three slots): it waits for the reader, and says so when it gives up
    with pytest.raises(TimeoutError, match="older version"):
        SegmentWriter(tmp_path, "h", 8, "t8", layout, keep=2, timeout_s=0.1)
    # the refused writer left v5 untouched
    seg.verify()
    seg.release()
    with pytest.raises(RuntimeError, match="released"):
        seg.verify()
    with SegmentWriter(tmp_path, "h", 8, "t8", layout, keep=2, timeout_s=0.1) as w8:
        assert w8.done(1) is True
    assert newest_version(tmp_path, "h") == 8
    with pytest.raises(FileNotFoundError, match="not published"):
        PinnedSegment.open(tmp_path, "h", 5)


# ---- fake hosts: FSDP trainer (2 procs) + 2 generators on host A, one generator on each of hosts B, C ----

@pytest.fixture(scope="module")
def meshes(tiny_trainer_spec, make_generator_spec, tmp_path_factory):
    """Monarch `ProcessJob` fake hosts: "trainer_0" runs the trainer mesh and two generator processes
    (same-host fan-out); "generator_0" and "generator_1" run one generator each (cross-host reads)."""
    from monarch.job import ProcessJob
    from composer_mesh.actors.elastic import setup_elastic_env

    from composer_mesh.actors.generator import GeneratorActor
    from composer_mesh.actors.trainer import TrainerActor

    out = tmp_path_factory.mktemp("wsync")
    spec = tiny_trainer_spec(out / "ckpt")
    generator_spec = make_generator_spec()
    job = ProcessJob({"trainer": 1, "generator": 2})
    try:
        state = job.state(cached_path=None)
        trainer_procs = state.trainer.spawn_procs(per_host={"gpus": 2})
        setup_elastic_env(trainer_procs)
        trainer = trainer_procs.spawn("trainer", TrainerActor, spec)
        local = state.trainer.spawn_procs(per_host={"gpus": 2}).spawn("generator", GeneratorActor, generator_spec)
        remote = state.generator.spawn_procs(per_host={"gpus": 1}).spawn("generator", GeneratorActor, generator_spec)
        trainer.setup.call().get()
        gens = [m.slice(**point) for m in (local, remote) for point, _ in m.info.call().get().items()]
        yield trainer, gens
    finally:
        job.kill()


@pytest.mark.slow
def test_sync_matches_trainer_digest_while_next_step_runs(meshes, tmp_path):
    from composer_mesh.actors.mesh_utils import rank0
    from composer_mesh.actors.weight_sync.sync import TopologySync

    trainer, gens = meshes
    sync = TopologySync(trainer, gens, str(tmp_path), keep=2)
    assert sync.topology.trainer.shape == {"trainer_0": 2}
    assert sync.topology.generators.shape == {"trainer_0": 2, "generator_0": 1, "generator_1": 1}
    routes = {r.host: r for r in sync.plan.routes}
    assert (routes["trainer_0"].local_sources, routes["trainer_0"].reader) == ((0, 1), None)
    # fan-out: two generators read one segment
    assert routes["trainer_0"].generators == (0, 1)
    for host, g in (("generator_0", 2), ("generator_1", 3)):
        assert (routes[host].local_sources, routes[host].remote_sources, routes[host].reader) == ((), (0, 1), g)

    trainer.train_step.call(TrainBatch.synthetic(1, VOCAB)).get()
    digest1 = rank0(trainer.weights_digest.call().get())
    pending = sync.start()  # shards are in host memory now
    # the next step runs while generators read v1
    step = trainer.train_step.call(TrainBatch.synthetic(2, VOCAB))
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
    # every host holds v1 and v2 in two of its keep + 1 slots
    for host in routes:
        assert newest_version(tmp_path, host) == 2
        assert sorted(p.name for p in host_dir(tmp_path, host).glob("*.seg")) == ["slot001.seg", "slot002.seg"]


@pytest.mark.slow
def test_serving_dtype_slots_halve_the_bytes_and_load_the_rounded_weights(meshes, tmp_path):
    """bf16 slots (`[generator] dtype`): each byte that crosses a host or sits in /dev/shm is half the fp32
    one, and every generator holds exactly the trainer's export rounded to bf16, not anything else."""
    from composer_mesh.actors.mesh_utils import rank0
    from composer_mesh.actors.weight_sync.sync import TopologySync

    trainer, gens = meshes
    trainer.train_step.call(TrainBatch.synthetic(4, VOCAB)).get()
    fp32 = TopologySync(trainer, gens, str(tmp_path / "fp32"), keep=1).sync()
    bf16 = TopologySync(trainer, gens, str(tmp_path / "bf16"), keep=1, dtype="bfloat16").sync()
    assert bf16.version == fp32.version and bf16.model_bytes * 2 == fp32.model_bytes
    assert bf16.cross_host_bytes * 2 == fp32.cross_host_bytes > 0
    rounded = rank0(trainer.weights_digest.call("bfloat16").get())
    assert {g.weights_digest.call_one(dtype="bfloat16").get() for g in gens} == {rounded}
    # the fp32 engines hold rounded values
    assert {g.weights_digest.call_one().get() for g in gens} != {fp32.digest}
    slot = next(host_dir(tmp_path / "bf16", "generator_0").glob("*.seg")).stat().st_size
    assert slot < next(host_dir(tmp_path / "fp32", "generator_0").glob("*.seg")).stat().st_size * 0.51 + 8192


@pytest.mark.slow
def test_publish_then_load_one_generator_at_a_time(meshes, tmp_path):
    """What the controller's async workers and respawns do: publish once, then a generator loads alone once its
    host holds the version whole, checked against the first load's digest; a generator respawned on a host the
    last publication did not reach gets a new one."""
    from composer_mesh.actors.mesh_utils import rank0
    from composer_mesh.actors.weight_sync.sync import TopologySync

    trainer, gens = meshes
    trainer.train_step.call(TrainBatch.synthetic(3, VOCAB)).get()
    digest = rank0(trainer.weights_digest.call().get())
    sync = TopologySync(trainer, gens[:3], str(tmp_path), keep=2)  # nobody on host generator_1 yet
    first = sync.publish()
    assert first.hosts == {"trainer_0", "generator_0"} and set(first.pulls) == {"generator_0"}
    assert first.sealed("generator_0") and not first.sealed("generator_1")
    # read from the segment its host pulled
    assert first.check([first.load(gens[2]).get()]) == digest
    with pytest.raises(RuntimeError, match="2 distinct digests"):
        first.check([{"version": first.version, "digest": "0" * 64}])
    with pytest.raises(RuntimeError, match=r"wrong version \[0\]"):
        first.check([{"version": first.version - 1, "digest": digest}])

    # generator 2 respawned on host generator_1
    moved = sync.replaced(2, gens[3])
    assert moved.published is first and moved.plan.route_of("generator_1").reader == 2
    assert moved.plan.route_of("generator_0") is None and moved.covering([0]) is first
    # its host holds no segment: published again, by the new plan
    again = moved.covering([2])
    assert again is not first and again.version == first.version and set(again.pulls) == {"generator_1"}
    assert again.sealed("generator_1") and again.check([again.load(gens[3]).get()]) == digest
    versions = [g.policy_version.call_one().get() for g in gens]
    # the others untouched
    assert versions[2] == versions[3] == first.version and versions[0] < first.version


@pytest.mark.slow
def test_rollout_exchange_sends_each_rank_only_its_shard(meshes):
    """Sharded on the controller == sliced on every rank: same metrics, bit-identical weights."""
    from composer_mesh.actors.mesh_utils import rank0
    from composer_mesh.mesh.rollout_exchange import shard_points, train_step_sharded

    trainer, _ = meshes
    step = int(rank0(trainer.policy_version.call().get()))
    trainer.save_checkpoint.call().get()
    batch = TrainBatch.synthetic(7, VOCAB)
    broadcast = rank0(trainer.train_step.call(batch).get())
    digest_broadcast = rank0(trainer.weights_digest.call().get())
    assert set(trainer.load_checkpoint.call(step).get().values()) == {step}
    sharded = train_step_sharded(trainer, batch)
    assert rank0(trainer.weights_digest.call().get()) == digest_broadcast
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    assert strip(sharded) == strip(broadcast)
    points = shard_points(trainer)
    assert sorted(r for _, r, _ in points) == [0, 1] and {w for _, _, w in points} == {2}
    # each rank gets 3 of 5 (padded) rows, not 5
    assert batch.shard(0, 2).tokens_BL.shape[0] == 3


def test_failed_pull_fails_waiting_loads_in_seconds(tmp_path):
    """A pull that fails (here: a trainer rank's buffers do not match its runs) marks its version as not coming,
    so a load waiting on that host raises within moments naming the cause instead of after `timeout_s`."""
    import threading

    from composer_mesh.actors.weight_sync.pull import RemoteSource, pull_pieces
    from composer_mesh.actors.weight_sync.segment import Piece

    root, layout = str(tmp_path), _layout(n=2, rows=4)
    outcome: dict = {}

    def load() -> None:
        start = time.monotonic()
        try:
            PinnedSegment.open(root, "h", 3, "tok3", timeout_s=120)
        except Exception as exc:
            # noqa: BLE001 — the test inspects it
            outcome["error"] = exc
        outcome["waited_s"] = time.monotonic() - start

    waiting = threading.Thread(target=load)
    waiting.start()
    # the load is waiting for v3 when the pull fails
    time.sleep(0.3)
    bad = RemoteSource(rank=1, pieces=[Piece(0, 64), Piece(64, 64)], buffers=[object()])
    with pytest.raises(ValueError, match="exposed 1 buffers for 2 runs"):
        pull_pieces(root, "h", 3, "tok3", layout, [bad], parties=1, keep=2, bucket_bytes=1 << 20)
    waiting.join(timeout=30)
    assert not waiting.is_alive()
    assert isinstance(outcome["error"], RuntimeError) and "exposed 1 buffers" in str(outcome["error"])
    assert outcome["waited_s"] < 5, f"the waiting load noticed the failed pull after {outcome['waited_s']:.1f} s"
    # another sync's token is not affected: it waits out its timeout
    with pytest.raises(FileNotFoundError):
        PinnedSegment.open(root, "h", 3, "other", timeout_s=0.05)


PULLER = """
import sys, time
from composer_mesh.actors.weight_sync.pull_status import pulling
from composer_mesh.actors.weight_sync.segment import SegmentLayout
from composer_mesh.actors.weight_sync.writer import SegmentWriter
root, layout = sys.argv[1], SegmentLayout.from_json(sys.argv[2].encode())
with pulling(root, "h", 3, "tok3"), SegmentWriter(root, "h", 3, "tok3", layout, keep=2) as writer:
    writer.payload[:64].fill_(7)  # part of the version written, then the process hangs in its pull
    print("pulling", flush=True)
    time.sleep(120)
"""


def test_puller_killed_mid_pull_fails_waiting_loads_in_seconds(tmp_path):
    """The host's reader is SIGKILLed (as by the OOM killer) in the middle of a pull: it can neither seal nor mark
    the version failed, but the pid it left while pulling is gone, so a load waiting for that version raises
    within moments naming the dead process (not after `timeout_s`), and the slot is free for the next sync."""
    import signal
    import subprocess
    import sys
    import threading

    root, layout = str(tmp_path), _layout(n=2, rows=4)
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen([sys.executable, "-c", PULLER, root, layout.to_json().decode()], cwd=repo,
                             env=dict(os.environ, PYTHONPATH=str(repo)), stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "pulling"
        outcome: dict = {}

        def load() -> None:
            try:
                PinnedSegment.open(root, "h", 3, "tok3", timeout_s=120)
            except Exception as exc:
                # noqa: BLE001 — the test inspects it
                outcome["error"] = exc
            outcome["done"] = time.monotonic()

        waiting = threading.Thread(target=load)
        waiting.start()
        time.sleep(0.3)  # the load is waiting for v3
        killed = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        waiting.join(timeout=30)
        assert not waiting.is_alive()
        waited = outcome["done"] - killed
        assert isinstance(outcome["error"], RuntimeError) and f"pid {child.pid}" in str(outcome["error"])
        assert waited < 5, f"the waiting load noticed the dead puller {waited:.1f} s after its SIGKILL"
        print(f"dead puller noticed {waited:.2f} s after its SIGKILL")
        # v6 reuses v3's slot: not held
        with SegmentWriter(root, "h", 6, "tok6", layout, keep=2, timeout_s=5):
            pass
    finally:
        if child.poll() is None:
            child.kill()
