"""Where a process group meets: a port for rank 0's TCPStore that outgoing connections cannot take.

Torch-free, so the controller can pick it before its heavy imports (`mesh.prespawn`).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def master_port(host: str = "") -> int:
    """A TCP port free on this host now, for a TCPStore that binds it later, chosen below the kernel's
    ephemeral range.

    `bind(port 0)` hands out an ephemeral port, and until rank 0's store binds it (after the trainer's
    imports: seconds) any outgoing connection on the host may be given the same port (EADDRINUSE at
    `init_process_group`, seen in CI in a DiLoCo group). The kernel never gives a port below the
    ephemeral range to a connection, so there only a listener picking the same port can take it, and
    picking at random among thousands makes that unlikely. Falls back to an ephemeral port when none
    of 64 candidates binds.
    """
    low, high = _ephemeral_range()
    candidates = range(max(1024, low - 10000), low) if low > 2048 else range(high + 1, 65536)
    pick = random.SystemRandom()  # not the seeded global generator: concurrent pickers must not agree
    for port in pick.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's (low, high) ports for outgoing connections; Linux's default where it can't be read."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999
