"""bfloat16 optimizer state without losing small updates: stochastic rounding.

AdamW's second moment moves by (1 − β2)·(g² − v) a step, a relative change
far below bfloat16's half-ulp (2⁻⁹ ≈ 0.2 %) for β2 = 0.95–0.999: rounded to
nearest, v would stop moving. Stochastic rounding (Gupta et al. 2015;
Zamirai et al. 2020, "Revisiting BFloat16 Training") rounds up with
probability equal to the remainder's share of the gap, so the stored value is
unbiased: E[round(x)] = x, and the small updates survive on average.
"""

from __future__ import annotations

import torch

# the float32 bits bfloat16 drops (its low 16 bits)
_DROPPED = (1 << 16) - 1


def stochastic_round_to_bf16_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Write float32 `src` into bfloat16 `dst`, each element rounded to one of its two bfloat16 neighbours, up
    (in magnitude) with probability (dropped bits) / 2¹⁶: a uniform 16-bit integer added to the bit pattern carries
    into the kept bits exactly that often. Non-finite values are copied as they are."""
    if src.dtype != torch.float32 or dst.dtype != torch.bfloat16 or src.shape != dst.shape:
        raise ValueError(f"need float32 src and bfloat16 dst of one shape, got {src.dtype} {tuple(src.shape)} -> "
                         f"{dst.dtype} {tuple(dst.shape)}")
    bits = src.contiguous().view(torch.int32)  # sign-magnitude: adding to the low bits grows the magnitude
    noise = torch.randint(0, _DROPPED + 1, bits.shape, dtype=torch.int32, generator=generator, device=src.device)
    rounded = ((bits + noise) & ~_DROPPED).view(torch.float32)  # low bits zero: the bfloat16 cast below is exact
    dst.copy_(torch.where(torch.isfinite(src), rounded, src))
    return dst
