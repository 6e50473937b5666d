"""TorchTitan's private model builders, reached from this module only.

Checked against torchtitan 0.3.0. The Qwen3 and Llama3 packages build their
registry flavours with private helpers (`_build_qwen3_layers`,
`_build_qwen3_moe_layers`, `_build_llama3_layers`, the `_qwen3_norm` and
`_*_INIT` tables); the tiny flavours and configs derived from an HF
config.json are built with the same helpers, so they initialise exactly as
TorchTitan's own flavours do. The decoder's `_skip_lm_head` flag (TorchTitan's
chunked loss sets it the same way) makes the forward return final hidden
states. A TorchTitan upgrade that renames them breaks here and nowhere else.
"""

from __future__ import annotations

from typing import Any

import torchtitan.models.llama3 as llama3
import torchtitan.models.qwen3 as qwen3
from torchtitan.models.common import Embedding, Linear, RMSNorm

build_qwen3_layers = qwen3._build_qwen3_layers
build_qwen3_moe_layers = qwen3._build_qwen3_moe_layers
build_llama3_layers = llama3._build_llama3_layers


def qwen3_model_config(vocab_size: int, dim: int, tie_embeddings: bool, layers: list[Any]) -> Any:
    """A `Qwen3Model.Config` around `layers` with TorchTitan's Qwen3 norm, embedding and head inits."""
    return qwen3.Qwen3Model.Config(
        vocab_size=vocab_size,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        enable_weight_tying=tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size,
            embedding_dim=dim,
            param_init=qwen3._EMBEDDING_SKIP_INIT if tie_embeddings else qwen3._EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=qwen3._LINEAR_INIT),
        layers=layers,
    )


def llama3_model_config(vocab_size: int, dim: int, tie_embeddings: bool, layers: list[Any]) -> Any:
    """A `Llama3Model.Config` around `layers` with TorchTitan's Llama3 norm, embedding and head inits."""
    return llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        enable_weight_tying=tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size,
            embedding_dim=dim,
            param_init=llama3._EMBEDDING_SKIP_INIT if tie_embeddings else llama3._EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=llama3._output_linear_init(dim)),
        layers=layers,
    )


def skip_lm_head(model: Any) -> None:
    """Make the decoder's forward return final hidden states `[B, L, D]`; the loss applies the head."""
    model._skip_lm_head = True
