"""HF `config.json` <-> TorchTitan model configs, for Qwen3 dense, Qwen3-MoE and Llama.

Two directions:

- `titan_config_from_hf(hf_config)`: the TorchTitan `Qwen3Model.Config` /
  `Llama3Model.Config` of a checkpoint, from its config.json alone (layers,
  widths, heads, head_dim, RoPE and its llama3 scaling, norms, tying, vocab,
  MoE layout), checked first with `titan_ext.hf.config.check_supported`.
- `hf_config_for(titan_config)`: the transformers config of a TorchTitan
  Qwen3 config (what the tiny assets and HF exports write).
"""

from __future__ import annotations

from typing import Any

from torchtitan.models.common import ComplexRoPE, CosSinRoPE
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model
from transformers import Qwen3Config, Qwen3MoeConfig

from composer_mesh.titan_ext.hf.config import check_supported, moe_layer_ids, rope_parameters, titan_family
from composer_mesh.titan_ext.torchtitan_compat import (
    build_llama3_layers,
    build_qwen3_layers,
    build_qwen3_moe_layers,
    llama3_model_config,
    qwen3_model_config,
)


def titan_config_from_hf(hf_config: Any, attn_backend: str = "flex", source: str = "config.json") -> Any:
    """The TorchTitan model config computing the same function as `hf_config` (checked first).

    Built with TorchTitan's own layer builders for the family; every RMSNorm
    gets the checkpoint's epsilon.
    """
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
    D, V, n_layers = c.hidden_size, c.vocab_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or D // c.num_attention_heads
    rope = rope_parameters(c)
    attention = dict(
        n_layers=n_layers,
        dim=D,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=head_dim,
        attn_backend=attn_backend,
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=c.max_position_embeddings, theta=float(rope["rope_theta"])),
    )
    moe_ids = set(moe_layer_ids(c))
    dense = build_qwen3_layers(hidden_dim=c.intermediate_size, **attention) if len(moe_ids) < n_layers else []
    sparse = []
    if moe_ids:
        sparse = build_qwen3_moe_layers(
            moe_hidden_dim=c.moe_intermediate_size,
            num_experts=c.num_experts,
            top_k=c.num_experts_per_tok,
            moe_comm_backend="standard",
            **attention,
        )
        for layer in sparse:
            layer.moe.load_balance_coeff = None
            layer.moe.router.route_norm = bool(c.norm_topk_prob)
    layers = [sparse[i] if i in moe_ids else dense[i] for i in range(n_layers)]
    return qwen3_model_config(V, D, bool(c.tie_word_embeddings), layers)


def _llama_config(c: Any, attn_backend: str) -> Any:
    """Llama: separate-then-fused QKV, ComplexRoPE (the adapter permutes HF's rotate-half q/k), llama3 scaling."""
    D, V = c.hidden_size, c.vocab_size
    rope = rope_parameters(c)
    scaling = {}
    if rope["rope_type"] == "llama3":
        scaling = dict(
            scaling="llama",
            scaling_factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    layers = build_llama3_layers(
        n_layers=c.num_hidden_layers,
        dim=D,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        hidden_dim=c.intermediate_size,
        rope=ComplexRoPE.Config(dim=D // c.num_attention_heads, max_seq_len=c.max_position_embeddings,
                                theta=float(rope["rope_theta"]), **scaling),
        attn_backend=attn_backend,
    )
    return llama3_model_config(V, D, bool(c.tie_word_embeddings), layers)


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
