"""Masked SDPA: the CPU training attention path for TorchTitan language models.

TorchTitan 0.3.0 trains LMs with FlexAttention (no backward on CPU) or varlen
attention (CUDA only), and refuses plain `sdpa` because it cannot see packed
documents. `MaskedSDPA` is an inner-attention module with the same contract as
`FlexAttention` (q/k/v as `[B, L, N, H]`, masks built from per-token positions
that reset to 0 at each document start) that runs
`F.scaled_dot_product_attention` with an explicit boolean block-causal mask, so
forward and backward run on any device. Masks are dense `[B, 1, L, L]`: fine
for the sequence lengths a CPU run trains on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.protocols.module import Module


class DenseAttentionMask(NamedTuple):
    """Boolean attention mask for `MaskedSDPA`: True where a query may attend a key."""

    allowed_B1LL: torch.Tensor  # [B, 1, L, L] bool


def document_ids(positions_BL: torch.Tensor) -> torch.Tensor:
    """Index of the packed document each token belongs to, `[B, L]`.

    Same convention as TorchTitan's `get_document_mask_mod`: a document starts
    wherever the position is 0.
    """
    return torch.cumsum((positions_BL == 0).int(), dim=1) - 1


def block_causal_mask(positions_BL: torch.Tensor) -> DenseAttentionMask:
    """Causal attention restricted to each packed document."""
    doc_BL = document_ids(positions_BL)
    L = positions_BL.shape[1]
    causal_LL = torch.ones(L, L, dtype=torch.bool, device=positions_BL.device).tril()
    same_doc_BLL = doc_BL[:, :, None] == doc_BL[:, None, :]
    return DenseAttentionMask((same_doc_BLL & causal_LL)[:, None])


class MaskedSDPA(Module):
    """Inner attention: SDPA with a dense block-causal mask (plain causal when no mask)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: DenseAttentionMask | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if out_transform is not None:
            raise ValueError("MaskedSDPA does not return the log-sum-exp (out_transform)")
        if attention_masks is not None and not isinstance(attention_masks, DenseAttentionMask):
            raise TypeError(
                f"MaskedSDPA needs a DenseAttentionMask (titan_ext.attention.attention_masks), "
                f"got {type(attention_masks).__name__}"
            )
        q_BNLH, k_BNLH, v_BNLH = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out_BNLH = F.scaled_dot_product_attention(
            q_BNLH,
            k_BNLH,
            v_BNLH,
            attn_mask=None if attention_masks is None else attention_masks.allowed_B1LL,
            is_causal=attention_masks is None,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out_BNLH.transpose(1, 2)


_SWAPPABLE = (FlexAttention.Config, VarlenAttention.Config)


def use_masked_sdpa(model_config: Module.Config) -> int:
    """Swap every Flex/varlen inner attention in a model config for `MaskedSDPA`.

    Edits the config in place (before `build()`); returns how many were swapped.
    """
    swapped = 0
    for _, _, parent, attr in list(model_config.traverse(_SWAPPABLE)):
        if parent is None:
            raise ValueError("the root config is an attention config, not a model")
        if isinstance(parent, list):
            parent[attr] = MaskedSDPA.Config()
        else:
            setattr(parent, attr, MaskedSDPA.Config())
        swapped += 1
    return swapped


def attention_masks(model: torch.nn.Module, positions_BL: torch.Tensor) -> Any:
    """The masks `model(tokens, positions, masks)` needs for packed documents.

    `MaskedSDPA` models get a `DenseAttentionMask`, or None when every row is one
    document (positions 0..L-1): SDPA's own causal path, which skips the key blocks
    above the diagonal instead of masking them (on CPU the same values bit for bit,
    tests/titan_ext/test_platform_attention.py); Flex/varlen models get what
    TorchTitan builds (`model.get_attention_masks`).
    """
    attn_config = model.config.first_attention
    if attn_config is not None and isinstance(attn_config.inner_attention, MaskedSDPA.Config):
        if torch.equal(positions_BL, torch.arange(positions_BL.shape[1], device=positions_BL.device).expand_as(positions_BL)):
            return None
        return block_causal_mask(positions_BL)
    return model.get_attention_masks(positions_BL)
