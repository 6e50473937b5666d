"""Weight-sync throughput on one host: FSDP trainer on 2 procs → 2 generator procs.

Model: a synthetic Qwen3 flavour big enough that copying dominates (default
dim 1024, 6 layers, FFN 2816: 72 M fp32 parameters, 288 MB). Every figure is
bytes delivered to generators (model bytes × 2) per second of wall time,
median over the repetitions, all measured in this run:

- topology: `mesh.weight_sync.TopologySync` (trainer ranks write their own
  shards into the host's shared-memory slot, both generators read it into
  their engines through `load_weights`; the trainer does not step here, so
  every sync is a new sync of v0 into the same, already faulted slot, as a
  run's syncs are after its first keep + 1); digest checking off while
  timing (checked once afterwards against the trainer's export);
- endpoint: weights as endpoint values — the trainer's collective HF export
  returned by rank 0 to the controller, then sent to each generator as an
  endpoint argument and loaded (the path the architecture rules out);
- baseline: `mesh.weight_sync_baseline.sync_weights` (rank-0 gather,
  safetensors in /dev/shm), for reference;
- raw shm: the same bytes by plain processes — 2 producers each write their
  half into a fresh /dev/shm file, then 2 consumers each copy the whole file
  into a preallocated tensor (the minimum memory traffic of the topology path);
  "reused" repeats it into an already-faulted file, "kept mappings" into a
  file every process mapped before (a bare memcpy: the floor). Each raw
  figure is the faster of 1 and 2 torch threads per process.

    python benchmarks/weight_sync.py --quick

Prints a table, then one JSON line {"vs_raw_shm": ..., "vs_endpoint": ...}
(topology throughput ÷ raw shm (fresh file), ÷ endpoint; also ÷ the other
raw variants and the baseline).
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

import torch  # noqa: E402
from monarch.actor import endpoint  # noqa: E402

from actors.generator import GeneratorActor  # noqa: E402
from actors.trainer import TrainerActor  # noqa: E402

FLAVOUR = "composer_bench"


def register_shape(shape: dict) -> None:
    """Add the benchmark's Qwen3 shape as flavour `qwen3:composer_bench` (in every process that builds it)."""
    from titan_ext.models import TINY_SHAPES, TinyShape

    TINY_SHAPES.setdefault(FLAVOUR, TinyShape(**shape))


class BenchTrainer(TrainerActor):
    """TrainerActor on the benchmark shape, plus the endpoint-return export (benchmark only)."""

    def __init__(self, spec, shape: dict) -> None:
        register_shape(shape)
        super().__init__(spec)

    @endpoint
    def hf_state(self) -> list | None:
        import torch.distributed as dist

        named = [kv for bucket in self._t().export_weights() for kv in bucket]  # collective gathers
        return named if dist.get_rank() == 0 else None


class BenchGenerator(GeneratorActor):
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
    dst = torch.zeros(nbytes, dtype=torch.uint8) if role == "r" else None  # preallocated and faulted in
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

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions (endpoint path: 1)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--ffn", type=int, default=2816)
    args = parser.parse_args()
    reps = 3 if args.quick else args.reps
    shape = dict(dim=args.dim, n_layers=args.layers, n_heads=16, n_kv_heads=8, head_dim=64, hidden_dim=args.ffn)

    import benchmarks.weight_sync as bench  # actor classes by an importable name, for the child processes
    from monarch.actor import this_host
    from monarch.spmd import setup_torch_elastic_env

    from actors.generator import GeneratorSpec
    from configs.sections.generator import GeneratorConfig
    from configs.sections.model import ModelConfig
    from mesh.weight_sync import TopologySync
    from mesh.weight_sync_baseline import rank0, sync_weights
    from titan_ext.assets import build_assets
    from titan_ext.models import resolve_model
    from titan_ext.trainer import TrainerSpec

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
        raw_shm = RawShm(nbytes)  # its processes start while the meshes come up
        from transformers import AutoModelForCausalLM

        hf_dir = work / "hf"
        AutoModelForCausalLM.from_config(hf_config).save_pretrained(hf_dir)  # generators' initial weights
        trainer_procs = this_host().spawn_procs(per_host={"gpus": 2})
        setup_torch_elastic_env(trainer_procs)
        trainer = trainer_procs.spawn("trainer", bench.BenchTrainer,
                                      TrainerSpec(model=model_cfg, checkpoint_dir=str(work / "ckpt")), shape)
        gen_spec = GeneratorSpec(model_dir=str(hf_dir), tokenizer_dir=str(tiny.dense_dir),
                                 generator=GeneratorConfig(engine="hf"))
        gen_mesh = this_host().spawn_procs(per_host={"gpus": 2}).spawn("generator", bench.BenchGenerator, gen_spec,
                                                                         shape)
        trainer.setup.call().get()
        gens = [gen_mesh.slice(**point) for point, _ in gen_mesh.info.call().get().items()]
        print(f"setup {time.perf_counter() - t0:.1f}s", flush=True)

        sync = TopologySync(trainer, gens, str(work / "seg"), keep=1, verify=False)
        raw_shm.wait_ready()
        topo, raw, raw_reused, raw_mapped, model_bytes = [], [], [], [], 0
        for i in range(reps + 2):  # warm-ups fault the slot and bind the shadows once, as a run's first sync does
            report = sync.sync()
            model_bytes = report.model_bytes
            if model_bytes != raw_shm.nbytes:  # the trainer tied or split weights unlike the meta build
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
        print(f"timed sync paths {time.perf_counter() - t0:.1f}s", flush=True)
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
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
