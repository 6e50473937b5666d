"""Small helpers for Monarch meshes that every layer from `actors` up uses."""

from __future__ import annotations

import os
import socket
from typing import Any


def rank0(values: Any) -> Any:
    """The value rank 0 returned from a mesh-wide `.call()`."""
    return next(iter(values.values()))


def host_label() -> str:
    """This process's host as Monarch names it: the host part of HYPERACTOR_PROCESS_NAME ("<proc> @ <host>"),
    the hostname on real hosts and the host key on `monarch.job.ProcessJob` fake hosts; else the hostname."""
    name = os.environ.get("HYPERACTOR_PROCESS_NAME", "")
    _, sep, host = name.rpartition(" @ ")
    return host if sep and host else socket.gethostname()

