"""`setup_elastic_env` on a real two-process Monarch mesh: torchrun's variables per rank, one master
address and port for all (below the host's ephemeral range), and a gloo group that forms with them."""

from __future__ import annotations

import os
import sys

import cloudpickle
from monarch.actor import Actor, endpoint, this_host

from composer_mesh.actors.elastic import setup_elastic_env

# the probe's processes need not import this file from the tests folder (as tests/endpoint_sync.py)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class GroupProbe(Actor):
    """Reads this process's torch-elastic variables, then joins the group and sums the ranks."""

    @endpoint
    def env(self) -> dict[str, str]:
        return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}

    @endpoint
    def rank_sum(self) -> int:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([dist.get_rank() + 1])
        dist.all_reduce(total)
        dist.destroy_process_group()
        return int(total)


def test_two_procs_get_one_master_below_the_ephemeral_range_and_form_a_gloo_group():
    low, _ = (int(v) for v in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        setup_elastic_env(procs)
        probe = procs.spawn("probe", GroupProbe)
        envs = sorted(probe.env.call().get().values(), key=lambda e: e["RANK"])
        assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "0", "2"), ("1", "1", "2")]
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        assert int(envs[0]["MASTER_PORT"]) < low
        assert sorted(probe.rank_sum.call().get().values()) == [3, 3]
    finally:
        procs.stop().get()
