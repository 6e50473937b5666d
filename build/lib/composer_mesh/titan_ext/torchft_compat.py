"""torchft's private APIs, reached from this module only.

Checked against torchft 0.2.0. The in-process lighthouse is the Rust
extension's `torchft._torchft.LighthouseServer` (torchft exports no public
name for it). `titan_ext.diloco` needs Manager and DiLoCo state that has no
public accessor: the Manager's one-worker quorum executor (`_executor`: quorums
run on daemon threads), its in-flight quorum (`_quorum_future`: failed when the
run stops) and quorum id (`_quorum_id`); DiLoCo's inner-step counter
(`_local_step`) and fragments (`_fragments`), and each fragment's outer
optimizer (`_outer_optimizer`), which trainer checkpoints save and restore. A
torchft upgrade that renames them breaks here and nowhere else.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from torch.optim import Optimizer
from torchft._torchft import LighthouseServer
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager

__all__ = [
    "LighthouseServer",
    "diloco_fragments",
    "diloco_local_step",
    "outer_optimizer",
    "pending_quorum",
    "quorum_id",
    "replace_quorum_executor",
    "set_diloco_local_step",
]


def replace_quorum_executor(manager: Manager, executor: Any) -> None:
    """Shut the Manager's quorum executor down (without waiting) and run its quorums on `executor`."""
    manager._executor.shutdown(wait=False)
    manager._executor = executor


def pending_quorum(manager: Manager) -> Future | None:
    """The Manager's in-flight quorum future (the step thread waits on it), or None."""
    return manager._quorum_future


def quorum_id(manager: Manager) -> int:
    """The id of the Manager's current quorum (negative before the first)."""
    return manager._quorum_id


def diloco_local_step(diloco: DiLoCo) -> int:
    """Inner steps taken since DiLoCo's last sync (0 right after one)."""
    return diloco._local_step


def set_diloco_local_step(diloco: DiLoCo, step: int) -> None:
    """Restore DiLoCo's inner-step counter (resuming a checkpoint mid-round)."""
    diloco._local_step = step


def diloco_fragments(diloco: DiLoCo) -> list[Any]:
    """DiLoCo's model fragments, each synced on its own schedule."""
    return diloco._fragments


def outer_optimizer(fragment: Any) -> Optimizer:
    """A fragment's outer optimizer (its momentum is part of the run's state)."""
    return fragment._outer_optimizer
