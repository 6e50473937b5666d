"""[diloco]: torchft DiLoCo / Streaming DiLoCo across trainer replica groups."""

from __future__ import annotations

from dataclasses import dataclass

from configs.fields import option


@dataclass(frozen=True)
class DiLoCoConfig:
    enabled: bool = option(False, doc="Run the trainer as DiLoCo replica groups under a torchft lighthouse.")
    replica_groups: int = option(2, ge=1, doc="Number of trainer replica groups (each its own FSDP/HSDP mesh).")
    inner_steps: int = option(8, ge=1, doc="H: inner optimizer steps between outer syncs.")
    outer_lr: float = option(0.7, gt=0.0, doc="Outer SGD learning rate.")
    outer_momentum: float = option(0.9, ge=0.0, lt=1.0, doc="Outer SGD momentum.")
    nesterov: bool = option(True, doc="Nesterov momentum for the outer step.")
    fragments: int = option(1, ge=1, doc="Streaming DiLoCo: model fragments synced at staggered steps.")
    fragment_delay: int = option(0, ge=0, doc="Streaming DiLoCo: tau, steps a fragment's sync overlaps compute (< H / fragments).")
    fragment_update_alpha: float = option(0.0, ge=0.0, le=1.0, doc="Mix of local and global weights after a fragment sync.")
    quantize_pseudograd: bool = option(False, doc="Send pseudo-gradients quantized.")
    min_replicas: int = option(1, ge=1, doc="Quorum size below which the outer step waits.")
