"""The HF transformers rollout engine: batched sampling with a KV cache, in-place weight loads.

Prompts of different lengths are left-padded into one batch; positions count
real tokens only, so each row computes what it would alone. Each step applies
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

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

import torch

from composer_mesh.actors.rollout import SamplingParams
from composer_mesh.actors.weight_sync.digest import check_coverage, first_names, weights_digest


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


class HFEngine:
    """A transformers causal LM used for rollouts (CPU or one GPU)."""

    # from_pretrained builds on the meta device through process-global patches: one load at a time
    # (in-process actors share the process).
    _load_lock = threading.Lock()

    def __init__(self, model_dir: str | Path, stop_token_ids: Iterable[int], device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
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

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt (a batch; deterministic for a given seed and batch)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        # lazy: start-up time (see __init__)
        from transformers import DynamicCache

        N, width = len(prompts), max(len(p) for p in prompts)
        ids_NL = torch.full((N, width), self.pad_id, dtype=torch.long)
        mask_NL = torch.zeros((N, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids_NL[i, width - len(p):] = torch.tensor(p)
            mask_NL[i, width - len(p):] = 1
        ids_NL, mask_NL = ids_NL.to(self.device), mask_NL.to(self.device)
        positions_NL = (mask_NL.cumsum(-1) - 1).clamp(min=0)
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        stops = torch.tensor(self.stop_token_ids, device=self.device)
        cache = DynamicCache()
        tokens: list[list[int]] = [[] for _ in range(N)]
        logps: list[list[float]] = [[] for _ in range(N)]
        finished = torch.zeros(N, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(N, dtype=torch.bool, device=self.device)
        step_ids, step_pos = ids_NL, positions_NL
        for _ in range(sampling.max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=mask_NL, position_ids=step_pos,
                             past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logp_NV = sampling_logprobs(out.logits[:, -1], sampling)
            if sampling.temperature == 0.0:
                next_N = logp_NV.argmax(-1)
            else:
                next_N = torch.multinomial(logp_NV.exp(), 1, generator=gen).squeeze(-1)
            picked_N = logp_NV.gather(-1, next_N.unsqueeze(-1)).squeeze(-1)
            for i in (~finished).nonzero().flatten().tolist():
                tokens[i].append(int(next_N[i]))
                logps[i].append(float(picked_N[i]))
            hit_N = torch.isin(next_N, stops) & ~finished
            stopped |= hit_N
            finished |= hit_N
            if bool(finished.all()):
                break
            step_ids = next_N.unsqueeze(-1)
            step_pos = step_pos[:, -1:] + 1
            mask_NL = torch.cat([mask_NL, torch.ones((N, 1), dtype=mask_NL.dtype, device=self.device)], dim=1)
        return [
            Completion(tokens[i], logps[i], "stop" if bool(stopped[i]) else "length") for i in range(N)
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
