"""HF checkpoints into TorchTitan models: reading (sharded) safetensors directories and loading them.

Weight names and layouts are converted by TorchTitan's own state-dict adapters
(`titan_ext.hf.adapters`); this module adds the file handling around them:
reading safetensors directories lazily (`SafetensorsDir`), checking that every
weight the model needs arrived, and loading one decoder layer at a time into a
plain or sharded model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor

from composer_mesh.titan_ext.hf.adapters import SAFETENSORS_INDEX, make_adapter, model_units

# TorchTitan-only state with no HF counterpart: the aux-loss-free load-balancing
# bias of MoE routers. Loading an HF checkpoint leaves it at its init (zeros).
_TITAN_ONLY_SUFFIXES = ("expert_bias_E",)


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
    """All tensors of an HF checkpoint directory, in memory (tests and small models; loading streams)."""
    state_dict: dict[str, torch.Tensor] = {}
    for path in safetensors_files(hf_dir):
        state_dict.update(load_file(path))
    return state_dict


# safetensors dtype codes -> torch dtypes (the header's "dtype" field)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class SafetensorsDir(Mapping[str, torch.Tensor]):
    """The tensors of an HF checkpoint directory, each read from its file only when asked for.

    Loading goes through this instead of a dict of every tensor, so a model is
    never held twice (once as the file's tensors, once as parameters): at most
    one layer's tensors are in memory beside the model. `meta(name)` gives shape
    and dtype from the file header without reading data.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self._files: dict[str, Any] = {}
        for path in safetensors_files(hf_dir):
            handle = safe_open(str(path), framework="pt")
            for name in handle.keys():
                self._files[name] = handle

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._files[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def meta(self, name: str) -> torch.Tensor:
        piece = self._files[name].get_slice(name)
        dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
        if dtype is None:
            raise ValueError(f"{name}: safetensors dtype {piece.get_dtype()} is not supported")
        return torch.empty(piece.get_shape(), dtype=dtype, device="meta")


def _unit_of(titan_key: str) -> str:
    head, _, rest = titan_key.partition(".")
    return f"layers.{rest.partition('.')[0]}" if head == "layers" else head


def _hf_groups(names: list[str]) -> list[list[str]]:
    """HF names grouped by decoder layer (a layer's QKV and experts convert together), non-layer names first."""
    groups: dict[int, list[str]] = {}
    for name in sorted(names):
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        groups.setdefault(int(m.group(1)) if m else -1, []).append(name)
    return [groups[k] for k in sorted(groups)]


def load_hf_into_titan(model: torch.nn.Module, hf_dir: str | Path, adapter: Any = None) -> None:
    """Load an HF safetensors checkpoint directory into a plain or sharded TorchTitan model.

    Sharded means FSDP2 / HSDP / expert-parallel (TorchTitan's order: build on
    meta, parallelize, materialise, then load), possibly activation-checkpoint
    wrapped; the call is then collective. Streams one decoder layer at a time
    (`SafetensorsDir`); see `load_hf_state_dict`.
    """
    adapter = adapter or make_adapter(model, hf_dir)
    load_hf_state_dict(model, SafetensorsDir(hf_dir), str(hf_dir), adapter)


def _convert(adapter: Any, hf_state_dict: dict[str, torch.Tensor], source: str, model: torch.nn.Module) -> dict:
    """`adapter.from_hf` with its errors named; also on one layer's group of a tied-embedding model (the adapter
    asserts the embedding is present whenever lm_head is absent: a placeholder head is converted and dropped)."""
    placeholder = (getattr(adapter.model_config, "enable_weight_tying", False)
                   and not {"lm_head.weight", "model.embed_tokens.weight"} & hf_state_dict.keys())
    try:
        if placeholder:
            converted = adapter.from_hf({**hf_state_dict, "lm_head.weight": torch.empty(0, device="meta")})
            del converted[adapter.from_hf_map["lm_head.weight"]]
            return converted
        return adapter.from_hf(hf_state_dict)
    except (AssertionError, KeyError, StopIteration, RuntimeError) as e:
        raise ValueError(
            f"HF checkpoint {source} cannot be converted for {type(model).__name__} "
            f"({type(e).__name__}: {e}); is it a checkpoint of this flavour?"
        ) from e


def load_hf_state_dict(
    model: torch.nn.Module, hf_state_dict: Mapping[str, torch.Tensor], source: str, adapter: Any = None
) -> None:
    """Load HF-named full tensors into a TorchTitan model (`source` names them in errors).

    First every name and shape is checked on the meta device (from the file
    headers when `hf_state_dict` is a `SafetensorsDir`): every weight must be
    present except TorchTitan-only buffers; missing, unexpected or mis-shaped
    weights raise a `ValueError` that names them, before anything is copied.
    Then one decoder layer at a time is read, converted by the adapter, laid
    out like the model's own state-dict entry (`distribute_tensor` with that
    mesh and those placements, so TorchTitan's fused-QKV load hook receives
    DTensors) and copied in. Collective on sharded models (same order on all ranks).
    """
    adapter = adapter or make_adapter(model)
    meta_of = getattr(hf_state_dict, "meta", None) or (
        lambda k: torch.empty(hf_state_dict[k].shape, dtype=hf_state_dict[k].dtype, device="meta"))
    # one unit's state dict at a time: on sharded models the fused-QKV hook gathers
    expected = {
        key: tuple(value.shape)
        for prefix, unit in model_units(model)
        for key, value in unit.state_dict(prefix=f"{prefix}.").items()
    }
    converted = _convert(adapter, {k: meta_of(k) for k in hf_state_dict}, source, model)
    missing = sorted(k for k in expected.keys() - converted.keys() if not k.endswith(_TITAN_ONLY_SUFFIXES))
    unexpected = sorted(converted.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"HF checkpoint {source} does not match {type(model).__name__}: "
            f"missing {missing[:8]}{'…' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'…' if len(unexpected) > 8 else ''}"
        )
    for key, value in converted.items():
        if tuple(value.shape) != expected[key]:
            raise ValueError(
                f"HF checkpoint {source}: {key} has shape {tuple(value.shape)}, the model expects {expected[key]}"
            )
    units = dict(model_units(model))
    for names in _hf_groups(list(hf_state_dict)):
        _load_group(model, units, _convert(adapter, {k: hf_state_dict[k] for k in names}, source, model), source)


def _load_group(model: torch.nn.Module, units: dict[str, torch.nn.Module], state_dict: dict[str, torch.Tensor],
                source: str) -> None:
    """Copy one converted group (TorchTitan names) into `model`; its tensors are freed on return."""
    targets: dict[str, torch.Tensor] = {}
    for prefix in sorted({_unit_of(k) for k in state_dict}):
        targets.update(units[prefix].state_dict(prefix=f"{prefix}."))
    for key in sorted(state_dict):
        target = targets[key]
        value = state_dict[key].to(device=target.device, dtype=target.dtype)
        # shard the full tensor like the model's own entry
        if isinstance(target, DTensor):
            value = distribute_tensor(value, target.device_mesh, target.placements)
        state_dict[key] = value
    del targets
    result = model.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"HF checkpoint {source}: {type(model).__name__} did not take {result.unexpected_keys[:8]}")
