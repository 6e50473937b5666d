"""HF checkpoints (safetensors + config.json) in and out of TorchTitan models.

Weight names and layouts are converted by TorchTitan's own state-dict adapters
(`ModelSpec.state_dict_adapter`); this module adds the file handling around
them: reading (sharded) safetensors directories, checking that every weight the
model needs arrived, writing byte-deterministic safetensors, and deriving the
HF `config.json` from a TorchTitan model config (`titan_ext.hf_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

# TorchTitan-only state with no HF counterpart: the aux-loss-free load-balancing
# bias of MoE routers. Loading an HF checkpoint leaves it at its init (zeros).
_TITAN_ONLY_SUFFIXES = ("expert_bias_E",)

SAFETENSORS_INDEX = "model.safetensors.index.json"


def state_dict_adapter_class(model: torch.nn.Module) -> type:
    """TorchTitan's HF state-dict adapter class for `model` (by model class)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter
    from torchtitan.models.kimi_k2_7.model import KimiK25Model
    from torchtitan.models.kimi_k2_7.state_dict_adapter import KimiK25StateDictAdapter
    from torchtitan.models.llama3 import Llama3Model, Llama3StateDictAdapter
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    # Most specific first: KimiK25Model subclasses DeepSeekV3Model.
    adapters = (
        (KimiK25Model, KimiK25StateDictAdapter),
        (DeepSeekV3Model, DeepSeekV3StateDictAdapter),
        (Qwen3Model, Qwen3StateDictAdapter),
        (Llama3Model, Llama3StateDictAdapter),
    )
    for model_cls, adapter_cls in adapters:
        if isinstance(model, model_cls):
            return adapter_cls
    raise TypeError(f"no HF state-dict adapter known for {type(model).__name__}")


def make_adapter(model: torch.nn.Module, hf_dir: str | Path | None = None) -> Any:
    """An adapter instance for `model` (reads the shard index in `hf_dir` when present)."""
    sharded = hf_dir is not None and (Path(hf_dir) / SAFETENSORS_INDEX).is_file()
    return state_dict_adapter_class(model)(model.config, str(hf_dir) if sharded else None)


def safetensors_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of an HF checkpoint directory (single file or sharded with an index)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
    return [hf_dir / name for name in names]


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory."""
    state_dict: dict[str, torch.Tensor] = {}
    for path in safetensors_files(hf_dir):
        state_dict.update(load_file(path))
    return state_dict


def _full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with DTensors gathered to full tensors (collective, same order on all ranks)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()
    }


def titan_to_hf_state_dict(model: torch.nn.Module, adapter: Any = None) -> dict[str, torch.Tensor]:
    """HF-named, contiguous tensors for `model` (gathered when sharded)."""
    adapter = adapter or make_adapter(model)
    hf_state_dict = adapter.to_hf(_full_state_dict(model))
    return {k: v.detach().contiguous() for k, v in hf_state_dict.items()}


def load_hf_into_titan(model: torch.nn.Module, hf_dir: str | Path, adapter: Any = None) -> None:
    """Load an HF safetensors checkpoint directory into a plain or sharded TorchTitan model.

    Sharded means FSDP2 / HSDP / expert-parallel (TorchTitan's order: build on
    meta, parallelize, materialise, then load), possibly activation-checkpoint
    wrapped; the call is then collective. See `load_hf_state_dict`.
    """
    adapter = adapter or make_adapter(model, hf_dir)
    load_hf_state_dict(model, read_hf_state_dict(hf_dir), str(hf_dir), adapter)


def load_hf_state_dict(
    model: torch.nn.Module, hf_state_dict: dict[str, torch.Tensor], source: str, adapter: Any = None
) -> None:
    """Load HF-named full tensors into a TorchTitan model (`source` names them in errors).

    Every rank lays each full tensor out like the model's own state-dict entry
    (`distribute_tensor` with that mesh and those placements), so TorchTitan's
    fused-QKV load hook receives DTensors. Every weight must be present except
    TorchTitan-only buffers; missing, unexpected or mis-shaped weights raise a
    `ValueError` that names them, before anything is copied.
    """
    adapter = adapter or make_adapter(model)
    try:
        state_dict = adapter.from_hf(hf_state_dict)
    except (AssertionError, KeyError, StopIteration, RuntimeError) as e:
        raise ValueError(
            f"HF checkpoint {source} cannot be converted for {type(model).__name__} "
            f"({type(e).__name__}: {e}); is it a checkpoint of this flavour?"
        ) from e
    current = model.state_dict()  # one call: on sharded models the fused-QKV hook gathers
    missing = sorted(k for k in current.keys() - state_dict.keys() if not k.endswith(_TITAN_ONLY_SUFFIXES))
    unexpected = sorted(state_dict.keys() - current.keys())
    if missing or unexpected:
        raise ValueError(
            f"HF checkpoint {source} does not match {type(model).__name__}: "
            f"missing {missing[:8]}{'…' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'…' if len(unexpected) > 8 else ''}"
        )
    for key, value in current.items():
        if key in state_dict and tuple(state_dict[key].shape) != tuple(value.shape):
            raise ValueError(
                f"HF checkpoint {source}: {key} has shape {tuple(state_dict[key].shape)}, "
                f"the model expects {tuple(value.shape)}"
            )
    for key, value in state_dict.items():
        target = current[key]
        value = value.to(device=target.device, dtype=target.dtype)
        if isinstance(target, DTensor):  # shard the full tensor like the model's own entry
            value = distribute_tensor(value, target.device_mesh, target.placements)
        state_dict[key] = value
    model.load_state_dict(state_dict, strict=False)


def save_hf(
    model: torch.nn.Module,
    out_dir: str | Path,
    hf_config: Any = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` as an HF directory: `config.json` + `model.safetensors`.

    hf_config: a transformers `PretrainedConfig`; derived with `hf_config_for`
    when omitted; written complete for serving (`serving_config_json`). dtype: cast the weights (e.g. bf16 for serving). The output
    is byte-identical for identical weights. Call on every rank of a sharded
    model (the gather is collective); only rank 0 writes.
    """
    out_dir = Path(out_dir)
    tensors = titan_to_hf_state_dict(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return out_dir
    from titan_ext.hf_config import hf_config_for, serving_config_json

    hf_config = hf_config if hf_config is not None else hf_config_for(model.config)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu() for k, v in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    saved_dtype = next(iter(tensors.values())).dtype
    (out_dir / "config.json").write_text(serving_config_json(hf_config, saved_dtype))
    return out_dir
