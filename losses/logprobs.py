"""Token logprobs, entropy and distillation divergences from hidden states, memory-lean.

At Qwen3's vocabulary (151,936) one fp32 logits row is 0.6 MB, so a `[B, T, V]`
logits tensor for a long agentic context does not fit next to the model. Here
the LM head is applied chunk by chunk over tokens: only `[chunk, V]` logits
exist at a time, sized from a memory budget (`chunk_tokens_for`).

Two gradient-exact autograd paths, both checked against `token_stats_naive`:

- `chunked_token_stats`: returns per-token logprobs / entropy / divergence with
  a custom `autograd.Function` that recomputes each chunk's logits in backward,
  so any downstream function of the per-token values gets exact gradients
  (used for sequence-level losses such as DPO).
- `fused_token_loss`: for a loss that is a *sum of per-token terms* (DAPO,
  PRIME-DPPO and the distillation divergences, each divided by a global count),
  the gradient with respect to hidden states and the head weight is computed in
  the forward pass chunk by chunk (as Liger's fused linear cross-entropy does),
  so logits are built once per chunk and backward is a scale by the incoming
  scalar gradient.

Labels outside `[0, V)` (padding, -100) give logprob 0; mask them downstream.
Matmuls run in the input dtype; softmax math runs in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from losses.distill import DistillSpec, token_divergence
from losses.reduce import math_dtype, upcast

DEFAULT_CHUNK_BUDGET_MIB = 32.0


@dataclass
class TokenStats:
    """Per-token values for N flattened tokens (None where not asked for)."""

    logprobs: torch.Tensor | None  # [N] log p(label)
    entropy: torch.Tensor | None  # [N] H(p_student)
    divergence: torch.Tensor | None  # [N] distillation divergence vs the teacher


@dataclass(frozen=True)
class Teacher:
    """Teacher hidden states aligned to the student's tokens and its LM-head weight."""

    hidden_ND: torch.Tensor
    weight_VD: torch.Tensor
    spec: DistillSpec


# A per-chunk loss: (stats of the chunk's tokens, slice of those tokens) -> scalar sum.
ChunkLossFn = Callable[[TokenStats, slice], torch.Tensor]


def chunk_tokens_for(vocab_size: int, budget_mib: float = DEFAULT_CHUNK_BUDGET_MIB) -> int:
    """Tokens per chunk so that one fp32 `[chunk, V]` logits block fits `budget_mib`."""
    return max(1, int(budget_mib * 2**20) // (4 * vocab_size))


def _stats_from_logits(
    logits_NV: torch.Tensor,
    labels_N: torch.Tensor | None,
    teacher_logits_NV: torch.Tensor | None,
    spec: DistillSpec | None,
    want_entropy: bool,
) -> TokenStats:
    """Per-token stats of one block of logits (the shared math of all paths)."""
    z_NV = upcast(logits_NV)
    logprobs = entropy = divergence = None
    if labels_N is not None or want_entropy:
        logp_NV = z_NV.log_softmax(-1)  # one fused pass (and one fused backward)
        if labels_N is not None:
            valid_N = (labels_N >= 0) & (labels_N < z_NV.shape[-1])
            picked_N = logp_NV.gather(-1, torch.where(valid_N, labels_N, 0).unsqueeze(-1)).squeeze(-1)
            logprobs = torch.where(valid_N, picked_N, 0.0)
        if want_entropy:
            entropy = -(logp_NV.exp() * logp_NV).sum(-1)
    if teacher_logits_NV is not None:
        divergence = token_divergence(z_NV, teacher_logits_NV, spec)
    return TokenStats(logprobs, entropy, divergence)


def _check(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N, teacher: Teacher | None) -> None:
    if hidden_ND.dim() != 2 or weight_VD.dim() != 2 or hidden_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"expected hidden [N, D] and weight [V, D], got {tuple(hidden_ND.shape)} and {tuple(weight_VD.shape)}"
        )
    if labels_N is not None and labels_N.shape != hidden_ND.shape[:1]:
        raise ValueError(f"labels must be [N]={hidden_ND.shape[0]}, got {tuple(labels_N.shape)}")
    if teacher is not None:
        if teacher.hidden_ND.shape[0] != hidden_ND.shape[0]:
            raise ValueError(
                f"teacher hidden states must be aligned to the student's {hidden_ND.shape[0]} tokens, "
                f"got {teacher.hidden_ND.shape[0]}"
            )
        if teacher.weight_VD.shape[0] != weight_VD.shape[0]:
            raise ValueError("teacher and student vocabularies differ")


def token_stats_naive(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor | None,
    *,
    teacher: Teacher | None = None,
    want_entropy: bool = True,
) -> TokenStats:
    """Reference path: full `[N, V]` logits, plain autograd."""
    _check(hidden_ND, weight_VD, labels_N, teacher)
    teacher_logits = None
    if teacher is not None:
        with torch.no_grad():
            teacher_logits = teacher.hidden_ND @ teacher.weight_VD.T
    return _stats_from_logits(
        hidden_ND @ weight_VD.T, labels_N, teacher_logits, teacher.spec if teacher else None, want_entropy
    )


def _teacher_chunk(teacher: Teacher | None, sl: slice) -> torch.Tensor | None:
    """The teacher's logits for tokens `sl` (a constant: never part of a graph)."""
    if teacher is None:
        return None
    with torch.no_grad():
        return teacher.hidden_ND[sl] @ teacher.weight_VD.T


def _slices(n: int, chunk: int) -> list[slice]:
    return [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]


def _outputs(stats: TokenStats, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """autograd.Function outputs must be tensors: absent stats become fresh empty ones."""
    return tuple(like.new_empty(0) if v is None else v for v in vars(stats).values())


def _zeros_like_stats(n: int, like: torch.Tensor, labels, teacher, want_entropy: bool) -> TokenStats:
    dtype = math_dtype(like)
    new = lambda on: like.new_zeros(n, dtype=dtype) if on else None  # noqa: E731
    return TokenStats(new(labels is not None), new(want_entropy), new(teacher is not None))


def _store(out: TokenStats, stats: TokenStats, sl: slice) -> None:
    for name, buf in vars(out).items():
        if buf is not None:
            buf[sl] = getattr(stats, name).detach()


def _logits_leaf(hidden_nD: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    """One chunk's logits as an autograd leaf: the graph starts at the logits, and the
    two matmul gradients are formed by hand (`_backprop_chunk`) into preallocated buffers."""
    with torch.no_grad():
        return (hidden_nD @ weight_VD.T).requires_grad_()


def _backprop_chunk(
    value: torch.Tensor,
    logits_nV: torch.Tensor,
    hidden_nD: torch.Tensor,
    weight_VD: torch.Tensor,
    grad_h_ND: torch.Tensor | None,
    grad_w_VD: torch.Tensor | None,
    sl: slice,
) -> None:
    """d value / d logits, then grad_h[sl] = g·W and grad_W += gᵀ·h (in place)."""
    if not value.requires_grad:
        return
    (g_nV,) = torch.autograd.grad(value, logits_nV)
    with torch.no_grad():
        if grad_h_ND is not None:
            grad_h_ND[sl] = g_nV @ weight_VD
        if grad_w_VD is not None:
            if grad_w_VD.dtype == g_nV.dtype:
                grad_w_VD.addmm_(g_nV.T, hidden_nD)
            else:  # low-precision head: accumulate the chunk products in fp32
                grad_w_VD += (g_nV.T @ hidden_nD).to(grad_w_VD.dtype)


def _grad_buffers(hidden_ND, weight_VD, need_h: bool, need_w: bool):
    grad_h = torch.zeros_like(hidden_ND) if need_h else None
    grad_w = torch.zeros_like(weight_VD, dtype=math_dtype(weight_VD)) if need_w else None
    return grad_h, grad_w


class _ChunkedStats(torch.autograd.Function):
    """Per-token stats; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, labels_N, teacher, want_entropy, chunk):
        out = _zeros_like_stats(hidden_ND.shape[0], hidden_ND, labels_N, teacher, want_entropy)
        for sl in _slices(hidden_ND.shape[0], chunk):
            stats = _stats_from_logits(
                hidden_ND[sl] @ weight_VD.T,
                None if labels_N is None else labels_N[sl],
                _teacher_chunk(teacher, sl),
                teacher and teacher.spec,
                want_entropy,
            )
            _store(out, stats, sl)
        ctx.save_for_backward(hidden_ND, weight_VD)
        ctx.labels, ctx.teacher, ctx.want_entropy, ctx.chunk = labels_N, teacher, want_entropy, chunk
        return _outputs(out, hidden_ND)

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy, g_divergence):
        hidden_ND, weight_VD = ctx.saved_tensors
        grad_h, grad_w = _grad_buffers(hidden_ND, weight_VD, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        upstream = {
            name: g
            for name, g, present in (
                ("logprobs", g_logprobs, ctx.labels is not None),
                ("entropy", g_entropy, ctx.want_entropy),
                ("divergence", g_divergence, ctx.teacher is not None),
            )
            if present and g is not None
        }
        teacher = ctx.teacher if "divergence" in upstream else None
        labels = ctx.labels if "logprobs" in upstream else None
        if upstream:
            for sl in _slices(hidden_ND.shape[0], ctx.chunk):
                logits = _logits_leaf(hidden_ND[sl], weight_VD)
                with torch.enable_grad():
                    stats = _stats_from_logits(
                        logits,
                        None if labels is None else labels[sl],
                        _teacher_chunk(teacher, sl),
                        teacher and teacher.spec,
                        "entropy" in upstream,
                    )
                    value = sum((getattr(stats, name) * g[sl]).sum() for name, g in upstream.items())
                _backprop_chunk(value, logits, hidden_ND[sl], weight_VD, grad_h, grad_w, sl)
        return grad_h, None if grad_w is None else grad_w.to(weight_VD.dtype), None, None, None, None


def _prepare(hidden_ND, weight_VD, labels_N, teacher: Teacher | None, chunk_tokens: int | None):
    """Validate shapes; pick the chunk size; detach the teacher (it never gets gradient)."""
    _check(hidden_ND, weight_VD, labels_N, teacher)
    if teacher is not None:
        teacher = Teacher(teacher.hidden_ND.detach(), teacher.weight_VD.detach(), teacher.spec)
    return chunk_tokens or chunk_tokens_for(weight_VD.shape[0]), teacher


def _present(outputs, labels_N, teacher, want_entropy: bool) -> TokenStats:
    """Function outputs back to TokenStats, with None for what was not asked for."""
    logprobs, entropy, divergence = outputs
    return TokenStats(
        logprobs if labels_N is not None else None,
        entropy if want_entropy else None,
        divergence if teacher is not None else None,
    )


def chunked_token_stats(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor | None,
    *,
    teacher: Teacher | None = None,
    want_entropy: bool = True,
    chunk_tokens: int | None = None,
) -> TokenStats:
    """Per-token stats without `[N, V]` logits; exact gradients for any downstream use."""
    chunk, teacher = _prepare(hidden_ND, weight_VD, labels_N, teacher, chunk_tokens)
    outputs = _ChunkedStats.apply(hidden_ND, weight_VD, labels_N, teacher, want_entropy, chunk)
    return _present(outputs, labels_N, teacher, want_entropy)


class _FusedLoss(torch.autograd.Function):
    """Sum of per-token chunk losses; gradients are formed in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, labels_N, teacher, want_entropy, chunk, loss_fn):
        grad_h, grad_w = _grad_buffers(hidden_ND, weight_VD, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        out = _zeros_like_stats(hidden_ND.shape[0], hidden_ND, labels_N, teacher, want_entropy)
        total = hidden_ND.new_zeros((), dtype=math_dtype(hidden_ND))
        for sl in _slices(hidden_ND.shape[0], chunk):
            logits = _logits_leaf(hidden_ND[sl], weight_VD)
            with torch.enable_grad():
                stats = _stats_from_logits(
                    logits,
                    None if labels_N is None else labels_N[sl],
                    _teacher_chunk(teacher, sl),
                    teacher and teacher.spec,
                    want_entropy,
                )
                loss = loss_fn(stats, sl)
            if grad_h is not None or grad_w is not None:
                _backprop_chunk(loss, logits, hidden_ND[sl], weight_VD, grad_h, grad_w, sl)
            total += loss.detach()
            _store(out, stats, sl)
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight_VD.dtype))
        outputs = _outputs(out, hidden_ND)
        ctx.mark_non_differentiable(*outputs)
        return (total, *outputs)

    @staticmethod
    def backward(ctx, g_total, *_unused):
        grad_h, grad_w = ctx.saved_tensors
        # in place: a second [V, D] buffer per channel would cost 0.6 GB at V = 151,936, D = 1024
        # (a retain_graph second backward then fails autograd's version check, loudly)
        scale = lambda g: None if g is None else g.mul_(g_total.to(g.dtype))  # noqa: E731
        return scale(grad_h), scale(grad_w), None, None, None, None, None


def fused_token_loss(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor | None,
    loss_fn: ChunkLossFn,
    *,
    teacher: Teacher | None = None,
    want_entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, TokenStats]:
    """Σ over chunks of `loss_fn(chunk stats, chunk slice)` with exact gradients.

    `loss_fn` must return a scalar that depends on the chunk's stats only through
    per-token terms (the chunk's share of a token-separable loss). Returns the
    scalar loss (differentiable w.r.t. hidden and weight) and the detached
    per-token stats for metrics.
    """
    chunk, teacher = _prepare(hidden_ND, weight_VD, labels_N, teacher, chunk_tokens)
    total, *outputs = _FusedLoss.apply(hidden_ND, weight_VD, labels_N, teacher, want_entropy, chunk, loss_fn)
    return total, _present(outputs, labels_N, teacher, want_entropy)
