"""Memory per role and per parameter: `composer-mesh train` on Qwen3 shapes from tiny up to the 0.6B shape.

Each shape is a Qwen3 checkpoint made with transformers (random init, the
project's tiny ChatML tokenizer, so the vocabulary is small and the layers
hold nearly all parameters), run for 2 steps of the main recipe
(`configs/demo_cpu.toml`: all three loss channels, fp32 master weights,
checkpoint at the last step, final `hf/` export; warm start and held-out
evaluation off) with the memory goal's optimizer, serving dtype and malloc
threshold (`RECIPE`: AdamW, so the trainer holds fp32 parameters and
gradients and AdamW's two moments, kept in bf16 with stochastic rounding
(`optimizer.moments_dtype=float32` for the float32 moments' figure), plus the
frozen DPO reference; bf16 generators, whose dtype
the reference and the weight-sync slots take; the 1 MiB mmap threshold this
benchmark chose for memory-bound runs, docs/cluster.md; the reference as a
file in the run folder read through mmap, page cache rather than the
trainer's private memory) in its own process;
`--override` goes on top (`optimizer.name=muon`, `generator.dtype=float32`,
`mesh.malloc_mmap_threshold_mib=4` for the debug recipe as is). A sampler reads every process of the run each 0.2 s:
anonymous memory as its proportional share (`Pss_Anon`: pages a forked role
process shares copy-on-write with the fork server are divided among them, so
the processes sum to the host's use; shared-memory slots are counted once, as
/dev/shm use) and the bytes the run holds in /dev/shm. Phases are
told apart by the files the run writes: `load` (spawn and setup, until
processes.json), `steps` (until the last metrics row), `finish` (final
checkpoint, export, exit).

    python benchmarks/memory_scale.py --quick    # tiny, 8M and a 4-layer cut of the 0.6B shape

Prints, per shape and role, the peak anonymous memory and bytes per parameter,
and ends with one JSON line: `trainer_bytes_per_param`,
`generator_bytes_per_param`, `shm_bytes_per_param`, `host_bytes_per_param`
(peak of everything on the host), `reference_file_bytes_per_param` (the
file-backed DPO reference, page cache outside those) for the largest shape run, each actor's own
peak per phase (`phase_bytes_per_param`: load, first_sync, step,
checkpoint, export; generator load, first_sync, generate, sync), plus the slope
and intercept of each role's peak against the parameter count over the
shapes (what `mesh.memory` budgets with).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (hidden, intermediate, layers, heads, kv heads, head_dim); Qwen3-0.6B is 1024/3072/28/16/8/128
SHAPES = {
    "tiny": (64, 192, 2, 4, 2, 16),
    "8M": (256, 768, 8, 4, 2, 64),
    "0.6B-4L": (1024, 3072, 4, 16, 8, 128),
    "0.6B-12L": (1024, 3072, 12, 16, 8, 128),
    "0.6B": (1024, 3072, 28, 16, 8, 128),
}
QUICK = ("tiny", "8M", "0.6B-4L")
ROLES = ("controller", "trainer", "generator", "replay")
# overrides of configs/demo_cpu.toml for every run, before --override
RECIPE = ("optimizer.name=adamw", "optimizer.moments_dtype=bfloat16", "generator.dtype=bfloat16",
          "mesh.malloc_mmap_threshold_mib=1", "trainer.dpo_reference_storage=file")


def make_model(root: Path, shape: tuple[int, ...]) -> tuple[Path, int]:
    """A random-init Qwen3 of `shape` saved with transformers; (its directory, its parameter count)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from composer_mesh.titan_ext.assets import build_assets, default_cache_dir

    hidden, inter, layers, heads, kv, head_dim = shape
    tok = AutoTokenizer.from_pretrained(build_assets(default_cache_dir(), seed=0).tokenizer_dir)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    out = root / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def _descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _pss_anon(pid: int) -> int:
    """The process's share of anonymous memory: pages it shares with others (a process forked from the fork
    server, `mesh.forkserver`, shares the server's imported modules copy-on-write) divided among them, so the
    sum over the run's processes is the host's anonymous use (`RssAnon` counts shared pages once per process)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_Anon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _shm_bytes(name: str) -> int:
    total = 0
    for folder in Path("/dev/shm").glob(f"composer-mesh-{name}-*"):
        for f in folder.rglob("*"):
            try:
                total += f.stat().st_blocks * 512 if f.is_file() else 0
            except OSError:
                pass
    return total


class Sampler(threading.Thread):
    """Peak anonymous memory (proportional share) per role and /dev/shm bytes per phase of one run (every 0.2 s)."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path, name: str, steps: int) -> None:
        super().__init__(daemon=True)
        self.proc, self.run_dir, self.name, self.steps = proc, run_dir, name, steps
        self.peaks: dict[str, dict[str, int]] = {}  # phase -> role -> bytes ("host": everything)

    def _phase(self, rows: int, steps: int) -> str:
        if not (self.run_dir / "processes.json").exists():
            return "load"
        return "steps" if rows < steps else "finish"

    def run(self) -> None:
        steps = self.steps
        while self.proc.poll() is None:
            metrics = self.run_dir / "metrics.jsonl"
            rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            phase = self._phase(rows, steps)
            roles: dict[str, int] = {}
            pids_file = self.run_dir / "processes.json"
            named = {}
            if pids_file.exists():
                try:
                    named = {pid: role for role, pids in json.loads(pids_file.read_text()).items() for pid in pids}
                except (OSError, ValueError):
                    named = {}
            every = _descendants(self.proc.pid)
            for pid in every:
                role = named.get(pid, "controller" if pid == self.proc.pid else "other")
                roles[role] = roles.get(role, 0) + _pss_anon(pid)
            roles["shm"] = _shm_bytes(self.name)
            roles["host"] = sum(roles.values())
            peak = self.peaks.setdefault(phase, {})
            for role, b in roles.items():
                peak[role] = max(peak.get(role, 0), b)
            time.sleep(0.2)


def run_shape(name: str, shape: tuple[int, ...], tmp: Path, steps: int = 2, overrides: tuple[str, ...] = ()) -> dict:
    root = tmp / name
    root.mkdir()
    model_dir, params = make_model(root, shape)
    # this process's id: /dev/shm is counted by job name, so concurrent runs must not share one
    job = f"mem-{name}-{os.getpid()}".replace(".", "_")
    # the caller's PYTHONPATH: the run imports the same composer_mesh as this script
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "composer_mesh.mesh.cli", "train", "--no-progress", str(REPO / "configs/demo_cpu.toml"),
           f"--job.name={job}", f"--job.output_dir={root / 'runs'}", f"--model.hf_path={model_dir}",
           f"--trainer.steps={steps}", "--trainer.prompts_per_step=2", "--trainer.eval_every=0",
           "--generator.max_new_tokens=8", f"--checkpoint.every_steps={steps}", "--env.demo.warm_start_steps=0",
           "--mesh.max_restarts=0",
           # fp32 Newton–Schulz: on this CPU (AVX2, no bf16 units) one bf16 NS of a 1024 x 3072 matrix takes 50 s,
           # fp32 1 s (titan_ext.muon.zeropower_via_newtonschulz, 1 thread); memory is the same either way
           "--optimizer.ns_dtype=float32", *overrides]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc, root / "runs" / job, job, steps)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{name}: train exited {proc.returncode}:\n{err[-3000:]}")
    peaks = {role: max(p.get(role, 0) for p in sampler.peaks.values()) for role in (*ROLES, "shm", "host")}
    memory = json.loads((root / "runs" / job / "summary.json").read_text())["memory"]
    # the file-backed DPO reference (trainer.dpo_reference_storage = "file"): page cache, not counted above
    reference_file = sum(f.stat().st_size for f in (root / "runs" / job).glob("dpo_reference.rank*.safetensors"))
    return {"params": params, "wall_s": time.perf_counter() - start, "peaks": peaks, "phases": sampler.peaks,
            "reference_file": reference_file,
            "actor_phases": {"trainer": memory["trainer"][0], "generator": memory["generator"][0]}}


def fit(xs: list[int], ys: list[int]) -> tuple[float, float]:
    """Least-squares (slope bytes/param, intercept bytes)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return slope, my - slope * mx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"shapes {', '.join(QUICK)}")
    p.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), help="shapes to run (default: all)")
    p.add_argument("--steps", type=int, default=2, help="training steps per shape (checkpoint at the last)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, e.g. optimizer.ns_dtype=float32")
    a = p.parse_args()
    names = list(QUICK) if a.quick else (a.shapes or list(SHAPES))
    results = {}
    with tempfile.TemporaryDirectory(prefix="memory_scale-") as tmp:
        for name in names:
            overrides = tuple(f"--{o}" for o in (*RECIPE, *a.override))
            results[name] = run_shape(name, SHAPES[name], Path(tmp), a.steps, overrides)
            r = results[name]
            print(f"{name}: {r['params'] / 1e6:.1f}M params, {r['wall_s']:.0f} s", file=sys.stderr)
    gib = 1 << 30
    print(f"{'shape':10} {'params':>8} {'phase':7} " + " ".join(f"{r:>10}" for r in (*ROLES, "shm", "host"))
          + "   (peak anonymous memory (Pss_Anon) / shm, GiB)")
    for name, r in results.items():
        for phase, peak in r["phases"].items():
            print(f"{name:10} {r['params'] / 1e6:7.1f}M {phase:7} "
                  + " ".join(f"{peak.get(role, 0) / gib:10.3f}" for role in (*ROLES, "shm", "host")))
    big = results[names[-1]]
    print(f"\n{names[-1]}: each actor's own peak per phase (VmHWM reset at the phase's start; actors/phase_memory.py)")
    print(f"{'role':10} {'phase':11} {'peak RSS GiB':>12} {'private GiB':>12} {'private B/param':>16}")
    phase_bpp: dict[str, dict[str, float]] = {}
    for role, phases in big["actor_phases"].items():
        for phase, peak in phases.items():
            phase_bpp.setdefault(role, {})[phase] = round(peak["private"] / big["params"], 2)
            print(f"{role:10} {phase:11} {peak['peak_rss'] / gib:12.3f} {peak['private'] / gib:12.3f} "
                  f"{peak['private'] / big['params']:16.2f}")
    per_param = {f"{role}_bytes_per_param": big["peaks"][role] / big["params"]
                 for role in ("trainer", "generator", "shm", "host")}
    xs = [r["params"] for r in results.values()]
    fits = {role: fit(xs, [r["peaks"][role] for r in results.values()]) for role in (*ROLES, "shm", "host")}
    print(f"{'role':10} {'bytes/param (slope)':>20} {'fixed GiB (intercept)':>22}")
    for role, (slope, icpt) in fits.items():
        print(f"{role:10} {slope:20.2f} {icpt / gib:22.3f}")
    per_param["reference_file_bytes_per_param"] = big["reference_file"] / big["params"]
    print(f"{names[-1]}: the DPO reference's file in the run folder (page cache, not in the trainer's figures): "
          f"{per_param['reference_file_bytes_per_param']:.2f} B/param")
    print(json.dumps({**per_param, "overrides": [*RECIPE, *a.override], "largest": names[-1], "params": big["params"], "phase_bytes_per_param": phase_bpp,
                      "fit": {role: {"bytes_per_param": s, "fixed_bytes": i} for role, (s, i) in fits.items()}}))


if __name__ == "__main__":
    main()
