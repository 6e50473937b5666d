"""[parallelism]: how the trainer mesh shards the model (FSDP2 / HSDP / expert parallel)."""

from __future__ import annotations

from dataclasses import dataclass

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class ParallelismConfig:
    dp_replicate: int = option(1, ge=1, doc="HSDP replica groups (outer data-parallel dim).")
    dp_shard: int = option(-1, ge=-1, doc="FSDP shard degree inside a replica group; -1 = all remaining ranks.")
    ep: int = option(1, ge=1, doc="Expert-parallel degree for MoE models (experts on the [dp_replicate, efsdp, ep] mesh).")
    activation_checkpoint: str = option(
        "none", choices=("none", "full", "selective"), doc="Activation checkpointing mode per transformer block."
    )
    param_dtype: str = option("float32", choices=("float32", "bfloat16"), doc="FSDP mixed-precision parameter dtype.")
    reduce_dtype: str = option("float32", choices=("float32", "bfloat16"), doc="FSDP gradient reduction dtype.")
    reshard_after_forward: bool = option(True, doc="FSDP2 reshard_after_forward (trade memory for all-gathers).")
