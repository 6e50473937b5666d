"""torchft's private APIs, reached from this module only.

Checked against torchft 0.2.0. The in-process lighthouse is the Rust
extension's `torchft._torchft.LighthouseServer` (torchft exports no public
name for it); the Manager's one-worker quorum executor (`Manager._executor`)
and its in-flight quorum (`Manager._quorum_future`) have no public accessors,
and `titan_ext.diloco` needs both to run quorums on daemon threads and to fail
a pending quorum when the run stops. A torchft upgrade that renames them
breaks here and nowhere else.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from torchft._torchft import LighthouseServer
from torchft.manager import Manager

__all__ = ["LighthouseServer", "pending_quorum", "replace_quorum_executor"]


def replace_quorum_executor(manager: Manager, executor: Any) -> None:
    """Shut the Manager's quorum executor down (without waiting) and run its quorums on `executor`."""
    manager._executor.shutdown(wait=False)
    manager._executor = executor


def pending_quorum(manager: Manager) -> Future | None:
    """The Manager's in-flight quorum future (the step thread waits on it), or None."""
    return manager._quorum_future
