"""TorchTitan <-> HF weight names: the state-dict adapters, and HF-named full tensors streamed bucket by bucket.

`make_adapter` picks TorchTitan's own state-dict adapter for a model (fused
QKV split, stacked experts split per expert); `titan_to_hf_state_dict`
converts a whole model at once; `model_units` is the unit of streaming that
loading (`titan_ext.hf.read`) and the buckets below share.

Generators (vLLM, HF) load HF parameter names; the trainer holds TorchTitan
names sharded by FSDP2 / EP. `iter_hf_buckets` walks the model one top-level
unit at a time (embeddings, each transformer block, norm, head), collects
sharded tensors until a bucket's *full* size would pass `bucket_bytes`, then
gathers just that bucket (`DTensor.full_tensor`), renames it with the model's
TorchTitan state-dict adapter (fused QKV split, stacked experts split per
expert) and yields it. No rank ever holds more than one bucket of gathered
weights (plus one block's QKV, which TorchTitan's state-dict hook replicates).

This is the interface the weight-sync path uses: every rank iterates in the
same order (the gathers are collectives) and receives every bucket; which
rank forwards a bucket to which generator is `mesh/`'s business.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

HFBucket = list[tuple[str, torch.Tensor]]
SAFETENSORS_INDEX = "model.safetensors.index.json"


def state_dict_adapter_class(model: torch.nn.Module) -> type:
    """TorchTitan's HF state-dict adapter class for `model` (by model class)."""
    # lazy: the DeepSeek-V3 and Kimi model packages add seconds to an import; only converting a model needs them
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


def model_units(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(prefix, module) for each top-level child, transformer blocks one by one: the unit of streaming."""
    for name, child in model.named_children():
        if name == "layers":
            for block_name, block in child.named_children():
                yield f"layers.{block_name}", block
        else:
            yield name, child


def _full_bytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def iter_hf_buckets(
    model: nn.Module,
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    adapter: Any = None,
) -> Iterator[HFBucket]:
    """Yield `[(hf_name, full tensor), ...]` buckets covering the whole model once.

    bucket_bytes: full-tensor bytes per bucket (a larger single tensor forms its own bucket).
    dtype: cast for the receiver (e.g. bfloat16 for serving); None keeps the parameter dtype.
    Collective on a sharded model: call on every rank and consume every bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    adapter = adapter or make_adapter(model)
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    # tied parameters (embedding = head) appear under two names
    seen: set[int] = set()
    for prefix, unit in model_units(model):
        for key, tensor in unit.state_dict(prefix=f"{prefix}.", keep_vars=True).items():
            # live objects: ids are stable (hook outputs are not)
            if isinstance(tensor, nn.Parameter):
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
            size = _full_bytes(tensor, dtype)
            if pending and pending_bytes + size > bucket_bytes:
                yield _gather_bucket(pending, adapter, dtype)
                pending, pending_bytes = {}, 0
            # clean names: the AC wrapper's state-dict hook strips its prefix
            pending[key] = tensor
            pending_bytes += size
    if pending:
        yield _gather_bucket(pending, adapter, dtype)


def _gather_bucket(pending: dict[str, torch.Tensor], adapter: Any, dtype: torch.dtype | None) -> HFBucket:
    full = {
        key: (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        for key, t in pending.items()
    }
    return [(name, t.to(dtype or t.dtype).contiguous()) for name, t in adapter.to_hf(full).items()]
