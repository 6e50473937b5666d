"""HF checkpoints (safetensors + config.json) in and out of TorchTitan models.

Weight names and layouts are converted by TorchTitan's own state-dict adapters
(`ModelSpec.state_dict_adapter`); this module adds the file handling around
them: reading (sharded) safetensors directories, checking that every weight the
model needs arrived, writing byte-deterministic safetensors, and deriving the
HF `config.json` from a TorchTitan model config (Qwen3 dense and Qwen3-MoE,
which are the families the tiny assets and the Qwen3 flavours use).
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


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (single file or sharded with an index)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
    state_dict: dict[str, torch.Tensor] = {}
    for name in files:
        state_dict.update(load_file(hf_dir / name))
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
    """Load an HF safetensors checkpoint into a plain or sharded TorchTitan model.

    Sharded means FSDP2 / HSDP / expert-parallel (TorchTitan's order: build on
    meta, parallelize, materialise, then load), possibly activation-checkpoint
    wrapped; the call is then collective. Every rank reads the full tensors and
    lays each one out like the model's own state-dict entry (`distribute_tensor`
    with that mesh and those placements), so TorchTitan's fused-QKV load hook
    receives DTensors. Every weight must be present except TorchTitan-only
    buffers; missing, unexpected or mis-shaped weights raise a `ValueError`
    that names them, before anything is copied.
    """
    adapter = adapter or make_adapter(model, hf_dir)
    hf_state_dict = read_hf_state_dict(hf_dir)
    try:
        state_dict = adapter.from_hf(hf_state_dict)
    except (AssertionError, KeyError, StopIteration, RuntimeError) as e:
        raise ValueError(
            f"HF checkpoint {hf_dir} cannot be converted for {type(model).__name__} "
            f"({type(e).__name__}: {e}); is it a checkpoint of this flavour?"
        ) from e
    current = model.state_dict()  # one call: on sharded models the fused-QKV hook gathers
    missing = sorted(k for k in current.keys() - state_dict.keys() if not k.endswith(_TITAN_ONLY_SUFFIXES))
    unexpected = sorted(state_dict.keys() - current.keys())
    if missing or unexpected:
        raise ValueError(
            f"HF checkpoint {hf_dir} does not match {type(model).__name__}: "
            f"missing {missing[:8]}{'…' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'…' if len(unexpected) > 8 else ''}"
        )
    for key, value in current.items():
        if key in state_dict and tuple(state_dict[key].shape) != tuple(value.shape):
            raise ValueError(
                f"HF checkpoint {hf_dir}: {key} has shape {tuple(state_dict[key].shape)}, "
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
    when omitted. dtype: cast the weights (e.g. bf16 for serving). The output
    is byte-identical for identical weights. Call on every rank of a sharded
    model (the gather is collective); only rank 0 writes.
    """
    out_dir = Path(out_dir)
    tensors = titan_to_hf_state_dict(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return out_dir
    hf_config = hf_config if hf_config is not None else hf_config_for(model.config)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu() for k, v in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    hf_config.to_json_file(out_dir / "config.json")
    return out_dir


def _qwen3_moe_fields(model_config: Any) -> dict[str, Any]:
    moe_layers = [i for i, layer in enumerate(model_config.layers) if layer.moe is not None]
    if not moe_layers:
        return {}
    moe = model_config.layers[moe_layers[0]].moe
    router = moe.router
    if moe.shared_experts is not None or router.score_func != "softmax" or router.route_scale != 1.0:
        raise ValueError("this Qwen3 MoE config (shared experts / sigmoid / scaled routing) has no HF Qwen3-MoE equivalent")
    dense_layers = [i for i in range(len(model_config.layers)) if i not in moe_layers]
    return dict(
        num_experts=moe.num_experts,
        num_experts_per_tok=router.top_k,
        norm_topk_prob=router.route_norm,
        moe_intermediate_size=moe.routed_experts.inner_experts.hidden_dim,
        decoder_sparse_step=1,
        mlp_only_layers=dense_layers,
    )


def hf_config_for(model_config: Any, **token_ids: Any) -> Any:
    """The transformers config of the same model as a TorchTitan Qwen3 config.

    token_ids: bos_token_id / eos_token_id / pad_token_id to record.
    Dense configs give a `Qwen3Config`, MoE configs a `Qwen3MoeConfig`.
    """
    from torchtitan.models.qwen3 import Qwen3Model
    from transformers import Qwen3Config, Qwen3MoeConfig

    if not isinstance(model_config, Qwen3Model.Config):
        raise TypeError(f"hf_config_for derives Qwen3 configs only, got {type(model_config).__qualname__}")
    attn = model_config.first_attention
    rope = attn.rope
    if rope.scaling not in (None, "none"):
        raise ValueError(f"RoPE scaling {rope.scaling!r} is not mapped to an HF config")
    dense = next((layer.feed_forward for layer in model_config.layers if layer.feed_forward is not None), None)
    moe_fields = _qwen3_moe_fields(model_config)
    common = dict(
        vocab_size=model_config.vocab_size,
        hidden_size=model_config.dim,
        num_hidden_layers=len(model_config.layers),
        num_attention_heads=attn.n_heads,
        num_key_value_heads=attn.n_kv_heads or attn.n_heads,
        head_dim=attn.head_dim or model_config.dim // attn.n_heads,
        max_position_embeddings=rope.max_seq_len,
        rms_norm_eps=model_config.norm.eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope.theta)},
        tie_word_embeddings=model_config.enable_weight_tying,
        attention_bias=False,
        hidden_act="silu",
        dtype="float32",
        **token_ids,
    )
    if moe_fields:
        intermediate = dense.w1.out_features if dense is not None else moe_fields["moe_intermediate_size"]
        return Qwen3MoeConfig(intermediate_size=intermediate, **moe_fields, **common)
    return Qwen3Config(intermediate_size=dense.w1.out_features, **common)
