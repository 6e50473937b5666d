"""A Monarch `SlurmJob` for composer-mesh: one trainer mesh and one generator mesh of GPU nodes.

    monarch apply configs.jobs.slurm.job
    monarch exec composer-mesh train configs/qwen3_8b.toml

Sizes and placement come from environment variables so one file serves many
allocations (defaults in brackets): COMPOSER_TRAINER_NODES [2],
COMPOSER_GENERATOR_NODES [1], COMPOSER_GPUS_PER_NODE [8; 0 requests no GPUs,
for CPU nodes], COMPOSER_SLURM_PARTITION, COMPOSER_SLURM_ACCOUNT,
COMPOSER_SLURM_QOS, COMPOSER_SLURM_TIME ["24:00:00"],
COMPOSER_SLURM_START_TIMEOUT [unset: wait for the allocation as long as it
queues; else seconds, then the job is cancelled], COMPOSER_PYTHON [python].
The mesh names match the roles `mesh/placement.py` asks the job for. The job
is a `CompatSlurmJob` (configs/jobs/slurm_compat.py): Monarch's `SlurmJob`
reading Slurm 22.05's `squeue --json` too.
"""

from __future__ import annotations

import os

from composer_mesh.configs.jobs import env_int
from composer_mesh.configs.jobs.slurm_compat import CompatSlurmJob


def build_job(
    trainer_nodes: int = 2,
    generator_nodes: int = 1,
    gpus_per_node: int = 8,
    *,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    time_limit: str = "24:00:00",
    python_exe: str = "python",
    start_timeout_s: int | None = None,
) -> CompatSlurmJob:
    """Trainer and generator meshes, one Monarch process per node (it spawns one proc per GPU);
    `gpus_per_node = 0` requests no GPUs (CPU nodes)."""
    if trainer_nodes < 1 or generator_nodes < 1 or gpus_per_node < 0:
        raise ValueError("trainer_nodes and generator_nodes must be >= 1, gpus_per_node >= 0")
    return CompatSlurmJob(
        meshes={"trainer": trainer_nodes, "generator": generator_nodes},
        python_exe=python_exe,
        job_name="composer-mesh",
        gpus_per_node=gpus_per_node or None,
        ntasks_per_node=1,
        exclusive=True,
        partition=partition,
        account=account,
        qos=qos,
        time_limit=time_limit,
        job_start_timeout=start_timeout_s,
    )


job = build_job(
    env_int("COMPOSER_TRAINER_NODES", 2),
    env_int("COMPOSER_GENERATOR_NODES", 1),
    env_int("COMPOSER_GPUS_PER_NODE", 8),
    partition=os.environ.get("COMPOSER_SLURM_PARTITION") or None,
    account=os.environ.get("COMPOSER_SLURM_ACCOUNT") or None,
    qos=os.environ.get("COMPOSER_SLURM_QOS") or None,
    time_limit=os.environ.get("COMPOSER_SLURM_TIME", "24:00:00"),
    python_exe=os.environ.get("COMPOSER_PYTHON", "python"),
    start_timeout_s=env_int("COMPOSER_SLURM_START_TIMEOUT", 0) or None,
)
