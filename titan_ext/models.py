"""Model flavours: `ModelConfig` -> TorchTitan `ModelSpec` + the HF config of the same model.

Every flavour, tiny or real, comes out of a TorchTitan registry
(`torchtitan.models.<family>.model_registry(flavor)`), so the trainer never
special-cases one. The two tiny flavours are registered into the Qwen3
registry here (`composer_tiny`, `composer_tiny_moe`): a dense Qwen3 and a
Qwen3-MoE (4 experts, top-2) small enough for CPU RL, with head_dim 32 (the
smallest head size the vLLM CPU backend accepts, shapes in `titan_ext.tiny`)
and exact HF equivalents. With flavour "auto" and `hf_path`, a Qwen3 /
Qwen3-MoE / Llama model is derived from the checkpoint's config.json instead
(`titan_ext.hf.derive`).

`resolve_model` then applies the platform's code paths to the config (masked
SDPA attention and per-expert fp32 experts on CPU, see `titan_ext.platform`);
`init_model` materialises a meta-built model with TorchTitan's seeded init.
`titan_ext.build.build_model` does all steps for one device.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchtitan.models.qwen3 as qwen3
from torchtitan.models.common import CosSinRoPE
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.model_spec import ModelSpec

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.attention import use_masked_sdpa
from composer_mesh.titan_ext.hf.config import architecture_signature, check_supported, read_checkpoint_config, titan_family
from composer_mesh.titan_ext.hf.derive import hf_config_for, titan_config_from_hf
from composer_mesh.titan_ext.platform import Platform, detect_platform
from composer_mesh.titan_ext.tiny import TINY_MAX_SEQ_LEN, TINY_ROPE_THETA, TINY_SHAPES, TINY_VOCAB_SIZE, TOKEN_IDS, TinyShape
from composer_mesh.titan_ext.torchtitan_compat import build_qwen3_layers, build_qwen3_moe_layers, qwen3_model_config

# Friendly flavour names -> (TorchTitan family, registry flavor).
FLAVOURS: dict[str, tuple[str, str]] = {
    "tiny": ("qwen3", "composer_tiny"),
    "tiny_moe": ("qwen3", "composer_tiny_moe"),
    "qwen3_0.6b": ("qwen3", "0.6B"),
    "qwen3_1.7b": ("qwen3", "1.7B"),
    "qwen3_4b": ("qwen3", "4B"),
    "qwen3_8b": ("qwen3", "8B"),
    "qwen3_14b": ("qwen3", "14B"),
    "qwen3_32b": ("qwen3", "32B"),
    "qwen3_30b_a3b": ("qwen3", "30B-A3B"),
    "qwen3_235b_a22b": ("qwen3", "235B-A22B"),
    "deepseek_v3_16b": ("deepseek_v3", "16B"),
    "deepseek_v3_236b": ("deepseek_v3", "236B"),
    "deepseek_v3_671b": ("deepseek_v3", "671B"),
    "moonlight_16b_a3b": ("kimi_k2_7", "moonlight-16B-A3B"),
    "kimi_k2.5": ("kimi_k2_7", "Kimi-K2.5"),
}
FAMILIES = ("qwen3", "deepseek_v3", "kimi_k2_7", "llama3")


def _tiny_config(shape: TinyShape, attn_backend: str, moe_comm_backend: str = "standard") -> Any:
    """A Qwen3Model.Config built with TorchTitan's own Qwen3 layer builders."""
    V, D = TINY_VOCAB_SIZE, shape.dim
    attention = dict(
        n_layers=shape.n_layers,
        dim=D,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        head_dim=shape.head_dim,
        attn_backend=attn_backend,
        rope=CosSinRoPE.Config(dim=shape.head_dim, max_seq_len=TINY_MAX_SEQ_LEN, theta=TINY_ROPE_THETA),
    )
    if shape.num_experts:
        layers = build_qwen3_moe_layers(
            moe_hidden_dim=shape.hidden_dim,
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            moe_comm_backend=moe_comm_backend,
            **attention,
        )
        for layer in layers:
            # HF Qwen3-MoE has no router bias: keep routing identical in both worlds.
            layer.moe.load_balance_coeff = None
    else:
        layers = build_qwen3_layers(hidden_dim=shape.hidden_dim, **attention)
    return qwen3_model_config(V, D, shape.tie_embeddings, layers)


def register_tiny_flavours() -> None:
    """Add the tiny flavours to TorchTitan's Qwen3 registry (idempotent)."""
    for name, shape in TINY_SHAPES.items():
        qwen3.qwen3_configs.setdefault(name, functools.partial(_tiny_config, shape))


class ExactGroupedExperts(GroupedExperts):
    """Grouped SwiGLU experts as a loop of per-expert matmuls in the parameter dtype.

    TorchTitan's `GroupedExperts` casts to bf16 for `torch._grouped_mm`, which
    also has no CPU backward; this computes the same function exactly (fp32 on
    CPU) with autograd through ordinary matmuls. Same parameters, same names.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1_EFD, w2_EDF, w3_EFD = (
            w.to_local() if hasattr(w, "to_local") else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        counts = [int(c) for c in num_tokens_per_expert_E.tolist()]
        routed = sum(counts)
        outs = []
        for e, x_rD in enumerate(torch.split(x_RD[:routed], counts)):
            h_rF = F.silu(x_rD @ w1_EFD[e].T) * (x_rD @ w3_EFD[e].T)
            outs.append(h_rF @ w2_EDF[e].T)
        # Rows past the routed tokens are padding (as with grouped_mm offsets).
        outs.append(x_RD.new_zeros(x_RD.shape[0] - routed, x_RD.shape[1]))
        return torch.cat(outs).type_as(x_RD)


def use_exact_experts(model_config: Any) -> int:
    """Swap every `GroupedExperts` config for `ExactGroupedExperts` in place; returns the count."""
    swapped = 0
    for _, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        if isinstance(cfg, ExactGroupedExperts.Config):
            continue
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
        setattr(parent, attr, ExactGroupedExperts.Config(**fields))
        swapped += 1
    return swapped


@dataclass
class ResolvedModel:
    """What a `ModelConfig` names, ready to build.

    spec: TorchTitan's ModelSpec (model config with the platform's code paths
    applied, parallelize_fn, state_dict_adapter, ...); hf_config: the HF config
    of the same model: the config.json of `hf_path` when set (the model is
    derived from it with flavour "auto", checked against a named Qwen3
    flavour field by field), else derived from the TorchTitan config for
    Qwen3 flavours, else None (DeepSeek/Kimi/Llama without a checkpoint: no
    derivation is implemented for them); platform: what it was resolved for.
    """

    spec: ModelSpec
    hf_config: Any
    platform: Platform
    family: str


def flavour_entry(flavour: str) -> tuple[str, str]:
    """(family, registry flavor) for a friendly name or "family:flavor"."""
    if flavour in FLAVOURS:
        return FLAVOURS[flavour]
    family, sep, flavor = flavour.partition(":")
    if sep and family in FAMILIES and flavor:
        return family, flavor
    raise ValueError(
        f"unknown model flavour {flavour!r}; expected \"auto\", one of {sorted(FLAVOURS)} or 'family:flavor' "
        f"with family in {FAMILIES}"
    )


def resolve_model(model_cfg: ModelConfig, platform: Platform | None = None) -> ResolvedModel:
    """The one mapping from `[model]` to a TorchTitan ModelSpec (+ HF config)."""
    platform = platform or detect_platform(model_cfg.device)
    attention = platform.attention if model_cfg.attention == "auto" else model_cfg.attention
    backend = "flex" if attention == "sdpa" else attention
    flavour = model_cfg.registry_flavour()
    checkpoint = read_checkpoint_config(model_cfg.hf_path) if model_cfg.hf_path else None
    # "auto" with hf_path: the shape is the checkpoint's
    if flavour is None:
        spec, hf_config = _derived_spec(checkpoint, backend, model_cfg.hf_path), checkpoint
        family = spec.name
    else:
        family, flavor = flavour_entry(flavour)
        if family == "qwen3":
            register_tiny_flavours()
        module = importlib.import_module(f"torchtitan.models.{family}")
        try:
            spec = module.model_registry(flavor, attn_backend=backend)
        except KeyError:
            raise ValueError(f"TorchTitan's {family} registry has no flavor {flavor!r}") from None
        hf_config = hf_config_for(spec.model, **_tiny_token_ids(flavour)) if family == "qwen3" else None
        if checkpoint is not None:
            if hf_config is not None:
                _check_same_model(model_cfg, hf_config, checkpoint)
            hf_config = checkpoint
    if attention == "sdpa":
        use_masked_sdpa(spec.model)
    if platform.exact_experts:
        use_exact_experts(spec.model)
    return ResolvedModel(spec=spec, hf_config=hf_config, platform=platform, family=family)


# A registry entry per derivable family, for what is not the model config (parallelize_fn, adapter, hooks).
_BASE_SPECS = {"qwen3": "0.6B", "llama3": "debugmodel"}


def _derived_spec(checkpoint: Any, attn_backend: str, hf_path: str) -> ModelSpec:
    """TorchTitan's ModelSpec of the checkpoint's family, with the model config derived from its config.json."""
    source = f"{hf_path}/config.json"
    family = titan_family(checkpoint, source)
    model = titan_config_from_hf(checkpoint, attn_backend, source=source)
    base = importlib.import_module(f"torchtitan.models.{family}").model_registry(_BASE_SPECS[family],
                                                                                attn_backend=attn_backend)
    return dataclasses.replace(base, flavor=f"hf:{Path(hf_path).name}", model=model)


def _check_same_model(model_cfg: ModelConfig, derived: Any, loaded: Any) -> None:
    """Refuse a checkpoint whose config.json differs from the named flavour, naming the first field."""
    want = architecture_signature(derived)
    qwen3 = loaded.model_type in ("qwen3", "qwen3_moe")
    got = architecture_signature(loaded) if qwen3 else {"model_type": loaded.model_type}
    for field, value in want.items():
        if got.get(field) != value:
            raise ValueError(
                f"model.hf_path {model_cfg.hf_path} is not a {model_cfg.flavour!r} checkpoint: "
                f"{field} is {got.get(field)!r} there, the flavour has {value!r}"
            )
    check_supported(loaded, f"{model_cfg.hf_path}/config.json")


def _tiny_token_ids(flavour: str) -> dict[str, int]:
    """Special-token ids recorded in the tiny flavours' HF config."""
    if flavour not in ("tiny", "tiny_moe"):
        return {}
    return dict(TOKEN_IDS)


def init_model(model: torch.nn.Module, device: torch.device | str, seed: int) -> None:
    """Materialize a meta-device model on `device` and run TorchTitan's seeded init.

    Seeds a forked RNG, so the caller's random state is unchanged.
    """
    device = torch.device(device)
    model.to_empty(device=device)
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices), torch.no_grad():
        torch.manual_seed(seed)
        model.init_states(buffer_device=device)
