"""The torch-elastic environment of a proc mesh that forms one process group.

Monarch's `setup_torch_elastic_env` picks the master port by binding port 0 on rank 0's host: an
ephemeral port, which an outgoing connection on that host may be given before rank 0's TCPStore binds
it. Here rank 0 picks it with `titan_ext.rendezvous.master_port` (below the ephemeral range), and
Monarch's actor sets the variables.
"""

from __future__ import annotations

import socket
from typing import Any

from monarch.actor import Actor, endpoint
from monarch.spmd import setup_torch_elastic_env

from composer_mesh.titan_ext.rendezvous import master_port


class MasterAddressActor(Actor):
    """Answers, on the process that will host the group's store, its hostname and a port to listen on."""

    @endpoint
    def address(self) -> tuple[str, int]:
        return socket.gethostname(), master_port()


def setup_elastic_env(procs: Any) -> None:
    """Set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ... in every process of `procs` (rank 0 is master)."""
    first = dict.fromkeys(procs.sizes, 0)
    addr, port = procs.spawn("_master_address", MasterAddressActor).slice(**first).address.call_one().get()
    setup_torch_elastic_env(procs, addr, port)
