"""[diloco]: torchft DiLoCo / Streaming DiLoCo across trainer replica groups."""

from __future__ import annotations

from dataclasses import dataclass

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class DiLoCoConfig:
    enabled: bool = option(False, doc="Run the trainer as DiLoCo replica groups under a torchft lighthouse.")
    replica_groups: int = option(2, ge=1, doc="Number of trainer replica groups (each its own FSDP/HSDP mesh).")
    procs_per_group: int = option(1, ge=1, doc="Trainer processes per replica group (FSDP inside the group).")
    inner_steps: int = option(8, ge=1, doc="H: inner optimizer steps between outer syncs.")
    outer_lr: float = option(0.7, gt=0.0, doc="Outer SGD learning rate.")
    outer_momentum: float = option(0.9, ge=0.0, lt=1.0, doc="Outer SGD momentum.")
    nesterov: bool = option(True, doc="Nesterov momentum for the outer step (no effect at outer_momentum = 0).")
    fragments: int = option(1, ge=1, doc="Streaming DiLoCo: model fragments synced at staggered steps (divides inner_steps).")
    fragment_delay: int = option(0, ge=0, doc="Streaming DiLoCo: tau, steps a fragment's sync overlaps compute (< inner_steps / fragments).")
    fragment_update_alpha: float = option(0.0, ge=0.0, le=1.0, doc="Mix of local and global weights after a fragment sync.")
    quantize_pseudograd: bool = option(False, doc="Send pseudo-gradients quantized (torchft's FP8 kernels: CUDA only).")
    min_replicas: int = option(1, ge=1, doc="Quorum size below which the outer step waits.")
    join_timeout_ms: int = option(2000, ge=0, doc="Lighthouse: how long a quorum waits for the previous members to rejoin.")
    heartbeat_timeout_ms: int = option(3000, gt=0, doc="Lighthouse: a replica silent this long is dropped from the quorum.")
    timeout_s: float = option(60.0, gt=0.0, doc="torchft Manager: collectives, commit and recovery transfers.")
    quorum_timeout_s: float = option(600.0, gt=0.0, doc="torchft Manager: wait for a quorum (longer than H inner steps).")

    def __post_init__(self) -> None:
        if self.inner_steps % self.fragments:
            raise ValueError(f"fragments ({self.fragments}) must divide inner_steps ({self.inner_steps})")
        if self.fragment_delay >= self.inner_steps // self.fragments:
            raise ValueError(
                f"fragment_delay ({self.fragment_delay}) must be < inner_steps / fragments "
                f"({self.inner_steps // self.fragments}): a fragment syncs before it is reduced again"
            )
        if self.min_replicas > self.replica_groups:
            raise ValueError(f"min_replicas ({self.min_replicas}) > replica_groups ({self.replica_groups}): no quorum could form")
