"""The tiny flavours' shapes and the tiny tokenizer's special tokens (constants only, no project imports).

`titan_ext.models` registers the shapes into TorchTitan's Qwen3 registry,
`titan_ext.assets` builds the tokenizer and checkpoints they describe; tests
and benchmarks read them without importing either.
"""

from __future__ import annotations

from dataclasses import dataclass

# The tiny tokenizer's size; the tiny models' vocabulary.
TINY_VOCAB_SIZE = 2048
TINY_MAX_SEQ_LEN = 4096
TINY_ROPE_THETA = 1_000_000.0


@dataclass(frozen=True)
class TinyShape:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    # dense FFN width, or each expert's width
    hidden_dim: int = 384
    # 0: dense
    num_experts: int = 0
    top_k: int = 0
    tie_embeddings: bool = True


# TorchTitan registry flavour -> shape: a dense Qwen3 and a Qwen3-MoE (4 experts, top-2).
TINY_SHAPES: dict[str, TinyShape] = {
    "composer_tiny": TinyShape(),
    "composer_tiny_moe": TinyShape(hidden_dim=128, num_experts=4, top_k=2, tie_embeddings=False),
}

# Special tokens take ids 0..2 (the BPE trainer adds them first), tool markers the last 6.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
TOKEN_IDS = {"bos_token_id": 0, "pad_token_id": 0, "eos_token_id": 2}
