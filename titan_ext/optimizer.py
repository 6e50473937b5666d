"""The optimizer and LR schedule of `[optimizer]`, built for a model.

`build_optimizer` gives one `torch.optim.Optimizer`: AdamW on every
parameter, or Muon on the matrices `split_muon_params` picks and AdamW on the
rest, as `titan_ext.muon.ShardedMuon` (the owner path) or, on CUDA, as
TorchTitan's `DistMuon` (flex_shard) chained with torch's AdamW
(`ChainedOptimizer`). `build_lr_scheduler` wraps it in TorchTitan's
warmup-stable-decay schedule.
"""

from __future__ import annotations

import functools
import glob
import re
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from composer_mesh.configs.sections.optimizer import OptimizerConfig
from composer_mesh.titan_ext.muon import ShardedMuon, run_closure

_ADAMW_MODULES = (nn.Embedding, nn.LayerNorm, nn.RMSNorm)


def split_muon_params(model: nn.Module, adamw_patterns: Iterable[str]) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(muon, adamw) named params: Muon for 2-D / stacked 3-D matrices that are not embeddings, head or norms.

    AdamW: params of nn.Embedding / norm modules, names matching any of
    adamw_patterns (re.search), and everything not 2-D or 3-D. Tied params
    are listed once; frozen params are left out.
    """
    patterns = [re.compile(pat) for pat in adamw_patterns]
    forced = {id(p) for m in model.modules() if isinstance(m, _ADAMW_MODULES) or "norm" in type(m).__name__.lower()
              for p in m.parameters(recurse=False)}
    muon, adamw = [], []
    for name, p in model.named_parameters():  # deduplicates tied params
        if not p.requires_grad:
            continue
        is_matrix = p.ndim in (2, 3) and id(p) not in forced and not any(pat.search(name) for pat in patterns)
        (muon if is_matrix else adamw).append((name, p))
    return muon, adamw


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> Optimizer:
    """The optimizer `cfg` describes, as one `torch.optim.Optimizer`.

    name = "adamw": AdamW on every parameter. name = "muon": Muon (sharded
    owner path, or TorchTitan's DistMuon per `cfg.backend`) on the matrices
    `split_muon_params` picks, AdamW on the rest.
    """
    adamw_keys = dict(weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), eps=cfg.eps, use_muon=False,
                      moments_dtype=cfg.moments_dtype)
    if cfg.name == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return ShardedMuon([dict(params=params, lr=cfg.lr, **adamw_keys)])
    muon, adamw = split_muon_params(model, cfg.adamw_patterns)
    muon_keys = dict(
        lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
        ns_steps=cfg.ns_steps, ns_coefficients=tuple(cfg.ns_coefficients), eps=cfg.ns_eps, ns_dtype=cfg.ns_dtype,
        ns_kernel=cfg.ns_kernel, lr_adjust=cfg.lr_adjust,
    )
    backend = cfg.backend
    if backend == "auto":
        fits = (cfg.ns_dtype == "bfloat16" and cfg.ns_kernel in ("auto", "native") and cfg.moments_dtype == "float32"
                and _dist_muon_applicable([p for _, p in muon]))
        backend = "dist_muon" if fits else "owner"
    if backend == "dist_muon":
        return _build_dist_muon(muon, adamw, cfg)
    groups = [dict(params=[p for _, p in muon], use_muon=True, **muon_keys)] if muon else []
    if adamw:
        groups.append(dict(params=[p for _, p in adamw], lr=cfg.adamw_lr, **adamw_keys))
    return ShardedMuon(groups, bucket_bytes=int(cfg.bucket_mb * 2**20))


def build_lr_scheduler(optimizer: Optimizer, cfg: OptimizerConfig, training_steps: int) -> Any:
    """TorchTitan's LambdaLR warmup-stable-decay schedule over `optimizer`, from the [optimizer] knobs.

    Returns a `torchtitan.components.optimizer.lr_scheduler.LRSchedulersContainer`
    (step / state_dict / load_state_dict / get_metrics); every param group
    (Muon and AdamW) is scaled by the same factor of its own base LR. The
    knobs keep TorchTitan's meaning (the section docs state it): with W warmup
    and D decay steps out of T, step s runs at factor (s + 1) / W for s < W,
    1 through step T − D, then decays to min_lr_factor, which it reaches after
    the last step; decay_ratio = None means D = T − W.
    """
    schedule = LRSchedulersContainer.Config(
        warmup_steps=cfg.warmup_steps, decay_ratio=cfg.decay_ratio, decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    container = schedule.build(optimizers=[optimizer], training_steps=training_steps)
    # LambdaLR: past the last step TorchTitan's decay goes below the floor
    for scheduler in container.schedulers:
        scheduler.lr_lambdas = [functools.partial(_held_after, f, training_steps, cfg.min_lr_factor)
                                for f in scheduler.lr_lambdas]
    return container


def _held_after(factor: Callable[[int], float], steps: int, floor: float, step: int) -> float:
    """`factor(step)` for the schedule's `steps` steps, then `floor`: TorchTitan's linear decay keeps going
    past its end (1 − progress < 0), so an optimizer stepped beyond `trainer.steps` would ascend the gradient."""
    return factor(step) if step < steps else floor


# ---------------------------------------------------------------------------
# CUDA: TorchTitan's DistMuon (flex_shard). Needs one CUDA device per process;
# it refuses CPU tensors, so this path cannot run on the CPU CI box.


def _dist_muon_applicable(params: list[torch.Tensor]) -> bool:
    """DistMuon fits: CUDA DTensors on meshes with named axes, each layout one DistMuon supports."""
    if not params or not torch.cuda.is_available():
        return False
    try:
        # lazy: flex_shard is experimental in TorchTitan (absent from some builds); only CUDA runs need it
        import torchtitan.distributed.flex_shard  # noqa: F401
    except ImportError:
        return False
    return all(
        isinstance(p, DTensor) and p.device.type == "cuda" and p.device_mesh.mesh_dim_names is not None
        and _dist_muon_layout(p) is not None
        for p in params
    )


def _dist_muon_layout(p: DTensor) -> Any:
    """DistMuon ComputeLayout: whole-matrix `Owned` for sharded 2-D, `Shard(0)` per expert for 3-D; None if unsupported."""
    # lazy: flex_shard is experimental in TorchTitan (absent from some builds); only CUDA runs need it
    from torchtitan.distributed.flex_shard import ComputeLayout, Owned

    names = p.device_mesh.mesh_dim_names
    sharded = [names[d] for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if not sharded or any(type(p.placements[names.index(n)]) is not Shard for n in sharded):
        return None
    if p.ndim == 2 and len(sharded) == 1:
        return ComputeLayout(shardings_by_mesh_axis={sharded[0]: Owned()})
    if p.ndim == 3 and all(p.placements[names.index(n)].dim == 0 for n in sharded):
        return ComputeLayout(shardings_by_mesh_axis={n: Shard(0) for n in sharded})
    return None


def _build_dist_muon(muon: list[tuple[str, nn.Parameter]], adamw: list[tuple[str, nn.Parameter]], cfg: OptimizerConfig) -> Optimizer:
    """DistMuon on the matrices + torch AdamW on the rest, chained into one optimizer."""
    # lazy: flex_shard is experimental in TorchTitan (absent from some builds); only CUDA runs need it
    from torchtitan.distributed.flex_shard import BucketConfig, build_dist_muon

    if cfg.ns_dtype != "bfloat16":
        raise ValueError("backend='dist_muon' runs Newton–Schulz in bfloat16; set optimizer.ns_dtype = 'bfloat16' or use backend='owner'")
    if cfg.ns_kernel not in ("auto", "native"):
        raise ValueError("backend='dist_muon' runs Newton–Schulz with torch's bf16 matmuls; set optimizer.ns_kernel = 'auto' or "
                         "'native', or use backend='owner'")
    if cfg.moments_dtype != "float32":
        raise ValueError("backend='dist_muon' chains torch's AdamW, whose moments are float32; set "
                         "optimizer.moments_dtype = 'float32' or use backend='owner'")
    if not _dist_muon_applicable([p for _, p in muon]):
        raise ValueError("backend='dist_muon' needs CUDA DTensor params on named meshes, 2-D sharded on one axis or 3-D on dim 0")
    names = [canonical_fqn(name) for name, _ in muon]
    # DistMuon buckets must share one transport group
    buckets: dict[tuple, list[str]] = {}
    for name, (_, p) in zip(names, muon):
        sharded = tuple(n for n, pl in zip(p.device_mesh.mesh_dim_names, p.placements) if not isinstance(pl, Replicate))
        buckets.setdefault((p.ndim, sharded, tuple(p.device_mesh.mesh.flatten().tolist())), []).append(name)
    dist_muon = build_dist_muon(
        [dict(params=[p for _, p in muon], param_names=names)],
        compute_sharding_by_fqn={name: _dist_muon_layout(p) for name, (_, p) in zip(names, muon)},
        bucket_configs=[
            BucketConfig(patterns=tuple(glob.escape(n) for n in fqns), name=f"muon{k}")
            for k, fqns in enumerate(buckets.values())
        ],
        lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
        ns_coefficients=tuple(cfg.ns_coefficients), eps=cfg.ns_eps, ns_steps=cfg.ns_steps, adjust_lr_fn=cfg.lr_adjust,
    )
    children: list[Optimizer] = [dist_muon]
    if adamw:
        children.append(torch.optim.AdamW(
            [p for _, p in adamw], lr=cfg.adamw_lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
        ))
    return ChainedOptimizer(children)


class ChainedOptimizer(Optimizer):
    """Several optimizers on disjoint params behaving as one (step, zero_grad, state_dict, LR schedulers, DCP).

    `param_groups` is the children's group dicts in order, so a scheduler that
    edits `lr` edits the children; `state` is their merged view. `state_dict()`
    is torch's own flat format over that view (so DCP can name every entry);
    `load_state_dict` splits it back per child — each child's own load hooks
    run — and re-links the groups, which torch replaces on load.
    """

    def __init__(self, children: list[Optimizer]) -> None:
        self.children = children
        super().__init__([p for child in children for g in child.param_groups for p in g["params"]], {})
        self._link()

    def _link(self) -> None:
        self.param_groups = [g for child in self.children for g in child.param_groups]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = run_closure(closure)
        for child in self.children:
            child.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.children:
            child.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> dict:  # type: ignore[override]
        return {p: s for child in self.children for p, s in child.state.items()}

    @state.setter
    def state(self, value: dict) -> None:
        if value:
            raise ValueError("ChainedOptimizer state lives in its children")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Split torch's flat format (what `state_dict()` and DCP produce) back into the children's."""
        if set(state_dict) != {"state", "param_groups"}:
            raise ValueError(f"expected torch's optimizer state dict ('state', 'param_groups'), got keys {sorted(state_dict)}")
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in groups] != sizes:
            raise ValueError(f"state dict has param groups of sizes {[len(g['params']) for g in groups]}, "
                             f"this optimizer {sizes}")
        first_group = 0
        for child in self.children:
            n_groups = len(child.param_groups)
            indices = [i for g in groups[first_group:first_group + n_groups] for i in g["params"]]
            renumber = {old: new for new, old in enumerate(indices)}
            child.load_state_dict({
                "state": {renumber[k]: v for k, v in state_dict["state"].items() if k in renumber},
                "param_groups": [{**g, "params": [renumber[i] for i in g["params"]]}
                                 for g in groups[first_group:first_group + n_groups]],
            })
            first_group += n_groups
        self._link()
