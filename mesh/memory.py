"""Memory budget at start-up: what a recipe needs on this host, against what the host has.

`estimate` sizes each role from the model's parameter count and the recipe,
with the per-parameter and fixed costs measured by
`python benchmarks/memory_scale.py` (docs/cluster.md, "Sizing a node"):

- trainer, per process: its shard (1 / FSDP ranks) of fp32 parameters and
  gradients, the optimizer's state (AdamW: 2 fp32 moments; Muon: 1 momentum
  buffer), the frozen DPO reference when the preference loss needs one (in
  `trainer.dpo_reference_dtype`, by default the serving dtype; none when
  `trainer.dpo_reference_storage = "file"` keeps it in the page cache), and
  the measured rest (export and checkpoint buffers, the loss's temporaries);
- generator, per process: the weights in the serving dtype plus the measured
  rest (the engine, the shadow model it loads through);
- /dev/shm: the weight-sync ring, `keep + 1` slots of the whole model in
  the serving dtype (keep = 2 + max_staleness);
- every process: a fixed cost (Python, torch, Monarch, the role's imports).

`check` compares the host's sum with `MemAvailable` and the slots with
/dev/shm's free space and refuses (or warns, `[mesh] memory_check`) with the
numbers, instead of letting the kernel's OOM killer end the run mid-step.
Only the local backend is checked: on a cluster the controller's host is not
the nodes the roles run on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from composer_mesh.actors.weight_sync.sync import sync_keep
from composer_mesh.configs.schema import JobConfig
from composer_mesh.titan_ext.spec import TrainerSpec

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Fitted by `benchmarks/memory_scale.py --quick --override mesh.malloc_mmap_threshold_mib=4 --override
# trainer.dpo_reference_storage=memory` (the defaults; how, and what the rests hold: docs/cluster.md, "Sizing a node").
# Trainer: beyond params, grads, optimizer state and the reference.
TRAINER_REST_BYTES_PER_PARAM = 4.8
# Generator: beyond the serving-dtype weights.
GENERATOR_REST_BYTES_PER_PARAM = 1.0
FIXED_BYTES = {"controller": 467 << 20, "trainer": 513 << 20, "generator": 432 << 20, "replay": 359 << 20}
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 8, "muon": 4}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process of each role, how many of each run on this host, and the /dev/shm slots."""

    params: int
    per_process: dict[str, int]
    processes: dict[str, int]
    shm: int
    # role -> how its figure is made, for the message
    terms: dict[str, str] = field(default_factory=dict)

    @property
    def host(self) -> int:
        return sum(self.per_process[r] * n for r, n in self.processes.items()) + self.shm

    def table(self) -> str:
        rows = [f"{role} {n} x {self.per_process[role] / GIB:.2f} GiB ({self.terms.get(role, 'fixed')})"
                for role, n in self.processes.items() if n]
        return "; ".join(rows + [f"/dev/shm {self.shm / GIB:.2f} GiB (weight-sync slots)"])


def parameter_count(model_dir: str) -> int:
    """Parameters of the HF checkpoint at `model_dir`, counted on the meta device (no weights read)."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def estimate(job: JobConfig, params: int) -> MemoryEstimate:
    """What `job` needs on this host for a model of `params` parameters (local backend: every role here)."""
    mesh, gen = job.mesh, job.generator
    trainer_procs = mesh.trainer_procs
    shard = params / trainer_procs  # FSDP over every trainer rank of the host
    # the preference channel runs (mesh.api: a replay actor)
    replay = job.loss.beta > 0 and mesh.replay_procs > 0
    # the trainer builds the frozen reference only then (mesh.placement.trainer_spec_for, titan_ext.trainer)
    frozen = replay and job.trainer.dpo_reference == "frozen" and job.loss.preference.needs_reference
    # a file-backed reference is page cache the kernel may evict, not private memory
    in_memory = frozen and job.trainer.dpo_reference_storage == "memory"
    reference = DTYPE_BYTES[TrainerSpec.from_job(job).reference_dtype] if in_memory else 0
    optimizer = OPTIMIZER_BYTES_PER_PARAM[job.optimizer.name]
    trainer_bpp = 4 + 4 + optimizer + reference + TRAINER_REST_BYTES_PER_PARAM
    serving = DTYPE_BYTES.get(gen.dtype, 4)
    generator_bpp = serving + GENERATOR_REST_BYTES_PER_PARAM
    per_process = {
        "controller": FIXED_BYTES["controller"],
        "trainer": int(FIXED_BYTES["trainer"] + trainer_bpp * shard),
        "generator": int(FIXED_BYTES["generator"] + generator_bpp * params),
        "replay": FIXED_BYTES["replay"],
    }
    colocated = mesh.placement == "colocated"
    processes = {"controller": 1, "trainer": trainer_procs,
                 "generator": 0 if colocated else mesh.generator_procs,
                 "replay": 1 if replay else 0}
    if colocated:  # a generator in each trainer process
        per_process["trainer"] += per_process["generator"] - FIXED_BYTES["generator"]
    # the ring the controller's TopologySync keeps
    slots = sync_keep(job.trainer.max_staleness) + 1
    terms = {"trainer": f"{trainer_bpp:.1f} B/param of a 1/{trainer_procs} shard + fixed",
             "generator": f"{generator_bpp:.1f} B/param ({gen.dtype}) + fixed"}
    # serving-dtype slots
    return MemoryEstimate(params, per_process, processes, int(slots * serving * params), terms)


def available() -> tuple[int, int]:
    """(MemAvailable, free bytes of /dev/shm) on this host."""
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    avail = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    st = os.statvfs("/dev/shm")
    return avail, st.f_bavail * st.f_frsize


def check(job: JobConfig, model_dir: str) -> MemoryEstimate | None:
    """Refuse (ValueError naming `[mesh] memory_check`) or warn when `job` does not fit this host's memory;
    None when not checked (`memory_check = "off"`, or a cluster backend)."""
    mode = job.mesh.memory_check
    if mode == "off" or job.mesh.backend != "local":
        return None
    need = estimate(job, parameter_count(model_dir))
    avail, shm_free = available()
    problems = []
    if need.host > avail:
        problems.append(f"≈{need.host / GIB:.1f} GiB on this host, {avail / GIB:.1f} GiB available")
    if need.shm > shm_free:
        problems.append(f"{need.shm / GIB:.1f} GiB of /dev/shm, {shm_free / GIB:.1f} GiB free")
    if problems:
        message = (f"memory: a {need.params / 1e6:.0f}M-parameter model in this recipe needs "
                   f"{' and '.join(problems)} ({need.table()}); set [mesh] memory_check = \"warn\" to run anyway, "
                   f"or shrink the recipe (mesh.trainer_procs, generator.dtype, trainer.max_staleness, "
                   f"optimizer.name, loss.beta)")
        if mode == "refuse":
            raise ValueError(message)
        logger.warning(message)
    return need
