"""CPU attention path: masked SDPA == naive masked softmax == TorchTitan's FlexAttention masks."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
from torchtitan.models.common.attention import (
    get_causal_mask_mod,
    get_efficient_causal_mask_mod_for_packed_document,
)

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.attention import DenseAttentionMask, MaskedSDPA, attention_masks, block_causal_mask
from composer_mesh.titan_ext.build import build_model
from composer_mesh.titan_ext.platform import detect_platform

B, L, NQ, NKV, H = 2, 40, 4, 2, 32
DOC_LENGTHS = ([10, 17, 13], [40])  # row 0 packs three documents, row 1 holds one


def _positions() -> torch.Tensor:
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in DOC_LENGTHS]
    return torch.stack(rows)  # [B, L]


def _qkv(seed: int, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, L, NQ, H), (B, L, NKV, H), (B, L, NKV, H))
    return [torch.randn(s, generator=gen).requires_grad_(requires_grad) for s in shapes]


def _naive_attention(q_BLNH, k_BLNH, v_BLNH, scale):
    """softmax over keys j <= i of the same document, written out per (batch, head)."""
    rows = []
    for b, lengths in enumerate(DOC_LENGTHS):
        doc = [d for d, n in enumerate(lengths) for _ in range(n)]
        allowed = torch.tensor([[j <= i and doc[j] == doc[i] for j in range(L)] for i in range(L)])
        heads = []
        for n in range(NQ):
            kv = n // (NQ // NKV)
            scores = (q_BLNH[b, :, n] @ k_BLNH[b, :, kv].T) * scale
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            heads.append(probs @ v_BLNH[b, :, kv])  # [L, H]
        rows.append(torch.stack(heads, dim=1))  # [L, N, H]
    return torch.stack(rows)  # [B, L, N, H]


def test_masked_sdpa_matches_naive_reference_forward_and_backward():
    scale = H**-0.5
    sdpa = MaskedSDPA.Config().build()
    q, k, v = _qkv(0, requires_grad=True)
    out = sdpa(q, k, v, attention_masks=block_causal_mask(_positions()), scale=scale, enable_gqa=True)
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = _naive_attention(q2, k2, v2, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * upstream).sum().backward(retain_graph=True)
    (ref * upstream).sum().backward()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Keys of another document get no gradient from a query: row 0's first document is closed.
    q.grad = k.grad = v.grad = None
    out[0, :10].sum().backward()
    assert k.grad[0, 10:].abs().sum() == 0


@torch.no_grad()
def test_masked_sdpa_matches_titan_flex_attention_masks():
    """Same output as FlexAttention with TorchTitan's causal + packed-document mask mods."""
    positions = _positions()
    q, k, v = _qkv(2)
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    block_mask = create_block_mask(mask_mod, B, None, L, L, device="cpu")
    flex_BNLH = flex_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask, scale=0.2, enable_gqa=True
    )
    sdpa = MaskedSDPA.Config().build()
    out = sdpa(q, k, v, attention_masks=block_causal_mask(positions), scale=0.2, enable_gqa=True)
    torch.testing.assert_close(out, flex_BNLH.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_dense_mask_and_dispatch():
    mask = block_causal_mask(_positions()).allowed_B1LL
    assert mask.shape == (B, 1, L, L) and mask.dtype == torch.bool
    assert mask[0, 0, 12, 10] and not mask[0, 0, 12, 9] and not mask[0, 0, 12, 13]
    assert mask[1, 0].equal(torch.ones(L, L, dtype=torch.bool).tril())
    model = build_model(ModelConfig(flavour="tiny", device="cpu"), platform=detect_platform("cpu"))
    assert isinstance(attention_masks(model, _positions()), DenseAttentionMask)
    with pytest.raises(TypeError, match="DenseAttentionMask"):
        model.layers["0"].attention.inner_attention(*_qkv(3), attention_masks=object())


@torch.no_grad()
def test_packed_documents_equal_separate_sequences():
    """A model over a packed row gives each document the logits it gets alone."""
    model = build_model(ModelConfig(flavour="tiny", device="cpu")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    tokens = torch.randint(0, 2048, (1, L), generator=torch.Generator().manual_seed(4))
    positions = _positions()[:1]
    packed = model(tokens, positions, attention_masks(model, positions))
    start = 0
    for n in DOC_LENGTHS[0]:
        alone = model(tokens[:, start : start + n])
        torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-4, rtol=1e-4)
        start += n


def test_single_document_rows_take_sdpa_causal_path_with_the_dense_masks_values():
    """Rows that are one document each (positions 0..L-1) get no dense mask (SDPA's causal path), and the
    model's logits and every gradient equal, bit for bit, those under the explicit block-causal mask; a packed
    row still gets the dense mask."""
    model = build_model(ModelConfig(flavour="tiny", device="cpu"), platform=detect_platform("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    # long enough that the flash kernel skips whole key blocks above the diagonal
    tokens_BL = torch.randint(0, 2048, (3, 300), generator=torch.Generator().manual_seed(5))
    positions_BL = torch.arange(300).expand(3, 300)
    assert attention_masks(model, positions_BL) is None
    assert isinstance(attention_masks(model, _positions()), DenseAttentionMask)

    def run(masks):
        model.zero_grad(set_to_none=True)
        logits = model(tokens_BL, positions_BL, masks)
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    causal, causal_grads = run(attention_masks(model, positions_BL))
    dense, dense_grads = run(block_causal_mask(positions_BL))
    assert torch.equal(causal, dense)
    assert all(torch.equal(a, b) for a, b in zip(causal_grads, dense_grads))
