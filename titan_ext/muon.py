"""Sharded Muon: every matrix is orthogonalised once, on one owner rank.

Muon (Keller Jordan 2024; Moonlight, arXiv:2502.16982) replaces the update of a
hidden-layer matrix by the orthogonalised momentum NS(B). Under FSDP2 a rank
holds only a slice of B, and Newton–Schulz needs the whole matrix. Running NS on
DTensors (what `torch.optim.Muon` does with FSDP2 params) issues collectives in
every iteration of every matrix. Here each sharded matrix has one owner rank,
chosen greedily by size so ranks get similar work: one `all_to_all` moves the
shards of many matrices to their owners, the owners run NS (batched over
same-shaped matrices), and one `all_to_all` returns the slices — two
collectives per exchange round (one round per shard group unless `bucket_bytes`
splits it), on gloo and NCCL alike. Stacked expert weights `[E, m, n]` sharded
on dim 0 (expert parallel) already hold whole matrices locally and need no
communication.

AdamW updates the other parameters (embeddings, norms, head, biases) inside the
same `torch.optim.Optimizer`, so LR schedulers, `state_dict` and DCP see one
object. `titan_ext.optimizer` builds it from `[optimizer]` (or, on CUDA,
TorchTitan's `DistMuon`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer
from torch.optim.adam import adam

from composer_mesh.titan_ext.low_precision import stochastic_round_to_bf16_

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NS_KERNELS = ("auto", "native", "fp32_accumulate", "emulated")


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), per torch.cpu's probes (torch 2.13)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_ns_kernel(kernel: str, dtype: torch.dtype, device: torch.device) -> str:
    """How Newton–Schulz in a 16-bit `dtype` computes; float32 is always `native`.

    native:          torch's matmuls in `dtype` (what `torch.optim.Muon` computes, bit for bit).
    fp32_accumulate: the update is rounded to `dtype` and so is the result;
                     normalisation and iterations run in fp32 (fp32 speed and accuracy inside).
    emulated:        every result rounded to `dtype`, each matmul an fp32 GEMM on the
                     `dtype` values (exact products, fp32 accumulation): a bf16 GEMM's
                     arithmetic with another summation order, at fp32 GEMM speed plus the roundings.
    auto:            fp32_accumulate on a CPU without bf16 matmul units (torch's bf16
                     matmul falls back to slow kernels there), else native.
    """
    if kernel not in NS_KERNELS:
        raise ValueError(f"ns_kernel must be one of {list(NS_KERNELS)}, got {kernel!r}")
    if dtype == torch.float32:
        return "native"
    if kernel == "auto":
        return "fp32_accumulate" if device.type == "cpu" and not cpu_has_bf16_matmul() else "native"
    return kernel


def zeropower_via_newtonschulz(
    update: torch.Tensor,
    *,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
    kernel: str = "native",
) -> torch.Tensor:
    """Quintic Newton–Schulz approximation of the polar factor U·Vᵀ of each matrix.

    update: [m, n] or a batch [E, m, n] of independent matrices, in any float
    dtype (`ShardedMuon` hands it over in `dtype`, rounded once where it is
    made). Each matrix is divided by its Frobenius norm (floored at eps), then
    X ← aX + (bA + cA²)X with A = XXᵀ, on the wide orientation (m ≤ n), in
    `dtype` as `kernel` (`resolve_ns_kernel`) says; `native` uses the same
    kernels as `torch.optim.Muon`. Returns a tensor of update's shape in
    `dtype`, as `torch.optim.Muon`'s Newton–Schulz does: the step adds it to the
    parameters in their dtype (a mixed-dtype `add_`, no copy).
    """
    a, b, c = coefficients
    kernel = resolve_ns_kernel(kernel, dtype, update.device)
    if kernel == "native":
        x = update.to(dtype=dtype, copy=True)
    else:
        # `dtype` values in fp32 buffers, for fp32 GEMMs (one copy for an update already in `dtype`)
        x = update.to(dtype).float()
    each_result = kernel == "emulated"

    def held(t: torch.Tensor) -> torch.Tensor:
        # emulated: round to `dtype` in place, so the next GEMM reads `dtype` values
        return t.copy_(t.to(dtype)) if each_result else t

    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.transpose(-2, -1)
    if x.ndim == 2:
        held(x.div_(held(x.norm().clamp(min=eps))))
        for _ in range(steps):
            gram = held(x @ x.T)  # [m, m]
            poly = held(torch.addmm(gram, gram, gram, beta=b, alpha=c))
            x = held(torch.addmm(x, poly, x, beta=a))
    else:
        held(x.div_(held(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))))
        for _ in range(steps):
            gram = held(x @ x.transpose(-2, -1))  # [E, m, m]
            poly = held(torch.baddbmm(gram, gram, gram, beta=b, alpha=c))
            x = held(torch.baddbmm(x, poly, x, beta=a))
    if transposed:
        x = x.transpose(-2, -1)
    return x.to(dtype)


def adjusted_lr(lr: float, lr_adjust: str, rows: int, cols: int) -> float:
    """Muon's per-matrix LR: original √max(1, m/n), or 0.2·√max(m, n) to match AdamW's update RMS."""
    if lr_adjust == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if lr_adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"lr_adjust must be 'original' or 'match_rms_adamw', got {lr_adjust!r}")


# ---------------------------------------------------------------------------
# Where a parameter's matrices live, and who orthogonalises them.


@dataclass(frozen=True)
class _Layout:
    """How one Muon parameter's update reaches Newton–Schulz.

    local:   this rank holds whole matrices (plain tensor, replicated DTensor,
             or [E, m, n] sharded on dim 0 only, e.g. EP) — NS here, no communication.
    owner:   one mesh dim shards a matrix dim: the shards of the slab (the
             local tensor with that dim made whole) go to `owner` (rank in
             `group`), which runs NS and sends the slices back. Other mesh
             dims may replicate or shard the expert dim 0 (EP × FSDP).
    gather:  any other placement: all ranks rebuild the full tensor and run NS
             (correct, slower; e.g. FSDP × TP 2-D sharding of one matrix).
    """

    kind: Literal["local", "owner", "gather"]
    # ProcessGroup of the sharding mesh dim (owner)
    group: Any = None
    shard_dim: int = 0
    # size along shard_dim on each group rank
    shard_sizes: tuple[int, ...] = ()
    # what the owner reassembles
    slab_shape: tuple[int, ...] = ()
    owner: int = 0
    # exchange round within the group (bounds the owner's memory)
    bucket: int = 0

    def shard_shape(self, rank: int) -> list[int]:
        shape = list(self.slab_shape)
        shape[self.shard_dim] = self.shard_sizes[rank]
        return shape


def _chunk_sizes(size: int, parts: int) -> tuple[int, ...]:
    """DTensor `Shard` sizes: torch.chunk convention, ceil(size / parts) per rank, tail short or empty."""
    chunk = -(-size // parts)
    return tuple(max(0, min(size, (r + 1) * chunk) - r * chunk) for r in range(parts))


def _classify(p: torch.Tensor) -> _Layout:
    if not isinstance(p, DTensor):
        return _Layout("local")
    sharded = [(d, pl) for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    # Shard (or _StridedShard) of the expert dim keeps whole matrices on each rank.
    matrix = [(d, pl) for d, pl in sharded if not (p.ndim == 3 and isinstance(pl, Shard) and pl.dim == 0)]
    if not matrix:
        return _Layout("local")
    if len(matrix) == 1 and type(matrix[0][1]) is Shard:
        mesh_dim, placement = matrix[0]
        local = p.to_local().shape
        sizes = _chunk_sizes(p.shape[placement.dim], p.device_mesh.size(mesh_dim))
        me = p.device_mesh.get_local_rank(mesh_dim)
        if sizes[me] != local[placement.dim]:
            raise ValueError(f"unexpected shard size {local[placement.dim]} (expected {sizes[me]}) "
                             f"for {tuple(p.shape)} {p.placements}")
        slab = list(local)
        slab[placement.dim] = p.shape[placement.dim]
        return _Layout("owner", p.device_mesh.get_group(mesh_dim), placement.dim, sizes, tuple(slab))
    return _Layout("gather")


def assign_owners(numels: list[int], world: int, load: list[int] | None = None) -> list[int]:
    """Greedy balance: largest matrix first, to the least-loaded rank (ties: lowest rank). Deterministic.

    load: per-rank work already assigned (earlier buckets); updated in place.
    """
    load = [0] * world if load is None else load
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


@dataclass
class MuonStepStats:
    """What the last `step()` did on this rank (for tests and metrics)."""

    # matrices (expert matrices counted one by one) NS'ed here
    orthogonalized: int = 0
    orthogonalized_numel: int = 0
    collectives: int = 0
    # elements this rank sent in collectives, and their bytes (2 an element for a bf16 update)
    comm_numel: int = 0
    comm_bytes: int = 0


# ---------------------------------------------------------------------------


class ShardedMuon(Optimizer):
    """Muon on groups with `use_muon=True`, AdamW on the others, one optimizer.

    Muon group keys: lr, weight_decay, momentum, nesterov, ns_steps,
    ns_coefficients, eps (NS norm floor), ns_dtype, ns_kernel, lr_adjust.
    AdamW group keys: lr, weight_decay, betas, eps, moments_dtype ("float32", or
    "bfloat16": the moments stored in 2 bytes, updated in float32 one parameter
    at a time and stored back by stochastic rounding, `titan_ext.low_precision`).
    Per matrix: B ← μB + (1−μ)g; U = (1−μ)g + μB (Nesterov) or B;
    O = NS(U); θ ← θ(1 − lr·wd) − adjusted_lr·O — the update of
    `torch.optim.Muon`. Params may be plain tensors or DTensors (FSDP2, HSDP,
    EP); whether a param has a grad must agree across its shard group.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]] | Iterable[torch.Tensor], *, bucket_bytes: int = 512 * 2**20) -> None:
        """bucket_bytes: most full-matrix bytes an exchange round moves to owners (one matrix may exceed it)."""
        defaults = dict(
            lr=1e-3, weight_decay=0.1, use_muon=True, momentum=0.95, nesterov=True, ns_steps=5,
            ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_dtype="bfloat16", ns_kernel="auto",
            lr_adjust="match_rms_adamw", betas=(0.9, 0.95), moments_dtype="float32",
        )
        param_groups = list(param_groups)
        if param_groups and isinstance(param_groups[0], torch.Tensor):
            param_groups = [{"params": param_groups}]
        param_groups = [dict(g) for g in param_groups]
        for g in param_groups:
            if not g.get("use_muon", True):
                # AdamW's epsilon, not the NS norm floor
                g.setdefault("eps", 1e-8)
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if group["moments_dtype"] not in _DTYPES:
                raise ValueError(f"moments_dtype must be one of {sorted(_DTYPES)}, got {group['moments_dtype']!r}")
            if group["use_muon"]:
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(f"Muon needs 2-D or stacked 3-D [E, m, n] params, got shape {tuple(p.shape)}")
                if group["ns_dtype"] not in _DTYPES:
                    raise ValueError(f"ns_dtype must be one of {sorted(_DTYPES)}, got {group['ns_dtype']!r}")
                resolve_ns_kernel(group["ns_kernel"], torch.float32, torch.device("cpu"))
                adjusted_lr(1.0, group["lr_adjust"], 1, 1)
        self._layouts: dict[torch.Tensor, _Layout] = {}
        self._assign(bucket_bytes)
        self.stats = MuonStepStats()

    def _assign(self, bucket_bytes: int) -> None:
        """Classify every Muon param; cut each shard group's owner-path params into buckets (param
        order, ≤ bucket_bytes of full slabs) and give each an owner, balancing the total work per rank."""
        by_group: dict[Any, list[torch.Tensor]] = {}
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                layout = _classify(p)
                self._layouts[p] = layout
                if layout.kind == "owner":
                    by_group.setdefault(layout.group, []).append(p)
        for pg, params in by_group.items():
            load = [0] * dist.get_world_size(pg)
            buckets: list[list[torch.Tensor]] = [[]]
            filled = 0
            for p in params:
                size = math.prod(self._layouts[p].slab_shape) * p.element_size()
                if buckets[-1] and filled + size > bucket_bytes:
                    buckets.append([])
                    filled = 0
                buckets[-1].append(p)
                filled += size
            for k, bucket in enumerate(buckets):
                owners = assign_owners([math.prod(self._layouts[p].slab_shape) for p in bucket], len(load), load)
                for p, owner in zip(bucket, owners):
                    self._layouts[p] = dataclasses.replace(self._layouts[p], owner=owner, bucket=k)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading casts every floating state tensor to its param's dtype (float32): cast AdamW's moments
        back to the configured `moments_dtype`, which stays this optimizer's, not the checkpoint's."""
        configured = [g["moments_dtype"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, moments in zip(self.param_groups, configured):
            group["moments_dtype"] = moments
            if group["use_muon"]:
                continue
            for p in group["params"]:
                state = self.state.get(p, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key] = state[key].to(_DTYPES[moments])

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = run_closure(closure)
        self.stats = MuonStepStats()
        # (param, group) of every Muon parameter with a gradient
        pending: list[tuple[torch.Tensor, dict]] = []
        for group in self.param_groups:
            if group["use_muon"]:
                pending.extend((p, group) for p in group["params"] if p.grad is not None)
            else:
                self._adamw(group)
        self._orthogonalize_and_apply(pending)
        return loss

    def _momentum(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """Shard-local momentum (elementwise, so no communication): returns the local update U in the NS dtype.

        U is written in `ns_dtype` by the pass that makes it (what `torch.optim.Muon` gets by rounding
        its fp32 U on the way into Newton–Schulz, bit for bit), so a bf16 update is exchanged, held
        and orthogonalised at 2 bytes an element and never rounded in a pass of its own.
        """
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = _local(state["momentum_buffer"])
        grad = p.grad
        if isinstance(grad, DTensor) and grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        grad = _local(grad)
        buf.lerp_(grad, 1 - group["momentum"])
        dtype = _DTYPES[group["ns_dtype"]]
        if not group["nesterov"]:
            return buf.to(dtype, copy=True)
        return torch.lerp(grad, buf, group["momentum"], out=torch.empty_like(grad, dtype=dtype))

    def _orthogonalize_and_apply(self, pending: list[tuple[torch.Tensor, dict]]) -> None:
        """NS every update once, then θ ← θ(1 − lr·wd) − adjusted_lr·O on the local shard.

        Exchange rounds are pipelined: the next round's shards travel while
        this rank orthogonalises the current round (and, first, its local
        matrices such as EP experts). A matrix that needs no exchange is
        updated, orthogonalised and applied one at a time, so its update and
        result never coexist with the others' (an fp32 model's worth each).
        """
        rounds: dict[tuple[Any, int, torch.dtype], list[tuple[int, torch.Tensor, dict, torch.Tensor]]] = {}
        for i, (p, group) in enumerate(pending):
            layout = self._layouts[p]
            if layout.kind == "owner":
                update = self._momentum(p, group)
                rounds.setdefault((layout.group, layout.bucket, update.dtype), []).append((i, p, group, update))
        exchanges = [_Exchange(pg, items, self._layouts) for (pg, _, _), items in rounds.items()]
        if exchanges:
            exchanges[0].send_to_owners()
        for p, group in pending:
            kind = self._layouts[p].kind
            if kind == "local":
                self._apply(p, group, self._ns(self._momentum(p, group), group))
            elif kind == "gather":
                self._apply(p, group, self._gather_ns(p, self._momentum(p, group), group))
        for k, ex in enumerate(exchanges):
            if k + 1 < len(exchanges):
                exchanges[k + 1].send_to_owners()
            ex.orthogonalize_and_return(self._ns_batched)
        for ex in exchanges:
            for i, result in ex.results().items():
                self._apply(*pending[i], result)
            self.stats.collectives += 2
            self.stats.comm_numel += ex.sent_numel
            self.stats.comm_bytes += ex.sent_bytes

    @staticmethod
    def _apply(p: torch.Tensor, group: dict, ortho: torch.Tensor) -> None:
        p_local = _local(p)
        p_local.mul_(1 - group["lr"] * group["weight_decay"])
        p_local.add_(ortho, alpha=-adjusted_lr(group["lr"], group["lr_adjust"], p.shape[-2], p.shape[-1]))

    def _ns(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        if update.numel() == 0:
            return update
        matrices = update.shape[0] if update.ndim == 3 else 1
        self.stats.orthogonalized += matrices
        self.stats.orthogonalized_numel += update.numel()
        return zeropower_via_newtonschulz(
            update, coefficients=tuple(group["ns_coefficients"]), steps=group["ns_steps"], eps=group["eps"],
            dtype=_DTYPES[group["ns_dtype"]], kernel=group["ns_kernel"],
        )

    def _gather_ns(self, p: DTensor, update: torch.Tensor, group: dict) -> torch.Tensor:
        """Fallback for placements the owner path does not cover: every rank orthogonalises the full tensor."""
        full = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        self.stats.collectives += 1
        ortho = self._ns(full, group)
        replicated = DTensor.from_local(ortho, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
        return replicated.redistribute(p.device_mesh, p.placements).to_local()

    def _ns_batched(self, full: dict[int, torch.Tensor], groups: dict[int, dict]) -> dict[int, torch.Tensor]:
        """NS on an owner's matrices: same shape and hyper-parameters → one batched call."""
        batches: dict[tuple, list[int]] = defaultdict(list)
        for i, u in full.items():
            g = groups[i]
            batches[(tuple(u.shape), g["ns_steps"], tuple(g["ns_coefficients"]), g["eps"], g["ns_dtype"],
                     g["ns_kernel"])].append(i)
        out = {}
        for (shape, *_), indices in batches.items():
            if len(indices) == 1 or len(shape) != 2:
                for i in indices:
                    out[i] = self._ns(full[i], groups[i])
                continue
            stacked = self._ns(torch.stack([full[i] for i in indices]), groups[indices[0]])  # [k, m, n]
            out.update(zip(indices, stacked.unbind(0)))
        return out

    def _adamw(self, group: dict) -> None:
        moments_dtype = _DTYPES[group["moments_dtype"]]
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, dtype=moments_dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=moments_dtype)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        update = functools.partial(
            adam, foreach=None, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )
        if moments_dtype == torch.float32:
            update(params, grads, exp_avgs, exp_avg_sqs, [], steps)
            return
        # bfloat16 moments: float32 math one parameter at a time (transients of one parameter), stored back by
        # stochastic rounding; the noise is seeded by (rank, step, position), so a resumed run draws the same
        rank = dist.get_rank() if dist.is_initialized() else 0
        for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
            m32, v32 = m.float(), v.float()
            update([p], [g], [m32], [v32], [], [step])
            gen = torch.Generator(device=_local(m).device).manual_seed(hash((rank, int(step.item()), i)) & (2**63 - 1))
            stochastic_round_to_bf16_(_local(m), _local(m32), gen)
            stochastic_round_to_bf16_(_local(v), _local(v32), gen)


class _Exchange:
    """One round of the owner path on one shard group: shards → owners, NS on owners, slices back.

    items: (index, param, group, local update). Both all_to_all calls are
    asynchronous; the flat buffers are laid out by (owner, param order) on
    every rank, so all sides agree on them without exchanging metadata.
    """

    def __init__(self, pg: Any, items: list[tuple[int, torch.Tensor, dict, torch.Tensor]],
                 layouts: dict[torch.Tensor, _Layout]) -> None:
        self.pg = pg
        self.world, me = dist.get_world_size(pg), dist.get_rank(pg)
        self.layouts = {i: layouts[p] for i, p, _, _ in items}
        self.items = sorted(items, key=lambda it: (self.layouts[it[0]].owner, it[0]))
        self.mine = [it for it in self.items if self.layouts[it[0]].owner == me]
        self.send_splits = [0] * self.world
        for i, _, _, _ in self.items:
            self.send_splits[self.layouts[i].owner] += math.prod(self.layouts[i].shard_shape(me))
        self.recv_splits = [sum(math.prod(self.layouts[i].shard_shape(src)) for i, _, _, _ in self.mine)
                            for src in range(self.world)]
        self.sent_numel = self.sent_bytes = 0

    def send_to_owners(self) -> None:
        self.send = torch.cat([u.reshape(-1) for _, _, _, u in self.items])
        self.recv = self.send.new_empty(sum(self.recv_splits))
        self.work = dist.all_to_all_single(self.recv, self.send, self.recv_splits, self.send_splits,
                                           group=self.pg, async_op=True)

    def orthogonalize_and_return(self, ns_batched: Any) -> None:
        """Owner: rebuild each full slab from every source rank's piece, NS them, send the slices back."""
        self.work.wait()
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i, _, _, _ in self.mine}
        offset = 0
        for src in range(self.world):
            for i, _, _, _ in self.mine:
                shape = self.layouts[i].shard_shape(src)
                pieces[i].append(self.recv[offset:offset + math.prod(shape)].view(shape))
                offset += math.prod(shape)
        full = {i: torch.cat(pieces[i], dim=self.layouts[i].shard_dim) for i, _, _, _ in self.mine}
        ortho = ns_batched(full, {i: group for i, _, group, _ in self.mine})
        back = [
            ortho[i].narrow(lay.shard_dim, sum(lay.shard_sizes[:dst]), lay.shard_sizes[dst]).reshape(-1)
            for dst in range(self.world) for i, lay in ((i, self.layouts[i]) for i, _, _, _ in self.mine)
        ]
        # kept alive until the work is done
        self.back = torch.cat(back) if back else self.send.new_empty(0)
        self.result_flat = self.send.new_empty(self.send.numel())
        self.work = dist.all_to_all_single(self.result_flat, self.back, self.send_splits, self.recv_splits,
                                           group=self.pg, async_op=True)
        self.sent_numel = self.send.numel() + self.back.numel()
        self.sent_bytes = self.sent_numel * self.send.element_size()
        # the owner's full slabs live only in this call
        del self.send, self.recv

    def results(self) -> dict[int, torch.Tensor]:
        """Wait for the slices; this rank's orthogonalised shard per item index."""
        self.work.wait()
        del self.back
        out, offset = {}, 0
        for i, _, _, u in self.items:
            out[i] = self.result_flat[offset:offset + u.numel()].view(u.shape)
            offset += u.numel()
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run_closure(closure: Any) -> Any:
    """torch.optim convention: re-evaluate the loss with grad enabled inside a no-grad step."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
