"""The HF transformers rollout engine: batched sampling with a KV cache, in-place weight loads.

Prompts of different lengths are left-padded into one batch; positions count
real tokens only, so each row computes what it would alone. The forward passes are
`actors.static_decode` (a preallocated KV cache in plain torch ops: Llama, Qwen2
and Qwen3 layouts) or transformers' own forward with its `DynamicCache` (every
other model, or `decode = "transformers"`). Each step applies
`sampling_logprobs` (temperature → top-k → top-p) to the last logits, samples
from that distribution with a seeded generator, and records the logprob of the
sampled token *under that same distribution* (what the policy loss's
importance correction compares the trainer's logprobs against). A row stops at
an end-of-turn token or after `max_new_tokens`.

`load_weights` copies HF-named tensors into the live parameters (no new model,
no restart), which is how generators receive new policy versions. Names are
those of the checkpoint on disk (what the trainer's export writes): a MoE
layer that transformers holds as fused 3-D expert tensors
(`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]:
the inverse of transformers' own qwen2_moe conversion) is addressed by each
expert's `gate_proj` / `up_proj` / `down_proj` weight, as views.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

import torch

from composer_mesh.actors.rollout import SamplingParams
from composer_mesh.actors.static_decode import StaticKVDecoder, support_reason
from composer_mesh.actors.weight_sync.digest import check_coverage, first_names, weights_digest

logger = logging.getLogger(__name__)


@dataclass
class Completion:
    """Sampled ids (`[N]`, the stop token included when one was sampled) and their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


def sampling_logprobs(logits_NV: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probabilities `[N, V]` of the distribution tokens are sampled from (-inf = excluded).

    temperature 0 (greedy) gives the point mass on the argmax: 0 there, -inf elsewhere.
    """
    z_NV = logits_NV.float()
    if sampling.temperature == 0.0:
        out = torch.full_like(z_NV, float("-inf"))
        return out.scatter(-1, z_NV.argmax(-1, keepdim=True), 0.0)
    if sampling.temperature != 1.0:
        z_NV = z_NV / sampling.temperature
    if 0 < sampling.top_k < z_NV.shape[-1]:
        kth_N1 = z_NV.topk(sampling.top_k, dim=-1).values[:, -1:]
        z_NV = z_NV.masked_fill(z_NV < kth_N1, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_NV, order_NV = z_NV.sort(-1, descending=True)
        probs_NV = sorted_NV.softmax(-1)
        # mass of the strictly more likely tokens
        mass_before_NV = probs_NV.cumsum(-1) - probs_NV
        drop_NV = mass_before_NV >= sampling.top_p
        drop_NV[:, 0] = False
        z_NV = z_NV.masked_fill(torch.zeros_like(drop_NV).scatter(-1, order_NV, drop_NV), float("-inf"))
    return z_NV.log_softmax(-1)


def sample_rows(logp_NV: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row `[N]`, drawn from `exp(logp_NV)` by inverse CDF: one uniform per row.

    `torch.multinomial` draws an exponential per vocabulary entry (about 1 ms a step for 16 rows of
    2,048 on one CPU thread, a sixth of a small model's decode step); this draws N numbers. A token
    of probability 0 is never drawn: the first index whose running mass exceeds u has mass > 0.
    """
    cdf_NV = logp_NV.exp().cumsum(-1)
    u_N1 = torch.rand((len(cdf_NV), 1), generator=generator, device=cdf_NV.device, dtype=cdf_NV.dtype)
    idx_N1 = torch.searchsorted(cdf_NV, u_N1 * cdf_NV[:, -1:], right=True)
    return idx_N1.squeeze(-1).clamp_(max=cdf_NV.shape[-1] - 1)


class HFEngine:
    """A transformers causal LM used for rollouts (CPU or one GPU)."""

    # from_pretrained builds on the meta device through process-global patches: one load at a time
    # (in-process actors share the process).
    _load_lock = threading.Lock()

    def __init__(self, model_dir: str | Path, stop_token_ids: Iterable[int], device: str = "cpu",
                 dtype: torch.dtype = torch.float32, decode: Literal["auto", "static", "transformers"] = "auto",
                 ) -> None:
        # lazy: start-up time; actors.episodes imports this module for `Completion` in processes with no model
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        with HFEngine._load_lock:
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(self.device).eval()
        self.stop_token_ids = sorted(set(stop_token_ids))
        if not self.stop_token_ids:
            raise ValueError("HFEngine needs at least one stop token id")
        self.pad_id = self.stop_token_ids[0]
        self.params = sum(p.numel() for p in self.model.parameters())
        self.dtype = str(dtype).removeprefix("torch.")
        reason = support_reason(self.model) if decode != "transformers" else "decode = 'transformers'"
        if reason and decode == "static":
            raise ValueError(f"generator.hf_decode = 'static' cannot run {model_dir}: {reason}")
        if reason and decode == "auto":
            logger.info("HF engine: transformers' forward, not the static-cache decode: %s", reason)
        self.static = not reason

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt (a batch; deterministic for a given seed and batch)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        N, width = len(prompts), max(len(p) for p in prompts)
        ids_NL = torch.full((N, width), self.pad_id, dtype=torch.long)
        valid_NL = torch.zeros((N, width), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids_NL[i, width - len(p):] = torch.tensor(p)
            valid_NL[i, width - len(p):] = True
        ids_NL, valid_NL = ids_NL.to(self.device), valid_NL.to(self.device)
        positions_NL = (valid_NL.long().cumsum(-1) - 1).clamp(min=0)
        if self.static:
            forward = StaticKVDecoder(self.model, valid_NL, sampling.max_new_tokens)
        else:
            forward = _TransformersDecoder(self.model, valid_NL)
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        stops = torch.tensor(self.stop_token_ids, device=self.device)
        picked: list[torch.Tensor] = []  # per step: sampled ids [N] and their logprobs [N]
        picked_logps: list[torch.Tensor] = []
        length_N = torch.full((N,), sampling.max_new_tokens, dtype=torch.long, device=self.device)
        finished_N = torch.zeros(N, dtype=torch.bool, device=self.device)
        step_ids, step_pos = ids_NL, positions_NL
        for t in range(sampling.max_new_tokens):
            logp_NV = sampling_logprobs(forward(step_ids, step_pos), sampling)
            next_N = logp_NV.argmax(-1) if sampling.temperature == 0.0 else sample_rows(logp_NV, gen)
            picked.append(next_N)
            picked_logps.append(logp_NV.gather(-1, next_N.unsqueeze(-1)).squeeze(-1))
            hit_N = torch.isin(next_N, stops) & ~finished_N
            length_N[hit_N] = t + 1
            finished_N |= hit_N
            if bool(finished_N.all()):
                break
            step_ids = next_N.unsqueeze(-1)
            step_pos = step_pos[:, -1:] + 1
        ids_NT = torch.stack(picked, 1).tolist()
        logps_NT = torch.stack(picked_logps, 1).tolist()
        stopped, lengths = finished_N.tolist(), length_N.tolist()
        return [
            Completion(ids_NT[i][: lengths[i]], logps_NT[i][: lengths[i]], "stop" if stopped[i] else "length")
            for i in range(N)
        ]

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the parameters in place; returns how many were loaded.

        Raises KeyError for a name the model does not have and ValueError for a shape
        mismatch (before copying that tensor).
        """
        fused = self.model.state_dict()
        # fused expert names are accepted too
        state = {**fused, **dict(per_expert_views(fused))}
        n = 0
        for name, tensor in named:
            if name not in state:
                raise KeyError(f"generator model has no parameter {name!r}")
            target = state[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
            target.copy_(tensor.to(target.device, target.dtype))
            n += 1
        return n

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Checkpoint names → live tensors (tied weights appear under each of their names; fused expert
        tensors as one view per expert and projection)."""
        return dict(per_expert_views(self.model.state_dict()))

    def check_coverage(self, names: Iterable[str], version: int) -> None:
        """Refuse `names` unless they are exactly this model's tensors (`actors.weight_sync.digest.check_coverage`)."""
        check_coverage(self.named_weights(), names, version)

    def digest(self, names: list[str] | None = None, dtype: torch.dtype | None = None) -> str:
        """`weights_digest` of the tensors under `names` (cast to `dtype` when given); None: one name per tensor."""
        state = self.named_weights()
        names = first_names(state) if names is None else names
        return weights_digest((n, state[n] if dtype is None else state[n].to(dtype)) for n in names)

    def tensor_names(self) -> list[str]:
        """One name per tensor (tied weights under their first name), as the trainer's export names them."""
        return first_names(self.named_weights())


class _TransformersDecoder:
    """transformers' own forward with a `DynamicCache`, called as `StaticKVDecoder` is: the prompt
    batch `[N, W]` first, then one token per row; returns the last position's logits `[N, V]`."""

    def __init__(self, model: torch.nn.Module, valid_NW: torch.Tensor) -> None:
        # lazy: start-up time (see HFEngine.__init__)
        from transformers import DynamicCache

        self.model, self.cache, self.mask_NL = model, DynamicCache(), valid_NW.long()

    def __call__(self, ids_NS: torch.Tensor, pos_NS: torch.Tensor) -> torch.Tensor:
        if self.cache.get_seq_length() > 0:  # a decode step: the new token is real
            self.mask_NL = torch.cat([self.mask_NL, self.mask_NL.new_ones((len(ids_NS), ids_NS.shape[1]))], dim=1)
        out = self.model(input_ids=ids_NS, attention_mask=self.mask_NL, position_ids=pos_NS,
                         past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1]


def per_expert_views(state: dict[str, torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    """`state` with transformers' fused MoE expert tensors split into the per-expert views checkpoints name."""
    for name, t in state.items():
        prefix, _, leaf = name.rpartition("mlp.experts.")
        if not prefix or t.dim() != 3 or leaf not in ("gate_up_proj", "down_proj"):
            yield name, t
            continue
        experts = f"{prefix}mlp.experts."
        for e in range(t.shape[0]):
            if leaf == "down_proj":  # [E, D, I]
                yield f"{experts}{e}.down_proj.weight", t[e]
            else:  # [E, 2I, D]: gate rows, then up rows
                half = t.shape[1] // 2
                yield f"{experts}{e}.gate_proj.weight", t[e, :half]
                yield f"{experts}{e}.up_proj.weight", t[e, half:]
