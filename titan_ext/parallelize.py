"""`[parallelism]` → TorchTitan meshes and the model's FSDP2 / HSDP / expert-parallel wrapping.

TorchTitan does the work: `ParallelDims` builds the meshes (dense weights on
`[dp_replicate, fsdp]`, routed experts on the separate `[dp_replicate, efsdp,
ep]` mesh) and the model spec's own `parallelize_fn` applies expert parallel,
activation checkpointing and `fully_shard` with the mixed-precision policy.
What this module adds:

- our `ParallelismConfig` → TorchTitan's `ParallelismConfig` / `TrainingConfig`
  / activation-checkpoint config, with `spmd_backend="partial_dtensor"` (the
  classic FSDP2 path; the default `spmd_types` fails under FSDP, PLATFORM_NOTES);
- the mesh device type from `titan_ext.platform` (TorchTitan assumes "cuda"
  when no accelerator is present);
- FSDP2 reduce-scatter that gloo can run (`configure_fsdp_comms`).

Gradients are *summed* over data-parallel ranks (TorchTitan sets FSDP's divide
factor to 1): every loss channel is divided by its global token / pair count,
so the sum is the gradient of the global-batch loss.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Iterator

import torch
import torchtitan.distributed.parallel_dims as pd
from torch import nn
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.config import ParallelismConfig as TitanParallelismConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.protocols.model_spec import ModelSpec

from composer_mesh.configs.sections.parallelism import ParallelismConfig
from composer_mesh.titan_ext.platform import Platform, configure_fsdp_comms


def titan_parallelism(cfg: ParallelismConfig) -> TitanParallelismConfig:
    """TorchTitan's parallelism config for ours (no TP / CP / PP)."""
    return TitanParallelismConfig(
        data_parallel_replicate_degree=cfg.dp_replicate,
        data_parallel_shard_degree=cfg.dp_shard,
        expert_parallel_degree=cfg.ep,
        # "default": blocks reshard after forward, the final norm + LM head group does not
        # (its weight is used right after the forward by the chunked loss).
        fsdp_reshard_after_forward="default" if cfg.reshard_after_forward else "never",
        spmd_backend="partial_dtensor",
    )


def prepare_model_config(model_config, cfg: ParallelismConfig) -> None:
    """Let the model config see the parallelism before `build()` (sets EP sharding plans)."""
    model_config.update_from_config(config=SimpleNamespace(parallelism=titan_parallelism(cfg)))


@contextlib.contextmanager
def _mesh_device(device_type: str) -> Iterator[None]:
    """TorchTitan builds meshes on its module-level `device_type` ("cuda" without a GPU)."""
    saved = pd.device_type
    pd.device_type = device_type
    try:
        yield
    finally:
        pd.device_type = saved


def build_parallel_dims(cfg: ParallelismConfig, world_size: int, platform: Platform) -> ParallelDims:
    """Validated degrees and the built device meshes for `world_size` ranks."""
    dp_shard = cfg.dp_shard if cfg.dp_shard != -1 else world_size // cfg.dp_replicate
    if cfg.dp_replicate * dp_shard != world_size:
        raise ValueError(
            f"parallelism: dp_replicate ({cfg.dp_replicate}) x dp_shard ({cfg.dp_shard}) must equal "
            f"the world size ({world_size})"
        )
    if cfg.ep > 1 and dp_shard % cfg.ep != 0:
        raise ValueError(f"parallelism.ep ({cfg.ep}) must divide dp_shard ({dp_shard}): efsdp = dp_shard / ep")
    dims = ParallelDims(
        dp_replicate=cfg.dp_replicate,
        dp_shard=dp_shard,
        cp=1,
        tp=1,
        pp=1,
        ep=cfg.ep,
        world_size=world_size,
        spmd_backend="partial_dtensor",
    )
    # A process-wide switch TorchTitan's modules read at run time (MoE token dispatch).
    set_spmd_backend("partial_dtensor")
    with _mesh_device(platform.device_type):
        dims.build_mesh()
    return dims


def _activation_checkpoint(mode: str):
    if mode == "full":
        return FullAC.Config()
    if mode == "selective":
        return SelectiveAC.Config()
    return None


def parallelize_model(
    model: nn.Module, spec: ModelSpec, dims: ParallelDims, cfg: ParallelismConfig, platform: Platform
) -> nn.Module:
    """Apply EP, activation checkpointing and FSDP2/HSDP to `model` in place (TorchTitan's plan).

    The model must come from a config passed through `prepare_model_config`.
    Dense parameters end up as DTensors on `dims.get_mesh(dense_mesh_names(dims))`,
    routed experts (EP > 1) on `[dp_replicate, efsdp, ep]`. One rank without
    mixed precision has nothing to shard: the model stays plain (only activation
    checkpointing applies), which also makes it the FSDP-free reference run; no mixed precision means
    `param_dtype` and `reduce_dtype` are the dtype the parameters are stored in (float32, or bfloat16 for a
    frozen bf16 copy).
    """
    ac_config = _activation_checkpoint(cfg.activation_checkpoint)
    stored = str(next(model.parameters()).dtype).removeprefix("torch.")
    if dims.world_size == 1 and cfg.param_dtype == cfg.reduce_dtype == stored:
        if ac_config is not None:
            ac_config.build(dump_folder="").apply(model)
        return model
    training = TrainingConfig(
        mixed_precision_param=cfg.param_dtype,
        mixed_precision_reduce=cfg.reduce_dtype,
    )
    spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=titan_parallelism(cfg),
        compile_config=CompileConfig(enable=False),
        ac_config=ac_config,
        dump_folder="",
    )
    configure_fsdp_comms(model, platform)
    return model


def dense_mesh_names(dims: ParallelDims) -> list[str]:
    """Mesh axes of the dense (non-expert) parameters."""
    return ["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else ["fsdp"]


def expert_mesh_names(dims: ParallelDims) -> list[str]:
    """Mesh axes of the routed experts under expert parallelism."""
    return ["dp_replicate", "efsdp", "ep"] if dims.dp_replicate_enabled else ["efsdp", "ep"]


def loss_group(dims: ParallelDims) -> torch.distributed.ProcessGroup | None:
    """The group over which per-rank loss metrics are reduced (all data-parallel ranks)."""
    mesh = dims.get_optional_mesh("loss")
    return None if mesh is None else mesh.get_group()
