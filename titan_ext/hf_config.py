"""HF `config.json` <-> TorchTitan model configs, for Qwen3 dense, Qwen3-MoE and Llama.

Two directions:

- `titan_config_from_hf(hf_config)`: the TorchTitan `Qwen3Model.Config` /
  `Llama3Model.Config` of a checkpoint, from its config.json alone (layers,
  widths, heads, head_dim, RoPE and its llama3 scaling, norms, tying, vocab,
  MoE layout). Every field whose value TorchTitan cannot honour is refused by
  name (`UnsupportedHFConfig`), never silently dropped.
- `hf_config_for(titan_config)`: the transformers config of a TorchTitan
  Qwen3 config (what the tiny assets and HF exports write).

`architecture_signature` reduces either side to the fields that decide the
function the model computes, so an explicit flavour and a checkpoint can be
compared field by field.
"""

from __future__ import annotations

from typing import Any

# config.json model_type -> TorchTitan family, and the RoPE types that family reproduces.
HF_MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3"}
_ROPE_TYPES = {
    "qwen3": ("default",),  # CosSinRoPE: no llama scaling; its YaRN omits HF's attention factor
    "llama3": ("default", "llama3"),  # ComplexRoPE with "llama" scaling
}


class UnsupportedHFConfig(ValueError):
    """A config.json field whose value the TorchTitan model cannot reproduce."""


def read_checkpoint_config(hf_path: str) -> Any:
    """The transformers config of an HF checkpoint directory (`FileNotFoundError` naming it when absent;
    `ValueError` naming the file and transformers' reason when transformers refuses it)."""
    from pathlib import Path

    from transformers import AutoConfig

    if not (Path(hf_path) / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_path {hf_path}: no config.json there")
    try:
        return AutoConfig.from_pretrained(hf_path)
    except Exception as e:  # transformers' checks: ValueError, KeyError, TypeError, its strict-dataclass validators
        if not isinstance(e, (ValueError, KeyError, TypeError)) and "Validation" not in type(e).__name__:
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"model.hf_path {hf_path}/config.json: transformers refuses it "
                         f"({type(e).__name__}: {reason})") from e


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """transformers >= 5 folds legacy `rope_theta` / `rope_scaling` into `rope_parameters`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in params:  # older transformers: separate attributes
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10_000.0)
        params.update(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _moe_layer_ids(hf_config: Any) -> list[int]:
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
    rope = _rope_parameters(hf_config)
    if rope["rope_type"] not in _ROPE_TYPES[family]:
        refuse("rope_parameters.rope_type", rope["rope_type"],
               f"TorchTitan's {family} RoPE reproduces {', '.join(_ROPE_TYPES[family])}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("rope_parameters.partial_rotary_factor", rope["partial_rotary_factor"], "RoPE covers the whole head")
    head_dim = getattr(hf_config, "head_dim", None)
    if family == "llama3" and head_dim and head_dim != hf_config.hidden_size // hf_config.num_attention_heads:
        refuse("head_dim", head_dim, "TorchTitan's Llama3 heads are hidden_size / num_attention_heads wide")
    if _moe_layer_ids(hf_config) and hf_config.num_experts_per_tok > hf_config.num_experts:
        refuse("num_experts_per_tok", hf_config.num_experts_per_tok, f"more than num_experts {hf_config.num_experts}")


def titan_config_from_hf(hf_config: Any, attn_backend: str = "flex", source: str = "config.json") -> Any:
    """The TorchTitan model config computing the same function as `hf_config` (checked first).

    Built with TorchTitan's own layer builders for the family; every RMSNorm
    gets the checkpoint's epsilon.
    """
    from torchtitan.models.common.nn_modules import RMSNorm

    check_supported(hf_config, source)
    build = _llama_config if titan_family(hf_config) == "llama3" else _qwen3_config
    config = build(hf_config, attn_backend)
    for _, norm, _, _ in config.traverse(RMSNorm.Config):
        norm.eps = float(hf_config.rms_norm_eps)
    return config


def _qwen3_config(c: Any, attn_backend: str) -> Any:
    """Qwen3 / Qwen3-MoE: fused QKV, qk-norm, SwiGLU or softmax top-k MoE, per layer as HF decides.

    MoE routers get no load-balancing bias (HF Qwen3-MoE has none), so routing is HF's.
    """
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    D, V, n_layers = c.hidden_size, c.vocab_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or D // c.num_attention_heads
    rope = _rope_parameters(c)
    attention = dict(
        n_layers=n_layers,
        dim=D,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=head_dim,
        attn_backend=attn_backend,
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=c.max_position_embeddings, theta=float(rope["rope_theta"])),
    )
    moe_ids = set(_moe_layer_ids(c))
    dense = qwen3._build_qwen3_layers(hidden_dim=c.intermediate_size, **attention) if len(moe_ids) < n_layers else []
    sparse = []
    if moe_ids:
        sparse = qwen3._build_qwen3_moe_layers(
            moe_hidden_dim=c.moe_intermediate_size,
            num_experts=c.num_experts,
            top_k=c.num_experts_per_tok,
            moe_comm_backend="standard",
            **attention,
        )
        for layer in sparse:
            layer.moe.load_balance_coeff = None
            layer.moe.router.route_norm = bool(c.norm_topk_prob)
    tied = bool(c.tie_word_embeddings)
    return qwen3.Qwen3Model.Config(
        vocab_size=V,
        dim=D,
        norm=qwen3._qwen3_norm(D),
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=V,
            embedding_dim=D,
            param_init=qwen3._EMBEDDING_SKIP_INIT if tied else qwen3._EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(in_features=D, out_features=V, param_init=qwen3._LINEAR_INIT),
        layers=[sparse[i] if i in moe_ids else dense[i] for i in range(n_layers)],
    )


def _llama_config(c: Any, attn_backend: str) -> Any:
    """Llama: separate-then-fused QKV, ComplexRoPE (the adapter permutes HF's rotate-half q/k), llama3 scaling."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    D, V = c.hidden_size, c.vocab_size
    rope = _rope_parameters(c)
    scaling = {}
    if rope["rope_type"] == "llama3":
        scaling = dict(
            scaling="llama",
            scaling_factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    tied = bool(c.tie_word_embeddings)
    return llama3.Llama3Model.Config(
        dim=D,
        vocab_size=V,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=V,
            embedding_dim=D,
            param_init=llama3._EMBEDDING_SKIP_INIT if tied else llama3._EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=D, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=D, out_features=V, param_init=llama3._output_linear_init(D)),
        layers=llama3._build_llama3_layers(
            n_layers=c.num_hidden_layers,
            dim=D,
            n_heads=c.num_attention_heads,
            n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
            hidden_dim=c.intermediate_size,
            rope=ComplexRoPE.Config(dim=D // c.num_attention_heads, max_seq_len=c.max_position_embeddings,
                                    theta=float(rope["rope_theta"]), **scaling),
            attn_backend=attn_backend,
        ),
    )


def architecture_signature(hf_config: Any) -> dict[str, Any]:
    """The fields of a Qwen3 / Qwen3-MoE HF config that decide the function the model computes.

    Normalised: the MoE layout as the list of sparse layers (not its two
    spellings), the dense FFN width only when a dense layer exists.
    """
    rope = _rope_parameters(hf_config)
    moe_ids = _moe_layer_ids(hf_config)
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
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(hf_config)].__name__


def serving_config_json(hf_config: Any, dtype: Any) -> str:
    """config.json text as `save_pretrained` writes it, completed for serving.

    `architectures` filled in when missing (without it vLLM resolves the base
    model and serves it as a pooling model); `dtype` plus its pre-5.0 spelling
    `torch_dtype` for older transformers / vLLM readers.
    """
    import copy
    import json

    config = copy.deepcopy(hf_config)
    config.architectures = [causal_lm_architecture(config)]
    config.dtype = dtype
    fields = json.loads(config.to_json_string(use_diff=True))
    fields["torch_dtype"] = fields["dtype"]
    return json.dumps(fields, indent=2, sort_keys=True) + "\n"


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
