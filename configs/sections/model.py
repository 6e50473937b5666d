"""[model]: which model to train and generate with, and where its weights come from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class ModelConfig:
    flavour: str = option(
        "auto",
        doc='model flavour: "auto" (the shape from hf_path\'s config.json; "tiny" without hf_path), '
        '"tiny", "tiny_moe", a named flavour such as "qwen3_8b" or "qwen3_30b_a3b", or "family:flavor" for '
        'any TorchTitan registry entry (e.g. "qwen3:14B"); a named flavour must match hf_path field by field',
    )
    hf_path: str = option(
        "",
        doc="local HF directory (config.json + safetensors) to load weights from; empty: TorchTitan's "
        "init under `seed` (for the tiny flavours identical to the built assets of that seed)",
    )
    tokenizer_path: str = option(
        "", doc="local HF tokenizer directory; empty: the one in hf_path (or the built assets)"
    )
    assets_cache_dir: str = option(
        "",
        doc="where `composer-mesh assets build` writes the tiny offline assets; empty: "
        "$COMPOSER_MESH_CACHE/assets, else ~/.cache/composer-mesh/assets",
    )
    seed: int = option(0, doc="seed of the random init and of the tiny assets", ge=0)
    dtype: Literal["float32", "bfloat16"] = option(
        "float32", choices=("float32", "bfloat16"),
        doc="parameter dtype of a model built outside the trainer (conversion, assets); the trainer keeps float32 "
        "master weights and refuses bfloat16 (use parallelism.param_dtype for bf16 compute)",
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", doc="device kind; auto picks CUDA when visible", choices=("auto", "cpu", "cuda")
    )
    attention: Literal["auto", "sdpa", "flex", "varlen"] = option(
        "auto",
        doc="training attention: auto = masked SDPA on CPU, FlexAttention on CUDA",
        choices=("auto", "sdpa", "flex", "varlen"),
    )
    verify_layers: int = option(
        2,
        doc="at load, the first N layers of hf_path (vocabulary cut to 4096 rows) run in TorchTitan and in "
        "transformers on a few tokens; logits must agree to 1e-4 x max(1, |logit|) in fp32 or loading fails; 0: skip",
        ge=0,
    )

    def registry_flavour(self) -> str | None:
        """The registered flavour this section names; None when the model is derived from hf_path."""
        if self.flavour != "auto":
            return self.flavour
        return None if self.hf_path else "tiny"
