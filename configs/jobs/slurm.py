"""A Monarch `SlurmJob` for composer-mesh: one trainer mesh and one generator mesh of GPU nodes.

    monarch apply configs.jobs.slurm.job
    monarch exec composer-mesh train configs/qwen3_8b.toml

Sizes and placement come from environment variables so one file serves many
allocations (defaults in brackets): COMPOSER_TRAINER_NODES [2],
COMPOSER_GENERATOR_NODES [1], COMPOSER_GPUS_PER_NODE [8],
COMPOSER_SLURM_PARTITION, COMPOSER_SLURM_ACCOUNT, COMPOSER_SLURM_QOS,
COMPOSER_SLURM_TIME ["24:00:00"], COMPOSER_PYTHON [python]. The mesh names
match the roles `mesh/placement.py` asks the job for.
"""

from __future__ import annotations

import os

from monarch.job import SlurmJob

from configs.jobs import env_int


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
) -> SlurmJob:
    """Trainer and generator meshes, one Monarch process per node (it spawns one proc per GPU)."""
    if trainer_nodes < 1 or generator_nodes < 1 or gpus_per_node < 1:
        raise ValueError("trainer_nodes, generator_nodes and gpus_per_node must be >= 1")
    return SlurmJob(
        meshes={"trainer": trainer_nodes, "generator": generator_nodes},
        python_exe=python_exe,
        job_name="composer-mesh",
        gpus_per_node=gpus_per_node,
        ntasks_per_node=1,
        exclusive=True,
        partition=partition,
        account=account,
        qos=qos,
        time_limit=time_limit,
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
)
