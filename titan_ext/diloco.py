"""Replica-side DiLoCo: a trainer's model and inner optimizer under torchft's `DiLoCo`.

One `DiLoCoReplica` per rank of a trainer replica group. It builds the torchft
pieces from `[diloco]` and the group's `ReplicaAssignment` (handed out by
`actors.diloco.DiLoCoManagerActor`):

- a reconfigurable `ProcessGroupGloo` across replica groups (rank r of every
  group talks to rank r of the others, so FSDP shards meet their own shards),
  wrapped to count the bytes handed to it (`CountingProcessGroupGloo`);
- a `Manager` (synchronous quorum, as DiLoCo requires; `init_sync` off, see
  below) on the group's own TCPStore, registered with the lighthouse under the
  replica id;
- `torchft.local_sgd.DiLoCo` over the model split into `[diloco] fragments`
  (Streaming DiLoCo when > 1: fragment i syncs every H steps, staggered by H/F,
  its all-reduce overlapping `fragment_delay` inner steps), one outer SGD
  optimizer per fragment (`build_outer_optimizer`), optional quantized
  pseudo-gradients and `fragment_update_alpha`.

DiLoCo hooks the inner optimizer: every H / F `optimizer.step()` calls sync one
fragment (pseudo-gradient θ_global − θ_local, averaged over the quorum, outer
step from θ_global), so the trainer's step code is unchanged. A replica that
starts behind the quorum (a restart) heals from a live peer through torchft's
checkpoint transport: model, inner optimizer, the trainer's extra state and
each fragment's global weights and outer optimizer (`state_dict` / `load`).

Start: torchft's default `init_sync=True` makes every replica but replica 0
heal at the first quorum at step 0. DiLoCo's first quorum comes at the first
sync, after H inner steps, so the heal would overwrite each replica's round
(local weights, saved global copy) with replica 0's and the first outer step
would average replica 0's pseudo-gradient alone. So `init_sync` is off and a
group that starts with the run instead proves at join that it holds the same
weights as replica 0 (`start_digest`, sha256 of this rank's shards); a
replica that joins a running quorum later is behind its step and heals.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import urlsplit

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from composer_mesh.configs.sections.diloco import DiLoCoConfig
from composer_mesh.titan_ext.torchft_compat import (
    diloco_fragments,
    diloco_local_step,
    outer_optimizer,
    pending_quorum,
    quorum_id,
    replace_quorum_executor,
    set_diloco_local_step,
)


@dataclass(frozen=True)
class ReplicaAssignment:
    """What a replica group needs to join: its id (trailing digits = index) and the lighthouse."""

    replica_id: str
    index: int
    lighthouse_addr: str


class CountingProcessGroupGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, counting the payload bytes of every all-reduce it is handed."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.allreduce_calls = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:  # type: ignore[override]
        with self._lock:
            self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
            self.allreduce_calls += 1
        return super().allreduce(tensors, opts)


def build_outer_optimizer(params: Any, cfg: DiLoCoConfig) -> torch.optim.SGD:
    """The outer optimizer of `[diloco]`: SGD(lr, momentum, Nesterov) stepping on the averaged pseudo-gradient."""
    return torch.optim.SGD(
        params, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov and cfg.outer_momentum > 0
    )


def split_fragments(model: nn.Module, n: int) -> list[nn.Module]:
    """`n` contiguous fragments of the model's blocks, balanced by parameter count.

    Blocks are the top-level children, with `ModuleList` / `ModuleDict` children
    (a decoder's layers) expanded one level; blocks that share a parameter (tied
    embedding and LM head) stay in one fragment. A fragment is an `nn.ModuleList`
    view on its blocks (no copies). n = 1 gives the whole model.
    """
    if n == 1:
        return [model]
    direct = [name for name, _ in model.named_parameters(recurse=False)]
    if direct:
        raise ValueError(f"cannot fragment a model with parameters outside its blocks: {direct}")
    # blocks grouped by shared parameters, in first-seen order
    units: list[list[nn.Module]] = []
    owner: dict[int, int] = {}
    for child in model.children():
        for block in child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]:
            ids = [id(p) for p in block.parameters()]
            if not ids:
                continue
            shared = {owner[i] for i in ids if i in owner}
            u = min(shared) if shared else len(units)
            if not shared:
                units.append([])
            units[u].append(block)
            owner.update(dict.fromkeys(ids, u))
    if n > len(units):
        raise ValueError(f"diloco.fragments = {n} but the model has only {len(units)} blocks to split")
    sizes = [sum(p.numel() for p in nn.ModuleList(u).parameters()) for u in units]
    cuts = _balanced_cuts(sizes, n)
    return [nn.ModuleList([b for u in units[lo:hi] for b in u]) for lo, hi in zip([0, *cuts], [*cuts, len(units)])]


def _balanced_cuts(sizes: list[int], n: int) -> list[int]:
    """The n − 1 cut points of `sizes` into n contiguous non-empty parts with the smallest largest part (DP)."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: smallest largest part splitting sizes[:i] into k parts; cut[k][i]: where the last part starts
    best = [[inf] * (len(sizes) + 1) for _ in range(n + 1)]
    cut = [[0] * (len(sizes) + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, n + 1):
        for i in range(k, len(sizes) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    cuts, i = [], len(sizes)
    for k in range(n, 1, -1):
        i = cut[k][i]
        cuts.append(i)
    return cuts[::-1]


def _local(obj: Any) -> Any:
    """`obj` with every DTensor replaced by a copy of its local shard (what goes over the transport)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return obj


def _like(template: Any, loaded: Any) -> Any:
    """`loaded` (local shards) re-wrapped as DTensors wherever `template` holds one."""
    if isinstance(template, DTensor) and isinstance(loaded, torch.Tensor):
        return DTensor.from_local(
            loaded.to(template.device), template.device_mesh, template.placements,
            shape=template.shape, stride=template.stride(),
        )
    if isinstance(template, dict) and isinstance(loaded, dict):
        return {k: _like(template[k], v) if k in template else v for k, v in loaded.items()}
    if isinstance(template, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(template) == len(loaded):
        return type(loaded)(_like(t, v) for t, v in zip(template, loaded))
    return loaded


class _DaemonExecutor:
    """Stands in for the Manager's one-worker quorum executor, running each call on a daemon thread.

    A quorum that a stopping run never forms blocks inside torchft's Rust client until
    `quorum_timeout_s`, whatever happens to the lighthouse; on a pool thread it would hold the
    process at exit that long. Calls never overlap: the Manager waits for the previous quorum first.
    """

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                # `DiLoCoReplica.abort` may have failed it already
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(exc)
            else:
                with contextlib.suppress(InvalidStateError):
                    future.set_result(result)

        threading.Thread(target=run, name="torchft-quorum", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, **_: Any) -> None:
        """Nothing to join: a finished quorum's thread has ended, a stuck one is a daemon."""


def build_manager(
    cfg: DiLoCoConfig, pg: ProcessGroupGloo, assignment: ReplicaAssignment,
    load_state: Callable[[Any], None], state: Callable[[], Any], *,
    store_addr: str, store_port: int, group_rank: int = 0, group_world_size: int = 1,
) -> Manager:
    """A torchft Manager for one rank of a replica group: synchronous quorum, timeouts and quorum floor from `cfg`.

    `init_sync=False`: replicas at step 0 do not heal from replica 0 (see the module docstring); a
    replica behind the quorum's step still heals. Quorums run on daemon threads (`_DaemonExecutor`).
    """
    manager = Manager(
        pg=pg,
        load_state_dict=load_state,
        state_dict=state,
        min_replica_size=cfg.min_replicas,
        use_async_quorum=False,
        timeout=timedelta(seconds=cfg.timeout_s),
        quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
        connect_timeout=timedelta(seconds=cfg.timeout_s),
        rank=group_rank,
        world_size=group_world_size,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=assignment.lighthouse_addr,
        replica_id=assignment.replica_id,
        init_sync=False,
    )
    # Before the first quorum: no quorum ever runs on the pool.
    replace_quorum_executor(manager, _DaemonExecutor())
    return manager


class DiLoCoReplica:
    """One rank of a replica group: torchft Manager + DiLoCo hooked on `optimizer`.

    Collective across the group and the quorum: every rank of every replica
    group builds it, then steps the inner optimizer the same number of times.
    `extra_state` = (save, load) for trainer state outside model and optimizer
    (step, LR schedule) that a healing replica takes from its peer.
    `start_digest`: replica 0's `parameters_digest` for this rank when the
    groups start together (the first outer step averages every group's round,
    so they must start identical: a mismatch is a `ValueError`); None for a
    replica that joins a running quorum (it heals at its first sync).
    """

    def __init__(
        self,
        cfg: DiLoCoConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        assignment: ReplicaAssignment,
        *,
        store_addr: str,
        store_port: int,
        group_rank: int = 0,
        group_world_size: int = 1,
        extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
        start_digest: str | None = None,
    ) -> None:
        if cfg.quantize_pseudograd and not torch.cuda.is_available():
            raise ValueError("diloco.quantize_pseudograd needs CUDA (torchft's FP8 all-reduce kernels are Triton/CUDA)")
        if start_digest is not None and (own := parameters_digest(model)) != start_digest:
            raise ValueError(
                f"{assignment.replica_id} rank {group_rank} starts from different weights than replica 0 "
                f"(parameter digest {own[:12]} vs {start_digest[:12]}): the replica groups must start identical "
                "(same model seed / checkpoint, same procs_per_group)"
            )
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.assignment = assignment
        self._extra = extra_state
        self.pg = CountingProcessGroupGloo(timeout=timedelta(seconds=cfg.timeout_s))
        self.manager = build_manager(cfg, self.pg, assignment, self._load_state, self._state, store_addr=store_addr,
                                     store_port=store_port, group_rank=group_rank, group_world_size=group_world_size)
        self.fragments = split_fragments(model, cfg.fragments)
        self.outer_optimizers = [build_outer_optimizer(f.parameters(), cfg) for f in self.fragments]
        self.diloco = DiLoCo(
            self.manager,
            self.fragments,
            optimizer,
            self.outer_optimizers,
            sync_every=cfg.inner_steps,
            should_quantize=cfg.quantize_pseudograd,
            fragment_sync_delay=cfg.fragment_delay,
            fragment_update_alpha=cfg.fragment_update_alpha,
        )
        self.diloco.__enter__()
        # payload bytes of each committed or failed sync, in order
        self.sync_bytes: list[int] = []
        self.commits = 0
        self.failed_syncs = 0
        self.healed = 0
        # (manager step, bytes) at the previous sync boundary
        self._last = (0, 0)
        self._hook = optimizer.register_step_post_hook(self._after_step)  # runs after DiLoCo's hook
        self._aborted: BaseException | None = None
        self._pre_hook = optimizer.register_step_pre_hook(self._refuse_if_aborted)
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_lighthouse, name="diloco-lighthouse-watch", daemon=True)
        self._watchdog.start()

    # ---- state a healing peer receives ------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "model": _local(self.model.state_dict()),
            "optimizer": _local(self.optimizer.state_dict()),
            "extra": None if self._extra is None else self._extra[0](),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(_like(self.model.state_dict(), state["model"]))
        self.optimizer.load_state_dict(_like(self.optimizer.state_dict(), state["optimizer"]))
        if self._extra is not None and state["extra"] is not None:
            self._extra[1](state["extra"])
        self.healed += 1

    # ---- trainer checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's own state for this rank's trainer checkpoint (beside model and inner optimizer):
        the manager's step, the inner steps into the current round, and per fragment the global weights
        and outer optimizer (local shards). Every group checkpoints at the same step."""
        return {
            "manager": self.manager.state_dict(),
            "local_step": diloco_local_step(self.diloco),
            "fragments": [{"original_parameters": _local(f.original_parameters),
                           "outer_optimizer": _local(outer_optimizer(f).state_dict())}
                          for f in diloco_fragments(self.diloco)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`: the next sync continues the round and the outer momentum exactly."""
        if len(state["fragments"]) != len(diloco_fragments(self.diloco)):
            raise ValueError(f"checkpoint has {len(state['fragments'])} DiLoCo fragments, "
                             f"diloco.fragments = {len(diloco_fragments(self.diloco))}")
        self.manager.load_state_dict(state["manager"])
        set_diloco_local_step(self.diloco, state["local_step"])
        for fragment, saved in zip(diloco_fragments(self.diloco), state["fragments"]):
            with torch.no_grad():
                for name, t in saved["original_parameters"].items():
                    fragment.original_parameters[name].copy_(t)
            outer = outer_optimizer(fragment)
            params = [p for group in outer.param_groups for p in group["params"]]
            # momentum is shaped like p
            template = {"state": {i: {"momentum_buffer": p} for i, p in enumerate(params)}}
            outer.load_state_dict(_like(template, saved["outer_optimizer"]))
        self._last = (self.manager.current_step(), self.pg.bytes_sent)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _after_step(self, *_: Any) -> None:
        """Record bytes per sync: a sync happened when DiLoCo's local step counter wrapped to 0."""
        if diloco_local_step(self.diloco) != 0:
            return
        step, sent = self.manager.current_step(), self.pg.bytes_sent
        self.sync_bytes.append(sent - self._last[1])
        if step > self._last[0]:
            self.commits += 1
        else:
            self.failed_syncs += 1
        self._last = (step, sent)

    def status(self) -> dict[str, Any]:
        """Quorum, outer step and bytes, for the manager actor and benchmarks."""
        m = self.manager
        return {
            "replica_id": self.assignment.replica_id,
            "outer_step": m.current_step(),
            "quorum_id": quorum_id(m),
            "participants": m.num_participants() if quorum_id(m) >= 0 else 0,
            "batches_committed": m.batches_committed(),
            "commits": self.commits,
            "failed_syncs": self.failed_syncs,
            "healed": self.healed,
            "bytes_sent": self.pg.bytes_sent,
            "allreduce_calls": self.pg.allreduce_calls,
            "sync_bytes": list(self.sync_bytes),
        }

    # ---- failing fast when the run stops ----------------------------------------------------

    def _watch_lighthouse(self) -> None:
        """Abort once the lighthouse has not accepted a connection for `heartbeat_timeout_ms`.

        Without a lighthouse no quorum can form, and a sync already waiting would wait
        `quorum_timeout_s` (600 s by default). The controller shuts the lighthouse down when a
        replica group fails (`mesh.replicas`), so this is how the other groups hear of it.
        """
        url = urlsplit(self.assignment.lighthouse_addr)
        patience = self.cfg.heartbeat_timeout_ms / 1000
        last_ok = time.monotonic()
        while not self._closed.wait(patience / 3):
            if self._aborted is None:
                try:
                    socket.create_connection((url.hostname, url.port), timeout=patience / 3).close()
                    last_ok = time.monotonic()
                    continue
                except OSError:
                    if time.monotonic() - last_ok < patience:
                        continue
            # again every period once aborted: a quorum that started after the first abort fails too
            self.abort(f"the lighthouse {self.assignment.lighthouse_addr} has not answered for "
                       f"{patience:.1f} s (diloco.heartbeat_timeout_ms): the run is stopping")

    def abort(self, reason: str) -> None:
        """Fail this replica's pending quorum now and every later inner step, with `reason`."""
        self._aborted = RuntimeError(f"{self.assignment.replica_id}: {reason}")
        # torchft's in-flight quorum; the step thread waits on it
        pending = pending_quorum(self.manager)
        if pending is not None:
            # it finished meanwhile: the next step is refused
            with contextlib.suppress(InvalidStateError):
                pending.set_exception(self._aborted)

    def _refuse_if_aborted(self, *_: Any) -> None:
        if self._aborted is not None:
            raise self._aborted

    def close(self) -> None:
        self._closed.set()
        self._pre_hook.remove()
        self._hook.remove()
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


def parameters_digest(model: nn.Module) -> str:
    """sha256 of this rank's local parameter shards in order (replicas compare rank by rank)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()
