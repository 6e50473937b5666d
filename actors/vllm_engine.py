"""The vLLM rollout engine: `HFEngine`'s interface on a live vLLM engine, weights reloaded in place.

- `generate` submits one request per prompt (token ids in, token ids out) and
  asks vLLM for the logprob of each sampled token with
  `logprobs_mode = "processed_logprobs"`: log-softmax *after* temperature,
  top-k and top-p, i.e. under the distribution the token was sampled from (the
  HF engine's convention, docs/application.md "Temperature handling"). Greedy
  (`temperature = 0`) is a point mass, so its logprobs are 0 as in the HF
  engine (vLLM would report the raw logprob there). Each row gets its own seed
  derived from `sampling.seed` and its index, so the copies of a prompt in a
  GRPO group differ while a batch stays reproducible. Stop tokens are exactly
  `stop_token_ids` (the model's EOS is not added), and the stop token is part
  of the completion, as in the HF engine.
- The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
  one worker): `model` is the live vLLM module, so `named_weights` returns live
  views and no tensor crosses a process boundary on a weight update. That
  worker takes torch.distributed's default group (world 1), so the engine
  refuses to start in a trainer rank (colocated placement).
- `load_weights` goes through vLLM's own in-place reload (the worker's
  `reload_weights`: the model's `load_weights` with vLLM's HF-name mapping and
  fusing, then the post-load kernel processing), so the engine object, its KV
  cache and its process stay.
- `named_weights` maps HF names onto views of vLLM's fused parameters
  (`qkv_proj` -> q/k/v, `gate_up_proj` -> gate/up, split by each layer's
  `output_partition_sizes`; MoE `w13_weight` / `w2_weight` -> each expert's
  gate/up and down), so `actors.weights.weights_digest` over them
  compares equal with the trainer's HF export when the bytes are equal.
- On CPU vLLM repacks linear weights into oneDNN kernel format and frees the
  HF-layout tensors. The engine turns that off (each linear layer computes with
  `F.linear` on its HF-layout weight, the embedding's LM head too) and reloads
  once at start, so the tensors the digest covers are the ones the forward
  reads. CPU is the test platform; on GPU vLLM keeps the fused tensors itself.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from actors.hf_engine import Completion
from actors.rollout import SamplingParams

_SEED_STRIDE = 1_000_003  # row seeds: seed * stride + row, kept below 2**31


@dataclass(frozen=True)
class VLLMEngineConfig:
    """Engine construction knobs (the sampling knobs come per call)."""

    dtype: str = "float32"  # the trainer exports fp32: equal dtypes keep digests comparable
    gpu_memory_utilization: float = 0.5  # GPU: weights + KV cache share of device memory
    cpu_kv_cache_mib: int = 256  # CPU: KV cache size (vLLM's CPU worker otherwise reserves a RAM share)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enforce_eager: bool = False  # GPU: no CUDA graphs / torch.compile; always on for CPU (start-up time)
    seed: int = 0


def _refuse_trainer_process() -> None:
    """The in-process worker makes torch.distributed's default group its own (world 1): in a trainer
    rank (colocated placement) the trainer would then join that group instead of its real world."""
    import torch.distributed as dist

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "the vLLM engine cannot share a process with a torch.distributed world (a trainer rank): "
            "use mesh.placement = 'disaggregated' with generator.engine = 'vllm', or engine = 'hf' when colocated"
        )


def _architecture(model_dir: Path) -> str:
    """The HF causal-LM class name for `model_dir` (config.json may omit `architectures`)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("architectures"):
        return cfg["architectures"][0]
    from transformers import AutoConfig

    from titan_ext.hf_config import causal_lm_architecture

    return causal_lm_architecture(AutoConfig.from_pretrained(str(model_dir)))


# vLLM's fused MoE tensors -> per-expert HF projections: w13 [E, 2I, H] = [gate; up], w2 [E, H, I] = down.
_EXPERT_VIEWS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}


def _expert_views(hf_prefix: str, leaf: str, weight_EOI: torch.Tensor) -> dict[str, torch.Tensor]:
    """`{hf_prefix}.{e}.{proj}.weight` views of one fused expert tensor."""
    projs = _EXPERT_VIEWS[leaf]
    out = {}
    for e in range(weight_EOI.shape[0]):
        for proj, view in zip(projs, weight_EOI[e].chunk(len(projs), dim=0)):
            out[f"{hf_prefix}.{e}.{proj}.weight"] = view
    return out


class VLLMEngine:
    """A vLLM `LLM` (one worker, in this process) used for rollouts."""

    Config = VLLMEngineConfig

    def __init__(self, model_dir: str | Path, stop_token_ids: Iterable[int],
                 config: VLLMEngineConfig | None = None) -> None:
        _refuse_trainer_process()
        # Live views and in-place reloads need the engine core in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM's CPU worker sets torch to 1 thread and replaces torch.set_num_threads: undone by close().
        self._torch_threads = (torch.get_num_threads(), torch.set_num_threads)
        from vllm import LLM
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.platforms import current_platform

        self.config = config or VLLMEngineConfig()
        self.stop_token_ids = sorted(set(stop_token_ids))
        if not self.stop_token_ids:
            raise ValueError("VLLMEngine needs at least one stop token id")
        model_dir = Path(model_dir)
        self.on_cpu = current_platform.is_cpu()
        c = self.config
        self.llm = LLM(
            model=str(model_dir), skip_tokenizer_init=True, runner="generate", dtype=c.dtype, seed=c.seed,
            enforce_eager=c.enforce_eager or self.on_cpu, max_model_len=c.max_model_len, tensor_parallel_size=1,
            gpu_memory_utilization=c.gpu_memory_utilization,
            kv_cache_memory_bytes=(c.cpu_kv_cache_mib << 20) if self.on_cpu else None,
            logprobs_mode="processed_logprobs", max_logprobs=1, enable_prefix_caching=True,
            hf_overrides={"architectures": [_architecture(model_dir)]},
        )
        self.model: torch.nn.Module = self.llm.apply_model(lambda m: m)[0]
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self._hf_experts: dict[str, torch.Tensor] = {}  # CPU MoE: param name -> the HF-layout copy the views show
        if self.on_cpu:
            self._keep_hf_layout_on_cpu(LinearBase)
            self._pack_cpu_experts()
        self._check_views()

    # --- sampling ---------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt (deterministic for a given seed and batch)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        greedy = sampling.temperature == 0.0
        params = [
            VSampling(
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                max_tokens=sampling.max_new_tokens, seed=(sampling.seed * _SEED_STRIDE + i) % (1 << 31),
                logprobs=0, stop_token_ids=self.stop_token_ids, ignore_eos=True, detokenize=False,
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        completions = []
        for out in outs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            logps = [0.0] * len(ids) if greedy else [float(step[t].logprob) for t, step in zip(ids, o.logprobs)]
            completions.append(Completion(ids, logps, "stop" if ids and ids[-1] in self.stop_token_ids else "length"))
        return completions

    # --- weights ----------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reload every weight in place through vLLM's loader; returns how many tensors were loaded.

        vLLM's reload is whole-model, so the tensors must cover every weight (tied
        embeddings once). Raises KeyError for an unknown name and ValueError for a
        shape mismatch or a missing weight, before anything is loaded.
        """
        views = self.named_weights()
        batch: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            if name not in views:
                raise KeyError(f"generator model has no parameter {name!r}")
            if tuple(views[name].shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's "
                                 f"{tuple(views[name].shape)}")
            batch[name] = tensor
        n = len(batch)
        if self.tied and "lm_head.weight" in batch:  # one storage: vLLM loads it as the embedding
            head = batch.pop("lm_head.weight")
            batch.setdefault("model.embed_tokens.weight", head)
        missing = sorted(set(views) - set(batch) - ({"lm_head.weight"} if self.tied else set()))
        if missing:
            raise ValueError(f"an in-place vLLM reload needs every weight; missing {missing[:5]}")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(batch.items())})
        if self.on_cpu:
            self._unpack_cpu_heads()
            self._pack_cpu_experts()
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return n

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF names -> live views of vLLM's parameters (fused ones split; tied head under both names)."""
        out: dict[str, torch.Tensor] = {}
        modules = dict(self.model.named_modules())
        packed: dict[str, list[str]] = getattr(self.model, "packed_modules_mapping", {})
        for name, param in self.model.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            module_prefix, _, module_name = prefix.rpartition(".")
            parts = packed.get(module_name)
            if leaf in _EXPERT_VIEWS and ".experts" in prefix:
                data = self._hf_experts.get(name, param.data)  # CPU: the kernel's parameter is prepacked
                out.update(_expert_views(prefix[: prefix.index(".experts") + len(".experts")], leaf, data))
            elif parts and len(parts) > 1:
                sizes = list(modules[prefix].output_partition_sizes)
                if len(sizes) != len(parts) or sum(sizes) != param.shape[0]:
                    raise RuntimeError(f"{name}: cannot split {tuple(param.shape)} into {parts} by {sizes}")
                for part, view in zip(parts, param.data.split(sizes, dim=0)):
                    out[f"{module_prefix}.{part}.{leaf}"] = view
            else:
                out[name] = param.data
        if self.tied and "model.embed_tokens.weight" in out:
            out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
        return out

    def close(self) -> None:
        """Stop the engine and give the process back as it was: torch.distributed's default group
        (the worker's world of 1) destroyed, torch's thread count and `set_num_threads` restored."""
        if getattr(self, "llm", None) is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        self.llm = self.model = None
        cleanup_dist_env_and_memory()
        threads, set_num_threads = self._torch_threads
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)

    # --- internals --------------------------------------------------------------------------

    def _keep_hf_layout_on_cpu(self, linear_cls: type) -> None:
        """Re-process every linear layer without oneDNN repacking: reload from `model_dir` into
        full-size tensors (vLLM recorded their checkpoint shapes when it first loaded)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        for module in self.model.modules():
            if isinstance(module, linear_cls):
                module._cpu_skip_gemm_dispatch = True  # vLLM's own opt-out: F.linear on the weight
                if module.weight.numel() == 0:  # freed by repacking; the reload copies into this
                    shape = get_layerwise_info(module).restore_metadata[0]["weight"].shape
                    module.weight.data = torch.empty(shape, dtype=module.weight.dtype)
        self.llm.collective_rpc("reload_weights")
        self._unpack_cpu_heads()

    def _unpack_cpu_heads(self) -> None:
        """CPU: compute the embedding-backed LM head with `F.linear` on the live weight, not a packed copy."""
        for module in self.model.modules():
            if hasattr(module, "cpu_linear") and getattr(module, "weight", None) is not None \
                    and module.weight.dim() == 2 and module.weight.numel():
                module.cpu_linear = torch.nn.functional.linear

    def _pack_cpu_experts(self) -> None:
        """CPU fused MoE: vLLM's CPU expert kernel (`cpu_fused_moe`) reads `w13_weight` / `w2_weight` in a
        prepacked layout, but a reload (ours, in place) leaves them in the checkpoint's layout — the kernel then
        computes garbage experts (measured 0.097 nats per token against HF before this). After every load: keep
        the HF-layout bytes as the copy the views and digests read, and repack the parameter for the kernel."""
        from vllm._custom_ops import cpu_prepack_moe_weight

        for name, module in self.model.named_modules():
            isa = getattr(getattr(getattr(module, "quant_method", None), "experts_cls", None), "isa", None)
            if isa is None or not hasattr(module, "w13_weight"):
                continue
            for leaf in _EXPERT_VIEWS:
                param = getattr(module, leaf)
                key = f"{name}.{leaf}"
                hf = self._hf_experts.setdefault(key, torch.empty_like(param.data))
                hf.copy_(param.data)  # the layout the loader just wrote
                param.data.copy_(cpu_prepack_moe_weight(hf, isa))

    def _check_views(self) -> None:
        """Refuse to run on a layout whose HF views are not the tensors the forward reads."""
        empty = [n for n, t in self.named_weights().items() if t.numel() == 0]
        if empty:
            raise RuntimeError(f"vLLM freed these weights after loading (kernel repacking): {empty[:5]}")

