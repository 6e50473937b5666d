"""Weight-sync throughput on one host: FSDP trainer on 2 procs → 2 generator procs.

Model: a synthetic Qwen3 flavour big enough that copying dominates (default
dim 1024, 6 layers, FFN 2816: 72 M fp32 parameters, 288 MB). Every figure is
bytes delivered to generators (model bytes × 2) per second of wall time,
median over the repetitions, all measured in this run:

- topology: `actors.weight_sync.sync.TopologySync` (trainer ranks write their own
  shards into the host's shared-memory slot, both generators read it into
  their engines through `load_weights`; the trainer does not step here, so
  every sync is a new sync of v0 into the same, already faulted slot, as a
  run's syncs are after its first keep + 1); digest checking off while
  timing (checked once afterwards against the trainer's export);
- endpoint: weights as endpoint values — the trainer's collective HF export
  returned by rank 0 to the controller, then sent to each generator as an
  endpoint argument and loaded (the path the architecture rules out);
- baseline: `sync_weights` of the test oracle `tests/endpoint_sync.py` (rank-0 gather,
  safetensors in /dev/shm), for reference;
- raw shm: the same bytes by plain processes — 2 producers each write their
  half into a fresh /dev/shm file, then 2 consumers each copy the whole file
  into a preallocated tensor (the minimum memory traffic of the topology path);
  "reused" repeats it into an already-faulted file, "kept mappings" into a
  file every process mapped before (a bare memcpy: the floor). Each raw
  figure is the faster of 1 and 2 torch threads per process.

Delta sync (`actors.weight_sync.delta`), on two Monarch `ProcessJob` fake hosts
(trainer mesh on one, a bf16 generator on the other, so every byte it gets
crosses hosts): the tiny model trained with AdamW at lr 1e-6, 1e-5 and 1e-4
(`--quick`: 1e-6 only) for `--delta-steps` steps, each step synced with deltas (after one anchor
and `KEEP` untimed delta syncs, so every slot of the ring has been written once, as in a run past its
first syncs), then as many steps synced whole (after the same warm-up). Per lr: the fraction of bf16 elements that
changed per step, bytes crossing hosts with deltas ÷ without (also with an
anchor every 10 syncs, the default), sync time with ÷ without, and the
encodings' sizes on those very versions (read back from the fake host's
slots): sparse words (used) against XOR + LZ4 blocks (the fallback for dense runs, and the encoding
before), XOR + zstd (the one before that), bitmask + values and int32 index + values.
Two times per sync, each with ÷ without deltas: the publish (what the next
training step waits for: the trainer ranks' copy into the segment; the delta
encoding runs in the background after it) and the end-to-end sync (from the
publish until the generator holds the new weights: encoding, transfer,
applying and loading). Both are measured again on the benchmark shape at lr
1e-6, where copying, not call overhead, dominates.

    python benchmarks/weight_sync.py --quick

Prints tables, then one JSON line {"vs_raw_shm": ..., "vs_endpoint": ...,
"delta_bytes_ratio": ..., "delta_time_ratio": ..., "delta_publish_ratio": ...}
(topology throughput ÷ raw shm (fresh file), ÷ endpoint; also ÷ the other raw
variants and the baseline; delta_bytes_ratio at lr 1e-6 on the tiny model;
delta_time_ratio (end-to-end) and delta_publish_ratio (what a step waits for)
on the benchmark shape; per-lr figures under "delta").
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the test oracle (tests/endpoint_sync.py) is imported from the tests folder, here and in the actor processes
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)

import torch  # noqa: E402
from monarch.actor import endpoint  # noqa: E402

from composer_mesh.actors.generator import GeneratorActor  # noqa: E402
from composer_mesh.actors.trainer import TrainerActor  # noqa: E402
from endpoint_sync import EndpointGenerator, EndpointTrainer, sync_weights  # noqa: E402

FLAVOUR = "composer_bench"


def register_shape(shape: dict) -> None:
    """Add the benchmark's Qwen3 shape as flavour `qwen3:composer_bench` (in every process that builds it)."""
    from composer_mesh.titan_ext.tiny import TINY_SHAPES, TinyShape

    TINY_SHAPES.setdefault(FLAVOUR, TinyShape(**shape))


class BenchTrainer(EndpointTrainer):
    """TrainerActor on the benchmark shape, plus the endpoint-return export (benchmark only)."""

    def __init__(self, spec, shape: dict) -> None:
        register_shape(shape)
        super().__init__(spec)

    @endpoint
    def hf_state(self) -> list | None:
        import torch.distributed as dist

        named = [kv for bucket in self._t().export_weights() for kv in bucket]  # collective gathers
        return named if dist.get_rank() == 0 else None


class BenchGenerator(EndpointGenerator):
    def __init__(self, spec, shape: dict) -> None:
        register_shape(shape)
        super().__init__(spec)

    @endpoint
    def load_named(self, named: list) -> int:
        return self.engine.load_weights(named)


# ---- raw two-process shared-memory copy ----------------------------------------------------------

def _raw_worker(role: str, part: int, parts: int, nbytes: int, commands, done) -> None:
    """A producer writes its 1/parts of the bytes into the file it is told; a consumer copies the whole
    file into its preallocated tensor. Persistent: one (path, keep_mapping, threads) command per repetition,
    None ends; with keep_mapping the process maps the file once and reuses that mapping."""
    per = nbytes // parts
    src = torch.randint(0, 255, (per,), dtype=torch.uint8) if role == "w" else None
    # preallocated and faulted in
    dst = torch.zeros(nbytes, dtype=torch.uint8) if role == "r" else None
    kept: dict[str, mmap.mmap] = {}
    done.put("ready")
    while (command := commands.get()) is not None:
        path, keep_mapping, threads = command
        torch.set_num_threads(threads)
        mm = kept.get(path)
        if mm is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if role == "w" else os.open(path, os.O_RDONLY)
            if role == "w" and os.fstat(fd).st_size < nbytes:
                os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE if role == "w" else mmap.ACCESS_COPY)
            os.close(fd)
            if keep_mapping:
                kept[path] = mm
        if role == "w":
            torch.frombuffer(mm, dtype=torch.uint8)[part * per : (part + 1) * per].copy_(src)
        else:
            dst.copy_(torch.frombuffer(mm, dtype=torch.uint8))
        del mm
        done.put(role)


class RawShm:
    """`producers` processes write `nbytes` into a /dev/shm file, then `consumers` each read all of it."""

    def __init__(self, nbytes: int, producers: int = 2, consumers: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.nbytes, self.producers, self.consumers = nbytes, producers, consumers
        self.done = ctx.Queue()
        self.writers = [ctx.Queue() for _ in range(producers)]
        self.readers = [ctx.Queue() for _ in range(consumers)]
        self.procs = [ctx.Process(target=_raw_worker, args=("w", i, producers, nbytes, q, self.done))
                      for i, q in enumerate(self.writers)]
        self.procs += [ctx.Process(target=_raw_worker, args=("r", 0, 1, nbytes, q, self.done)) for q in self.readers]
        for p in self.procs:
            p.start()
        self.mapped_path = f"/dev/shm/cm_bench_raw_mapped_{os.getpid()}"

    def wait_ready(self) -> None:
        for _ in self.procs:
            assert self.done.get(timeout=600) == "ready"

    def _once(self, path: str, keep_mapping: bool, threads: int) -> float:
        start = time.perf_counter()
        for q in self.writers:
            q.put((path, keep_mapping, threads))
        for _ in self.writers:
            self.done.get(timeout=600)
        for q in self.readers:
            q.put((path, keep_mapping, threads))
        for _ in self.readers:
            self.done.get(timeout=600)
        return time.perf_counter() - start

    def run(self, mode: str) -> float:
        """Seconds for one 2→2 copy, the faster of 1 and 2 torch threads per process. mode: "fresh" (a new
        file), "reused" (an existing, faulted file, mapped afresh) or "mapped" (mappings kept from before)."""
        best = float("inf")
        for threads in (1, 2):
            if mode == "mapped":
                best = min(best, self._once(self.mapped_path, True, threads))
                continue
            path = f"/dev/shm/cm_bench_raw_{os.getpid()}"
            if mode == "reused":
                with open(path, "wb") as f:
                    f.truncate(self.nbytes)
                fd = os.open(path, os.O_RDWR)
                mm = mmap.mmap(fd, self.nbytes)
                os.close(fd)
                torch.frombuffer(mm, dtype=torch.uint8).fill_(1)
                del mm
            best = min(best, self._once(path, False, threads))
            os.unlink(path)
        return best

    def close(self) -> None:
        for q in self.writers + self.readers:
            q.put(None)
        for p in self.procs:
            p.join()
        Path(self.mapped_path).unlink(missing_ok=True)


# ---- the run ---------------------------------------------------------------------------------------

# ---- delta sync on two fake hosts ----------------------------------------------------------------

DELTA_LRS = (1e-6, 1e-5, 1e-4)
# sealed versions each delta-run sync keeps (a ring of KEEP + 1 slots per host)
KEEP = 2


def _codec(root: str, host: str, version: int) -> dict:
    """Sizes (÷ the bf16 bytes) and encode rates (GB/s of input) of five delta encodings between `host`'s sealed
    slots of `version` − 1 and `version` (the whole payload as one run): sparse words (used), XOR + LZ4 blocks
    (the fallback, used before), XOR + zstd (level −1, the encoding before that), bitmask + values, int32 index +
    values."""
    import numpy as np
    import zstandard

    from composer_mesh.actors.weight_sync.delta import BLOCK_BYTES, encode_sparse, encode_xor_lz4
    from composer_mesh.actors.weight_sync.reader import PinnedSegment

    with PinnedSegment.open(root, host, version - 1) as old, PinnedSegment.open(root, host, version) as new:
        a, b = old.payload.clone(), new.payload.clone()
    n = a.numel()
    start = time.perf_counter()
    mask = a.view(torch.int16) != b.view(torch.int16)
    bits, values = np.packbits(mask.numpy()), b.view(torch.int16)[mask]
    mask_s = time.perf_counter() - start
    start = time.perf_counter()
    changed = a.view(torch.int16) != b.view(torch.int16)
    index, values = torch.nonzero(changed).flatten().to(torch.int32), b.view(torch.int16)[changed]
    index_s = time.perf_counter() - start
    start = time.perf_counter()
    xor = (a.view(torch.int16) ^ b.view(torch.int16)).numpy()
    zstd = zstandard.ZstdCompressor(level=-1).compress(xor)
    zstd_s = time.perf_counter() - start
    start = time.perf_counter()
    _, _, packed, _, _ = encode_xor_lz4(b, a, 2, torch.empty(BLOCK_BYTES, dtype=torch.uint8))
    xor_s = time.perf_counter() - start
    start = time.perf_counter()
    _, _, sparse, _, _ = encode_sparse(b, a, 2)
    sparse_s = time.perf_counter() - start
    return {"sparse": sparse.size / n, "sparse_gbps": n / sparse_s / 1e9, "xor_lz4": packed.size / n, "xor_zstd": len(zstd) / n, "bitmask_values": (bits.nbytes + values.numel() * 2) / n,
            "index_values": (index.numel() * 4 + values.numel() * 2) / n, "xor_lz4_gbps": n / xor_s / 1e9,
            "xor_zstd_gbps": n / zstd_s / 1e9, "bitmask_gbps": n / mask_s / 1e9, "index_gbps": n / index_s / 1e9}


def delta_run(state, trainer_cls, trainer_args: tuple, gen_cls, gen_args: tuple, work: Path, steps: int,
              vocab: int, codec: bool) -> dict:
    """One trainer mesh (host "trainer") and one bf16 generator (host "generator"): `steps` steps synced with
    deltas after an anchor, then `steps` synced whole; the generator's weights are checked at the end."""
    import statistics

    from composer_mesh.actors.elastic import setup_elastic_env

    from composer_mesh.actors.mesh_utils import rank0
    from composer_mesh.actors.weight_sync.sync import TopologySync
    from composer_mesh.titan_ext.batch import TrainBatch

    procs = state.trainer.spawn_procs(per_host={"gpus": 2})
    setup_elastic_env(procs)
    trainer = procs.spawn("trainer", trainer_cls, *trainer_args)
    gen_procs = state.generator.spawn_procs(per_host={"gpus": 1})
    gen = gen_procs.spawn("generator", gen_cls, *gen_args)
    trainer.setup.call().get()
    try:
        root = str(work / "delta")
        sync = TopologySync(trainer, [gen], root, keep=KEEP, dtype="bfloat16", anchor_every=10**9, verify=False)
        host = next(r.host for r in sync.plan.routes if r.reader is not None)
        steps_taken = itertools.count(1)

        def step_then_sync(s: TopologySync):
            """One training step, then `s`'s sync of it (its report)."""
            trainer.train_step.call(TrainBatch.synthetic(next(steps_taken), vocab)).get()
            return s.sync()

        model_bytes = sync.sync().model_bytes  # the anchor
        # untimed: the rest of the ring's first writes (a slot's first write faults its pages in; a run's syncs
        # after its first KEEP + 1 reuse faulted slots), on both hosts
        for _ in range(KEEP):
            step_then_sync(sync)
        delta_bytes, changed, delta_s, publish_s, codecs, parts = [], [], [], [], [], []
        for _ in range(steps):
            report = step_then_sync(sync)
            if not report.delta.get(host):
                raise SystemExit(f"v{report.version}: the generator host got full weights, not a delta")
            delta_bytes.append(report.cross_host_bytes)
            changed.append(report.changed / report.elements)
            delta_s.append(report.total_s)
            publish_s.append(report.publish_s)
            parts.append((report.write_s, report.pull_s[host], report.load_s))
            if codec:
                codecs.append(_codec(root, host, report.version))
        full = TopologySync(trainer, [gen], str(work / "full"), keep=KEEP, dtype="bfloat16", verify=False)
        full.sync()
        for _ in range(KEEP):
            step_then_sync(full)
        full_s, full_publish_s = [], []
        for _ in range(steps):
            report = step_then_sync(full)
            full_s.append(report.total_s)
            full_publish_s.append(report.publish_s)
            parts.append((report.write_s, report.pull_s[host], report.load_s))
        if rank0(trainer.weights_digest.call("bfloat16").get()) != gen.weights_digest.call_one(dtype="bfloat16").get():
            raise SystemExit("delta sync left the generator with other weights than the trainer's")
    finally:
        procs.stop().get()
        gen_procs.stop().get()
    ratio = sum(delta_bytes) / (steps * model_bytes)
    # [mesh] weight_sync_anchor_every's default: one anchor, nine deltas
    every = 10
    return {
        "model_mb": round(model_bytes / 1e6, 2), "steps": steps,
        "changed_fraction": round(statistics.mean(changed), 4), "changed_max": round(max(changed), 4),
        "bytes_ratio": round(ratio, 4), "bytes_ratio_anchor10": round((1 + (every - 1) * ratio) / every, 4),
        # end to end: publish until the generator holds the version
        "time_ratio": round(statistics.median(delta_s) / statistics.median(full_s), 3),
        # what the next training step waits for
        "publish_ratio": round(statistics.median(publish_s) / statistics.median(full_publish_s), 3),
        "delta_sync_s": round(statistics.median(delta_s), 4), "full_sync_s": round(statistics.median(full_s), 4),
        "delta_publish_s": round(statistics.median(publish_s), 4),
        "full_publish_s": round(statistics.median(full_publish_s), 4),
        "write_pull_load_s": {kind: [round(statistics.median(p[i] for p in half), 4) for i in range(3)]
                              for kind, half in (("delta", parts[:steps]), ("full", parts[steps:]))},
        "codec": {k: round(statistics.mean(c[k] for c in codecs), 4) for k in codecs[0]} if codecs else {},
    }


def delta_figures(work: Path, tiny, bench_hf: Path, bench_model, shape: dict, steps: int, bench_steps: int,
                  lrs: tuple[float, ...]) -> dict:
    """`delta_run` for each of `lrs` on the tiny model, then at lr 1e-6 on the benchmark shape."""
    from monarch.job import ProcessJob

    import benchmarks.weight_sync as bench
    from composer_mesh.actors.generator import GeneratorSpec
    from composer_mesh.configs.sections.generator import GeneratorConfig
    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.configs.sections.optimizer import OptimizerConfig
    from composer_mesh.configs.sections.trainer import TrainerConfig
    from composer_mesh.titan_ext.spec import TrainerSpec

    def spec(model, lr: float, folder: str) -> TrainerSpec:
        return TrainerSpec(model=model, trainer=TrainerConfig(steps=10_000, microbatches=1),
                           optimizer=OptimizerConfig(name="adamw", lr=lr, weight_decay=0.0, decay_ratio=0.0),
                           checkpoint_dir=str(work / folder))

    job = ProcessJob({"trainer": 1, "generator": 1})
    out: dict = {"tiny": {}}
    try:
        state = job.state(cached_path=None)
        tiny_model = ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny.dense_dir))
        tiny_gen = GeneratorSpec(model_dir=str(tiny.dense_dir),
                                 generator=GeneratorConfig(engine="hf", dtype="bfloat16"))
        vocab = vocab_size(tiny.dense_dir)
        for lr in lrs:
            out["tiny"][f"{lr:g}"] = delta_run(state, TrainerActor, (spec(tiny_model, lr, f"ckpt_{lr:g}"),),
                                               GeneratorActor, (tiny_gen,), work / f"tiny_{lr:g}", steps, vocab,
                                               codec=True)
            print(f"  delta lr {lr:g}: {out['tiny'][f'{lr:g}']}", flush=True)
        bench_gen = GeneratorSpec(model_dir=str(bench_hf), tokenizer_dir=str(tiny.dense_dir),
                                  generator=GeneratorConfig(engine="hf", dtype="bfloat16"))
        out["bench"] = delta_run(state, bench.BenchTrainer, (spec(bench_model, 1e-6, "ckpt_b"), shape),
                                 bench.BenchGenerator, (bench_gen, shape), work / "bench", bench_steps,
                                 vocab_size(bench_hf), codec=False)
        print(f"  delta bench shape: {out['bench']}", flush=True)
    finally:
        job.kill()
    return out


def vocab_size(model_dir: Path) -> int:
    """The vocabulary size of an HF checkpoint folder (config.json)."""
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def print_delta_table(deltas: dict) -> None:
    print("\ndelta sync, bf16 serving, AdamW, 2 fake hosts (trainer host → generator host)")
    print(f"{'model / lr':18s} {'changed':>8s} {'bytes ratio':>11s} {'w/ anchor/10':>12s} {'e2e ratio':>10s} "
          f"{'delta s':>8s} {'full s':>8s} {'publish Δ/full':>15s} {'publish ratio':>13s}")
    rows = [(f"tiny {lr}", row) for lr, row in deltas["tiny"].items()] + [("bench 1e-06", deltas["bench"])]
    for name, row in rows:
        print(f"{name:18s} {row['changed_fraction']:8.4f} {row['bytes_ratio']:11.4f} "
              f"{row['bytes_ratio_anchor10']:12.4f} {row['time_ratio']:10.3f} {row['delta_sync_s']:8.4f} "
              f"{row['full_sync_s']:8.4f} {row['delta_publish_s']:7.4f}/{row['full_publish_s']:.4f} "
              f"{row['publish_ratio']:13.3f}")
    print("\nencodings on the same versions (bytes ÷ bf16 bytes; encode GB/s, one thread)")
    print(f"{'lr':8s} {'sparse':>7s} {'xor+lz4':>8s} {'xor+zstd':>9s} {'bitmask+v':>10s} {'index+v':>8s} "
          f"{'sparse GB/s':>11s} {'lz4 GB/s':>9s} {'zstd GB/s':>10s} {'mask GB/s':>10s} {'index GB/s':>10s}")
    for lr, row in deltas["tiny"].items():
        c = row["codec"]
        print(f"{lr:8s} {c['sparse']:7.4f} {c['xor_lz4']:8.4f} {c['xor_zstd']:9.4f} {c['bitmask_values']:10.4f} "
              f"{c['index_values']:8.4f} {c['sparse_gbps']:11.2f} {c['xor_lz4_gbps']:9.2f} {c['xor_zstd_gbps']:10.2f} "
              f"{c['bitmask_gbps']:10.2f} {c['index_gbps']:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions (endpoint path: 1)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--delta-only", action="store_true",
                        help="only the delta-sync figures (no throughput paths; the JSON line has the delta keys)")
    parser.add_argument("--delta-steps", type=int, default=None,
                        help="steps per lr synced with deltas, then as many whole (default 10; the benchmark "
                             "shape: 4 with --quick, which also runs lr 1e-6 only)")
    args = parser.parse_args()
    reps = 3 if args.quick else args.reps
    shape = dict(dim=args.dim, n_layers=args.layers, n_heads=16, n_kv_heads=8, head_dim=64, hidden_dim=args.ffn)

    # actor classes by an importable name, for the child processes
    import benchmarks.weight_sync as bench
    from monarch.actor import this_host
    from composer_mesh.actors.elastic import setup_elastic_env

    from composer_mesh.actors.generator import GeneratorSpec
    from composer_mesh.actors.mesh_utils import rank0
    from composer_mesh.actors.weight_sync.sync import TopologySync
    from composer_mesh.configs.sections.generator import GeneratorConfig
    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.titan_ext.assets import build_assets
    from composer_mesh.titan_ext.models import resolve_model
    from composer_mesh.titan_ext.spec import TrainerSpec

    t0 = time.perf_counter()
    raw_shm = None
    work = Path(tempfile.mkdtemp(prefix="cm_wsync_", dir="/dev/shm"))
    try:
        bench.register_shape(shape)
        tiny = build_assets(ROOT / ".cache" / "assets", seed=0)
        model_cfg = ModelConfig(flavour=f"qwen3:{FLAVOUR}", device="cpu")
        resolved = resolve_model(model_cfg)
        hf_config = resolved.hf_config
        with torch.device("meta"):
            nbytes = sum(p.numel() * p.element_size() for p in resolved.spec.model.build().parameters())
        # its processes start while the meshes come up
        raw_shm = None if args.delta_only else RawShm(nbytes)
        from transformers import AutoModelForCausalLM

        hf_dir = work / "hf"
        # generators' initial weights
        AutoModelForCausalLM.from_config(hf_config).save_pretrained(hf_dir)
        if args.delta_only:
            deltas = delta_figures(work, tiny, hf_dir, model_cfg, shape, args.delta_steps or 10,
                                   args.delta_steps or (4 if args.quick else 10),
                                   DELTA_LRS[:1] if args.quick else DELTA_LRS)
            print_delta_table(deltas)
            print(json.dumps(delta_json(deltas)))
            return
        trainer_procs = this_host().spawn_procs(per_host={"gpus": 2})
        setup_elastic_env(trainer_procs)
        trainer = trainer_procs.spawn("trainer", bench.BenchTrainer,
                                      TrainerSpec(model=model_cfg, checkpoint_dir=str(work / "ckpt")), shape)
        gen_spec = GeneratorSpec(model_dir=str(hf_dir), tokenizer_dir=str(tiny.dense_dir),
                                 generator=GeneratorConfig(engine="hf"))
        gen_procs = this_host().spawn_procs(per_host={"gpus": 2})
        gen_mesh = gen_procs.spawn("generator", bench.BenchGenerator, gen_spec, shape)
        trainer.setup.call().get()
        gens = [gen_mesh.slice(**point) for point, _ in gen_mesh.info.call().get().items()]
        print(f"setup {time.perf_counter() - t0:.1f}s", flush=True)

        sync = TopologySync(trainer, gens, str(work / "seg"), keep=1, verify=False)
        raw_shm.wait_ready()
        topo, raw, raw_reused, raw_mapped, model_bytes = [], [], [], [], 0
        # warm-ups fault the slot and bind the shadows once, as a run's first sync does
        for i in range(reps + 2):
            report = sync.sync()
            model_bytes = report.model_bytes
            # the trainer tied or split weights unlike the meta build
            if model_bytes != raw_shm.nbytes:
                raw_shm.close()
                raw_shm = RawShm(model_bytes)
                raw_shm.wait_ready()
            if i >= 2:
                topo.append(report.total_s)
                raw.append(raw_shm.run("fresh"))
                raw_reused.append(raw_shm.run("reused"))
                raw_mapped.append(raw_shm.run("mapped"))
                print(f"  rep {i}: topology {topo[-1]:.3f}s (publish {report.publish_s:.3f}s, in-actor write "
                      f"{report.write_s:.3f}s, load {report.load_s:.3f}s), "
                      f"raw {raw[-1]:.3f}s, reused {raw_reused[-1]:.3f}s, mapped {raw_mapped[-1]:.3f}s", flush=True)
        publish_s = report.publish_s
        digest = rank0(trainer.weights_digest.call().get())
        held = {g.weights_digest.call_one().get() for g in gens}
        if held != {digest}:
            raise SystemExit("topology sync left generators with different weights than the trainer")

        endpoint_s = []
        for _ in range(1 if args.quick else reps):
            start = time.perf_counter()
            named = rank0(trainer.hf_state.call().get())
            for f in [g.load_named.call_one(named) for g in gens]:
                f.get()
            endpoint_s.append(time.perf_counter() - start)
            del named
        baseline_s = []
        for i in range(1 if args.quick else reps):
            start = time.perf_counter()
            for g in gens:
                sync_weights(trainer, g, str(work / f"base{i}"))
            baseline_s.append(time.perf_counter() - start)
        trainer_procs.stop().get()
        gen_procs.stop().get()
        print(f"timed sync paths {time.perf_counter() - t0:.1f}s", flush=True)
        deltas = delta_figures(work, tiny, hf_dir, model_cfg, shape, args.delta_steps or 10,
                               args.delta_steps or (4 if args.quick else 10),
                               DELTA_LRS[:1] if args.quick else DELTA_LRS)
        print(f"delta sync {time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        if raw_shm is not None:
            raw_shm.close()
        shutil.rmtree(work, ignore_errors=True)

    delivered = 2 * model_bytes
    rows = {
        "topology (shm segments)": topo, "endpoint return": endpoint_s, "baseline (rank-0 safetensors)": baseline_s,
        "raw shm 2→2 (fresh file)": raw, "raw shm 2→2 (reused file)": raw_reused,
        "raw shm 2→2 (kept mappings)": raw_mapped,
    }
    gbps = {k: delivered / statistics.median(v) / 1e9 for k, v in rows.items()}
    print(f"model {model_bytes / 1e6:.0f} MB fp32, 2 trainer ranks → 2 generators, {reps} reps "
          f"(topology publish step {publish_s * 1e3:.0f} ms)")
    print(f"{'path':32s} {'median s':>9s} {'GB/s delivered':>15s}")
    for k, v in rows.items():
        print(f"{k:32s} {statistics.median(v):9.3f} {gbps[k]:15.2f}")
    figures = {
        "vs_raw_shm": round(gbps["topology (shm segments)"] / gbps["raw shm 2→2 (fresh file)"], 3),
        "vs_raw_shm_reused": round(gbps["topology (shm segments)"] / gbps["raw shm 2→2 (reused file)"], 3),
        "vs_raw_shm_mapped": round(gbps["topology (shm segments)"] / gbps["raw shm 2→2 (kept mappings)"], 3),
        "vs_endpoint": round(gbps["topology (shm segments)"] / gbps["endpoint return"], 2),
        "vs_baseline": round(gbps["topology (shm segments)"] / gbps["baseline (rank-0 safetensors)"], 2),
        "topology_gbps": round(gbps["topology (shm segments)"], 3), "model_mb": round(model_bytes / 1e6, 1),
    }
    print_delta_table(deltas)
    figures.update(delta_json(deltas))
    print(json.dumps(figures))


def delta_json(deltas: dict) -> dict:
    """The delta figures of the JSON line."""
    at_1e6 = deltas["tiny"]["1e-06"]
    return dict(
        delta_bytes_ratio=at_1e6["bytes_ratio"], delta_time_ratio=deltas["bench"]["time_ratio"],
        delta_publish_ratio=deltas["bench"]["publish_ratio"],
        delta_changed_fraction=at_1e6["changed_fraction"],
        delta={lr: {k: v for k, v in row.items() if k != "codec"} for lr, row in deltas["tiny"].items()},
        delta_bench=deltas["bench"],
    )


if __name__ == "__main__":
    main()
