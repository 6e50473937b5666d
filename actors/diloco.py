"""DiLoCo across trainer replica groups: the manager actor and the replica-side trainer actor.

`DiLoCoManagerActor` (one, in the controller's host) runs the torchft
lighthouse in process (`torchft._torchft.LighthouseServer`) and hands each
trainer replica group a `ReplicaAssignment` (replica id + lighthouse address);
the group's own TCPStore (its torch-elastic MASTER_ADDR / MASTER_PORT) is the
Manager's store. Replicas report their torchft status (quorum, outer step,
bytes sent) back, and `status()` summarizes the run.

`DiLoCoTrainerActor` is a `TrainerActor` whose inner optimizer runs under
`titan_ext.diloco.DiLoCoReplica`: every H / fragments `train_step`s one
fragment's pseudo-gradients are averaged over the quorum and the outer
optimizer steps, inside the optimizer step itself. A replica group that
restarts joins behind the quorum and heals from a live peer.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from monarch.actor import Actor, endpoint

from composer_mesh.actors.trainer import TrainerActor
from composer_mesh.configs.sections.diloco import DiLoCoConfig
from composer_mesh.titan_ext.diloco import DiLoCoReplica, ReplicaAssignment, parameters_digest
from composer_mesh.titan_ext.torchft_compat import LighthouseServer
from composer_mesh.titan_ext.spec import TrainerSpec


class DiLoCoManagerActor(Actor):
    """Endpoints: assign, report, status, shutdown. Owns the lighthouse for the run's lifetime."""

    def __init__(self, cfg: DiLoCoConfig) -> None:
        self.cfg = cfg
        self.lighthouse = LighthouseServer(
            bind="[::]:0", min_replicas=cfg.min_replicas,
            join_timeout_ms=cfg.join_timeout_ms, heartbeat_timeout_ms=cfg.heartbeat_timeout_ms,
        )
        self.address = self.lighthouse.address()
        self.reports: dict[int, dict[str, Any]] = {}
        # replica index -> times assigned (restarts = times - 1)
        self.assigned: dict[int, int] = {}

    @endpoint
    def assign(self, index: int) -> ReplicaAssignment:
        """The assignment of replica group `index` (again after a restart: same id, torchft adds a fresh uuid)."""
        if not 0 <= index < self.cfg.replica_groups:
            raise ValueError(f"replica index {index} outside [0, {self.cfg.replica_groups}) (diloco.replica_groups)")
        self.assigned[index] = self.assigned.get(index, 0) + 1
        return ReplicaAssignment(f"replica_{index}", index, self.address)

    @endpoint
    def report(self, index: int, status: dict[str, Any]) -> None:
        self.reports[index] = dict(status)

    @endpoint
    def status(self) -> dict[str, Any]:
        """Lighthouse address, per-replica reports, quorum size, outer step and bytes sent (summed)."""
        reports = [self.reports[i] for i in sorted(self.reports)]
        return {
            "lighthouse": self.address,
            "replicas": {i: self.reports[i] for i in sorted(self.reports)},
            "restarts": {i: n - 1 for i, n in self.assigned.items() if n > 1},
            "quorum_size": max((r["participants"] for r in reports), default=0),
            "outer_step": max((r["outer_step"] for r in reports), default=0),
            "bytes_sent": sum(r["bytes_sent"] for r in reports),
        }

    @endpoint
    def shutdown(self) -> None:
        """Stop the lighthouse (once): replicas waiting for a quorum abort within heartbeat_timeout_ms."""
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None


class DiLoCoTrainerActor(TrainerActor):
    """A trainer replica group: `setup`, then `join(assignment)`; `train_step` as usual.

    Extra endpoints: join, diloco_status, local_digest.
    """

    def __init__(self, spec: TrainerSpec, diloco: DiLoCoConfig) -> None:
        super().__init__(spec)
        self.diloco_cfg = diloco
        self.replica: DiLoCoReplica | None = None

    @endpoint
    def join(self, assignment: ReplicaAssignment, start_digests: list[str] | None = None) -> dict[str, Any]:
        """Wrap this rank's model and optimizer in torchft DiLoCo (collective over the group).

        `start_digests[rank]`: replica group 0's `local_digest` per rank when the groups start together
        (this rank must start from the same weights); None when joining a running quorum (heals).
        """
        t = self._t()
        if self.replica is None:
            rank = dist.get_rank()
            self.replica = DiLoCoReplica(
                self.diloco_cfg, t.model, t.optimizer, assignment,
                store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
                group_rank=rank, group_world_size=dist.get_world_size(),
                extra_state=(self._extra_state, self._load_extra_state),
                start_digest=None if start_digests is None else start_digests[rank],
            )
            # DiLoCo's outer state goes into this group's trainer checkpoints; a resumed one is loaded now
            t.register_wrapper("diloco", self.replica.state_dict, self.replica.load_state_dict)
        return self.replica.status()

    def _extra_state(self) -> dict[str, Any]:
        t = self._t()
        return {"step": t.step, "lr_scheduler": t.lr_scheduler.state_dict()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        t = self._t()
        t.step = state["step"]
        t.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def _r(self) -> DiLoCoReplica:
        if self.replica is None:
            raise RuntimeError("call join(assignment) on the replica group first")
        return self.replica

    @endpoint
    def diloco_status(self) -> dict[str, Any]:
        return self._r().status()

    @endpoint
    def local_digest(self) -> str:
        """sha256 of this rank's parameter shards (rank r of every replica group must agree after a sync)."""
        return parameters_digest(self._t().model)
