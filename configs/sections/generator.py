"""[generator]: the rollout engine and its sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class GeneratorConfig:
    engine: str = option("auto", choices=("auto", "vllm", "hf"), doc="auto = vLLM when importable, else HF transformers.")
    hf_decode: str = option(
        "auto", choices=("auto", "static", "transformers"),
        doc="HF engine's forward: static = actors.static_decode (preallocated KV cache in plain torch ops; "
            "Llama, Qwen2, Qwen3 layouts; about 2x faster decode on CPU), transformers = the model's own forward, "
            "auto = static where the model allows it.",
    )
    group_size: int = option(4, ge=1, doc="Completions per prompt (the GRPO group).")
    max_new_tokens: int = option(32, ge=1, doc="Max tokens per assistant turn.")
    max_turns: int = option(2, ge=1, doc="Max assistant turns per episode (multi-turn tool loop).")
    temperature: float = option(1.0, ge=0.0, doc="Sampling temperature (0 = greedy).")
    top_p: float = option(1.0, gt=0.0, le=1.0, doc="Nucleus sampling mass.")
    top_k: int = option(0, ge=0, doc="Top-k sampling; 0 disables.")
    dtype: str = option(
        "float32", choices=("float32", "bfloat16"),
        doc="Serving dtype of the engine's weights (HF and vLLM); the trainer's float32 export is cast on load.",
    )
    gpu_memory_utilization: float = option(0.5, gt=0.0, le=1.0, doc="vLLM KV-cache share of GPU memory.")
    tensor_parallel_size: int = option(
        1, ge=1,
        doc="vLLM tensor parallelism: worker processes per generator, each holding a shard of every weight "
            "(the generator's process must see that many GPUs; on CPU its CPUs are split among them). vLLM only.",
    )

    def __post_init__(self) -> None:
        if self.tensor_parallel_size > 1 and self.engine == "hf":
            raise ValueError(f"generator.tensor_parallel_size = {self.tensor_parallel_size} needs generator.engine = "
                             "'vllm' (or 'auto' with vLLM installed): the HF engine runs in one process")
