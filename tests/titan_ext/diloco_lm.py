"""A tiny next-token language-model task for DiLoCo checks and benchmarks.

The repo's tokenizer corpus (`titan_ext/data/tokenizer_corpus.txt`), tokenized
with the tiny tokenizer, split into a train head and a held-out tail; the tiny
TorchTitan model on one device; seeded random windows per (replica, step).
`run_replica` is one replica group's loop under a `DiLoCoReplica`; the
synchronous data-parallel baseline is `run_ddp` (every step averages the
gradients of all replicas' batches, i.e. one model on their union).

A test helper, not product code: the DiLoCo tests import it as `diloco_lm`
(tests/titan_ext is on their sys.path), the benchmarks put this directory on
sys.path first.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import TCPStore

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.assets import CORPUS_PATH, build_tokenizer
from composer_mesh.titan_ext.attention import attention_masks
from composer_mesh.titan_ext.build import build_model
from composer_mesh.titan_ext.diloco import DiLoCoReplica, ReplicaAssignment, parameters_digest
from composer_mesh.titan_ext.torchft_compat import LighthouseServer, diloco_local_step


@dataclass(frozen=True)
class LMTaskConfig:
    seq_len: int = 32
    batch: int = 8  # rows per replica per inner step
    lr: float = 3e-3  # inner AdamW
    heldout_fraction: float = 0.1
    heldout_rows: int = 64
    seed: int = 0


@functools.lru_cache(maxsize=1)
def corpus_ids() -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, held-out ids) `[N]`: the corpus tokenized, the last 10% held out."""
    ids = torch.tensor(build_tokenizer().encode(CORPUS_PATH.read_text()), dtype=torch.long)
    cut = int(len(ids) * (1 - LMTaskConfig.heldout_fraction))
    return ids[:cut], ids[cut:]


def windows(ids: torch.Tensor, rows: int, length: int, seed: int) -> torch.Tensor:
    """`[rows, length + 1]` random windows of `ids` (inputs + next-token labels), seeded."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length - 1, (rows,), generator=g)
    return torch.stack([ids[s : s + length + 1] for s in starts.tolist()])


def train_batch(cfg: LMTaskConfig, replica: int, step: int) -> torch.Tensor:
    """Replica `replica`'s rows at inner step `step` `[B, L + 1]` (disjoint seeds per replica and step)."""
    return windows(corpus_ids()[0], cfg.batch, cfg.seq_len, cfg.seed * 1_000_003 + replica * 100_003 + step)


def build_lm(seed: int = 0) -> nn.Module:
    """The tiny flavour on CPU, TorchTitan's seeded init (every replica starts identical)."""
    return build_model(ModelConfig(flavour="tiny", device="cpu", seed=seed), device="cpu")


def lm_loss(model: nn.Module, rows_BL1: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of `[B, L + 1]` rows."""
    tokens_BL, labels_BL = rows_BL1[:, :-1], rows_BL1[:, 1:]
    positions_BL = torch.arange(tokens_BL.shape[1]).expand_as(tokens_BL)
    logits_BLV = model(tokens_BL, positions_BL, attention_masks(model, positions_BL))
    return F.cross_entropy(logits_BLV.flatten(0, 1).float(), labels_BL.flatten())


@torch.no_grad()
def heldout_loss(model: nn.Module, cfg: LMTaskConfig) -> float:
    """Mean loss on fixed held-out windows (same windows for every model compared)."""
    rows = windows(corpus_ids()[1], cfg.heldout_rows, cfg.seq_len, seed=12345)
    was = model.training
    model.eval()
    loss = float(lm_loss(model, rows))
    model.train(was)
    return loss


def inner_optimizer(model: nn.Module, cfg: LMTaskConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)


def run_replica(
    replica: Any, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: LMTaskConfig, index: int,
    syncs: int, on_sync: Callable[[int], None] | None = None,
) -> int:
    """Inner steps on replica `index`'s data until the quorum has committed `syncs` (fragment) syncs.

    The data step follows the manager (a healed replica continues where its
    peers are); `on_sync(manager_step)` runs after each committed sync.
    Returns the inner steps this process took.
    """
    per_sync = replica.cfg.inner_steps // replica.cfg.fragments
    taken = 0
    last = replica.manager.current_step()
    while replica.manager.current_step() < syncs:
        step = replica.manager.current_step() * per_sync + diloco_local_step(replica.diloco)
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model, train_batch(cfg, index, step)).backward()
        optimizer.step()  # DiLoCo's hook syncs every H / fragments steps
        taken += 1
        now = replica.manager.current_step()
        if now != last and on_sync is not None:
            on_sync(now)
        last = now
    return taken


def run_ddp(cfg: LMTaskConfig, replicas: int, steps: int, seed: int = 0) -> nn.Module:
    """Synchronous data parallel, same tokens: each step one model on all replicas' batches."""
    model = build_lm(seed)
    optimizer = inner_optimizer(model, cfg)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        rows = torch.cat([train_batch(cfg, r, step) for r in range(replicas)])
        lm_loss(model, rows).backward()
        optimizer.step()
    return model


def run_in_threads(
    cfg: LMTaskConfig, diloco: Any, replicas: int,
    attach: Callable[[nn.Module, torch.optim.Optimizer, Any, int], Any],
    body: Callable[[int, Any, nn.Module, torch.optim.Optimizer], dict],
) -> tuple[list[nn.Module], list[dict]]:
    """`replicas` replica groups as threads of this process under an in-process lighthouse.

    Each replica: its own model (same seeded init), AdamW, TCPStore and
    `attach(model, optimizer, assignment, store_port)` (a `DiLoCoReplica`, or
    any object with `close()`), built here in turn (TorchTitan's model build is
    not thread-safe); then `body(index, member, model, optimizer)` runs in one
    thread per replica. Returns the final models and the bodies' results.
    """
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=diloco.min_replicas,
                                  join_timeout_ms=diloco.join_timeout_ms,
                                  heartbeat_timeout_ms=diloco.heartbeat_timeout_ms)
    corpus_ids()
    stores, models, optimizers, members = [], [], [], []
    try:
        for index in range(replicas):
            stores.append(TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60)))
            models.append(build_lm(cfg.seed))
            optimizers.append(inner_optimizer(models[-1], cfg))
            members.append(attach(models[-1], optimizers[-1],
                                  ReplicaAssignment(f"replica_{index}", index, lighthouse.address()), stores[-1].port))
        with ThreadPoolExecutor(replicas) as pool:
            results = list(pool.map(lambda i: body(i, members[i], models[i], optimizers[i]), range(replicas)))
    finally:
        for member in members:
            member.close()
        lighthouse.shutdown()
    return models, results


def run_diloco_threads(
    cfg: LMTaskConfig, diloco: Any, replicas: int, syncs: int,
    on_sync: Callable[[int, int, nn.Module], None] | None = None,
) -> tuple[list[nn.Module], list[dict]]:
    """DiLoCo on `replicas` thread replicas until `syncs` syncs; returns the models and each replica's status.
    `on_sync(replica, manager_step, model)` runs in the replica's thread after a committed sync."""
    start: list[str] = []  # replica 0's start digest (attach runs in replica order)

    def attach(model: nn.Module, optimizer: torch.optim.Optimizer, assignment: Any, port: int) -> DiLoCoReplica:
        start.append(start[0] if start else parameters_digest(model))
        return DiLoCoReplica(diloco, model, optimizer, assignment, store_addr="127.0.0.1", store_port=port,
                             start_digest=start[0])

    def body(index: int, replica: DiLoCoReplica, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        hook = None if on_sync is None else (lambda step: on_sync(index, step, model))
        run_replica(replica, model, optimizer, cfg, index, syncs, hook)
        return replica.status()

    return run_in_threads(cfg, diloco, replicas, attach, body)
