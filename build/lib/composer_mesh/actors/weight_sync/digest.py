"""Weight digests and name coverage: what proves a generator holds the trainer's weights.

`weights_digest` hashes (name, dtype, shape, bytes) in name order: the trainer
digests what it exported, a generator what it holds under those names, and
equal digests mean bit-identical weights.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) in name order."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def uncovered_names(state: dict[str, torch.Tensor], names: Iterable[str]) -> list[str]:
    """Sorted names of `state` whose storage address no name in `names` covers (tied weights: either name
    covers both; fused-weight views are separate addresses)."""
    covered = {state[n].data_ptr() for n in names if n in state}
    return sorted(n for n, t in state.items() if t.data_ptr() not in covered)


def first_names(state: dict[str, torch.Tensor]) -> list[str]:
    """One name per tensor of `state` (name -> live tensor): a tied tensor under its first name, in `state`'s
    order (the trainer's export names tied weights that way)."""
    first: dict[int, str] = {}
    for name, t in state.items():
        first.setdefault(t.data_ptr(), name)
    return list(first.values())


def check_coverage(state: dict[str, torch.Tensor], names: Iterable[str], version: int) -> None:
    """Refuse weights whose `names` are not exactly the engine's tensors (`state`: name -> live tensor).

    Coverage is by tensor address, so tied weights (one tensor, two names) are covered by either name
    and fused-weight views count separately. Checked before any copy: a refused version changes nothing.
    """
    names = list(names)
    unknown = [n for n in names if n not in state]
    uncovered = uncovered_names(state, names)
    if unknown or uncovered:
        raise ValueError(
            f"weights v{version} do not match the generator model: unknown {unknown[:5]}, "
            f"not covered {uncovered[:5]}"
        )
