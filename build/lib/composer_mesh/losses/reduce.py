"""Reductions shared by the three loss channels.

Every channel divides a *sum* by a count that the caller passes in explicitly
(the valid-token or pair count of the whole global batch), so splitting the
batch into microbatches or data-parallel ranks and summing the pieces gives the
same loss and gradient as one big batch.
"""

from __future__ import annotations

import torch


def math_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype loss math runs in: at least fp32 (bf16/fp16 go up, fp64 stays)."""
    return torch.promote_types(x.dtype, torch.float32)


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(math_dtype(x))


def global_mean(values: torch.Tensor, count: torch.Tensor | int | float) -> torch.Tensor:
    """sum(values) / count; 0 (not NaN) when count is 0.

    values: already masked (one entry per valid token or pair, any shape).
    count: the global count of valid entries (python number or 0-d tensor).
    """
    total = upcast(values).sum()
    count = torch.as_tensor(count, dtype=total.dtype, device=values.device)
    return torch.where(count > 0, total / count.clamp(min=1.0), total * 0.0)


def segment_sum(values_N: torch.Tensor, segment_N: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Per-segment sums: out[s] = sum of values_N[i] with segment_N[i] == s.  # [S]"""
    values_N = upcast(values_N)
    return values_N.new_zeros(num_segments).index_add(0, segment_N, values_N)
