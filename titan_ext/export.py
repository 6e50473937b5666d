"""Weight export for generators: HF-named full tensors, streamed bucket by bucket.

Generators (vLLM, HF) load HF parameter names; the trainer holds TorchTitan
names sharded by FSDP2 / EP. `iter_hf_buckets` walks the model one top-level
unit at a time (embeddings, each transformer block, norm, head), collects
sharded tensors until a bucket's *full* size would pass `bucket_bytes`, then
gathers just that bucket (`DTensor.full_tensor`), renames it with the model's
TorchTitan state-dict adapter (fused QKV split, stacked experts split per
expert) and yields it. No rank ever holds more than one bucket of gathered
weights (plus one block's QKV, which TorchTitan's state-dict hook replicates).

This is the interface the weight-sync path uses: every rank iterates in the
same order (the gathers are collectives) and receives every bucket; which
rank forwards a bucket to which generator is `mesh/`'s business.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_ext.hf_checkpoint import make_adapter, model_units

HFBucket = list[tuple[str, torch.Tensor]]


def _full_bytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def iter_hf_buckets(
    model: nn.Module,
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    adapter: Any = None,
) -> Iterator[HFBucket]:
    """Yield `[(hf_name, full tensor), ...]` buckets covering the whole model once.

    bucket_bytes: full-tensor bytes per bucket (a larger single tensor forms its own bucket).
    dtype: cast for the receiver (e.g. bfloat16 for serving); None keeps the parameter dtype.
    Collective on a sharded model: call on every rank and consume every bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    adapter = adapter or make_adapter(model)
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    seen: set[int] = set()  # tied parameters (embedding = head) appear under two names
    for prefix, unit in model_units(model):
        for key, tensor in unit.state_dict(prefix=f"{prefix}.", keep_vars=True).items():
            if isinstance(tensor, nn.Parameter):  # live objects: ids are stable (hook outputs are not)
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
            size = _full_bytes(tensor, dtype)
            if pending and pending_bytes + size > bucket_bytes:
                yield _gather_bucket(pending, adapter, dtype)
                pending, pending_bytes = {}, 0
            pending[key] = tensor  # clean names: the AC wrapper's state-dict hook strips its prefix
            pending_bytes += size
    if pending:
        yield _gather_bucket(pending, adapter, dtype)


def _gather_bucket(pending: dict[str, torch.Tensor], adapter: Any, dtype: torch.dtype | None) -> HFBucket:
    full = {
        key: (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        for key, t in pending.items()
    }
    return [(name, t.to(dtype or t.dtype).contiguous()) for name, t in adapter.to_hf(full).items()]
