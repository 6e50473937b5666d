"""HF `config.json` files: reading, checking what TorchTitan can reproduce, and writing them for serving.

`read_checkpoint_config` loads a checkpoint's config.json with transformers;
`check_supported` refuses by name every field whose value TorchTitan cannot
honour (`UnsupportedHFConfig`), never silently dropping one;
`architecture_signature` reduces a Qwen3 / Qwen3-MoE config to the fields
that decide the function the model computes, so an explicit flavour and a
checkpoint can be compared field by field; `serving_config_json` writes one
complete for vLLM. Imports transformers only (no TorchTitan): the vLLM
engine and the API use it. `titan_ext.hf.derive` maps configs to TorchTitan
model configs and back.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM

# config.json model_type -> TorchTitan family, and the RoPE types that family reproduces.
HF_MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3"}
_ROPE_TYPES = {
    # CosSinRoPE: no llama scaling; its YaRN omits HF's attention factor
    "qwen3": ("default",),
    # ComplexRoPE with "llama" scaling
    "llama3": ("default", "llama3"),
}


class UnsupportedHFConfig(ValueError):
    """A config.json field whose value the TorchTitan model cannot reproduce."""


def read_checkpoint_config(hf_path: str) -> Any:
    """The transformers config of an HF checkpoint directory (`FileNotFoundError` naming it when absent;
    `ValueError` naming the file and transformers' reason when transformers refuses it)."""
    if not (Path(hf_path) / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_path {hf_path}: no config.json there")
    try:
        return AutoConfig.from_pretrained(hf_path)
    # transformers' checks: ValueError, KeyError, TypeError, its strict-dataclass validators
    except Exception as e:
        if not isinstance(e, (ValueError, KeyError, TypeError)) and "Validation" not in type(e).__name__:
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"model.hf_path {hf_path}/config.json: transformers refuses it "
                         f"({type(e).__name__}: {reason})") from e


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """transformers >= 5 folds legacy `rope_theta` / `rope_scaling` into `rope_parameters`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    # older transformers: separate attributes
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10_000.0)
        params.update(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def moe_layer_ids(hf_config: Any) -> list[int]:
    """Decoder layers that are sparse, by HF Qwen3-MoE's rule (`decoder_sparse_step`, `mlp_only_layers`)."""
    num_experts = getattr(hf_config, "num_experts", 0) or 0
    if hf_config.model_type != "qwen3_moe" or num_experts == 0:
        return []
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [i for i in range(hf_config.num_hidden_layers) if i not in dense_only and (i + 1) % step == 0]


def titan_family(hf_config: Any, source: str = "config.json") -> str:
    """The TorchTitan family a config.json is derived into (refuses other model types by name)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedHFConfig(f"{source}: model_type = {model_type!r} is not supported (derivable model "
                                  f"types: {', '.join(HF_MODEL_TYPES)}; other families need a named flavour)")
    return HF_MODEL_TYPES[model_type]


def check_supported(hf_config: Any, source: str = "config.json") -> None:
    """Raise `UnsupportedHFConfig` naming the first field the TorchTitan model cannot honour."""

    def refuse(field: str, value: Any, why: str) -> None:
        raise UnsupportedHFConfig(f"{source}: {field} = {value!r} is not supported ({why})")

    family = titan_family(hf_config, source)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        refuse("hidden_act", hf_config.hidden_act, "TorchTitan's FFN is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, field, False):
            refuse(field, True, "TorchTitan's projections have no bias")
    if getattr(hf_config, "attention_dropout", 0.0):
        refuse("attention_dropout", hf_config.attention_dropout, "TorchTitan's attention has no dropout")
    layer_types = getattr(hf_config, "layer_types", None) or []
    windowed = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if windowed:
        refuse(f"layer_types[{windowed[0]}]", layer_types[windowed[0]],
               "sliding-window attention (use_sliding_window / sliding_window / max_window_layers) is not built")
    if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
        refuse("use_sliding_window", True, "sliding-window attention is not built")
    rope = rope_parameters(hf_config)
    if rope["rope_type"] not in _ROPE_TYPES[family]:
        refuse("rope_parameters.rope_type", rope["rope_type"],
               f"TorchTitan's {family} RoPE reproduces {', '.join(_ROPE_TYPES[family])}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("rope_parameters.partial_rotary_factor", rope["partial_rotary_factor"], "RoPE covers the whole head")
    head_dim = getattr(hf_config, "head_dim", None)
    if family == "llama3" and head_dim and head_dim != hf_config.hidden_size // hf_config.num_attention_heads:
        refuse("head_dim", head_dim, "TorchTitan's Llama3 heads are hidden_size / num_attention_heads wide")
    if moe_layer_ids(hf_config) and hf_config.num_experts_per_tok > hf_config.num_experts:
        refuse("num_experts_per_tok", hf_config.num_experts_per_tok, f"more than num_experts {hf_config.num_experts}")


def architecture_signature(hf_config: Any) -> dict[str, Any]:
    """The fields of a Qwen3 / Qwen3-MoE HF config that decide the function the model computes.

    Normalised: the MoE layout as the list of sparse layers (not its two
    spellings), the dense FFN width only when a dense layer exists.
    """
    rope = rope_parameters(hf_config)
    moe_ids = moe_layer_ids(hf_config)
    sig: dict[str, Any] = {
        "model_type": hf_config.model_type,
        "vocab_size": hf_config.vocab_size,
        "hidden_size": hf_config.hidden_size,
        "num_hidden_layers": hf_config.num_hidden_layers,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": hf_config.num_key_value_heads or hf_config.num_attention_heads,
        "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        "rope_theta": float(rope["rope_theta"]),
        "rope_parameters.rope_type": rope["rope_type"],
        "rms_norm_eps": float(hf_config.rms_norm_eps),
        "tie_word_embeddings": bool(hf_config.tie_word_embeddings),
        "hidden_act": getattr(hf_config, "hidden_act", "silu"),
        "attention_bias": bool(getattr(hf_config, "attention_bias", False)),
        "moe layers (decoder_sparse_step / mlp_only_layers)": moe_ids,
    }
    if len(moe_ids) < hf_config.num_hidden_layers:
        sig["intermediate_size"] = hf_config.intermediate_size
    if moe_ids:
        sig.update(
            num_experts=hf_config.num_experts,
            num_experts_per_tok=hf_config.num_experts_per_tok,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            norm_topk_prob=bool(hf_config.norm_topk_prob),
        )
    return sig


def causal_lm_architecture(hf_config: Any) -> str:
    """The transformers causal-LM class name of a config (what `architectures` should list)."""
    if getattr(hf_config, "architectures", None):
        return hf_config.architectures[0]
    return AutoModelForCausalLM._model_mapping[type(hf_config)].__name__


def serving_config_json(hf_config: Any, dtype: Any) -> str:
    """config.json text as `save_pretrained` writes it, completed for serving.

    `architectures` filled in when missing (without it vLLM resolves the base
    model and serves it as a pooling model); `dtype` plus its pre-5.0 spelling
    `torch_dtype` for older transformers / vLLM readers.
    """
    config = copy.deepcopy(hf_config)
    config.architectures = [causal_lm_architecture(config)]
    config.dtype = dtype
    fields = json.loads(config.to_json_string(use_diff=True))
    fields["torch_dtype"] = fields["dtype"]
    return json.dumps(fields, indent=2, sort_keys=True) + "\n"
