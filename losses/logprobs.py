"""Token logprobs, entropy and distillation divergences from hidden states, memory-lean.

At Qwen3's vocabulary (151,936) one fp32 logits row is 0.6 MB, so a `[B, T, V]`
logits tensor for a long agentic context does not fit next to the model. Here
the LM head is applied chunk by chunk over tokens: only `[chunk, V]` logits
exist at a time, sized from a memory budget (`chunk_tokens_for`).

Gradient-exact paths, all checked against `token_stats_naive`:

- `fused_token_loss`: a loss that is a *sum of per-token terms* (DAPO,
  PRIME-DPPO, the distillation divergences, each divided by a global count).
  The gradient w.r.t. hidden states and the head weight is formed in forward,
  chunk by chunk, into a `FusedHead` (one `[V, D]` buffer that several losses
  can share), so logits are built once and backward is a scale.
- `fused_pair_logprobs`: a sequence-level loss Σ_s f_s(Σ_{t∈s} w_t·log p(y_t))
  (DPO, SimPO), in the same single pass, segment by segment.
- `chunked_token_stats`: per-token values with a custom `autograd.Function`
  that recomputes each chunk's logits in backward, for any downstream use.

Chunks that need only label logprobs (and entropy) skip autograd: the logits
gradient is written by hand, in place. Labels outside `[0, V)` (padding, -100)
give logprob 0; mask them downstream. Matmuls run in the input dtype; softmax
math runs in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from composer_mesh.losses.distill import DistillSpec, token_divergence
from composer_mesh.losses.reduce import math_dtype, upcast

DEFAULT_CHUNK_BUDGET_MIB = 32.0


@dataclass
class TokenStats:
    """Per-token values for N flattened tokens (None where not asked for)."""

    logprobs: torch.Tensor | None  # [N] log p(label)
    entropy: torch.Tensor | None  # [N] H(p_student)
    divergence: torch.Tensor | None  # [N] vs the teacher


@dataclass(frozen=True)
class Teacher:
    """Teacher hidden states aligned to the student's tokens and its LM-head weight."""

    hidden_ND: torch.Tensor
    weight_VD: torch.Tensor
    spec: DistillSpec


# A per-chunk loss: (stats of the chunk's tokens, slice of those tokens) -> scalar sum.
ChunkLossFn = Callable[[TokenStats, slice], torch.Tensor]


# The label path keeps 2 live `[chunk, V]` blocks against the divergence path's ~9, so it takes this many
# times the tokens per chunk at the same budget (docs/losses.md, "Chunk size").
LABEL_CHUNK_FACTOR = 4


def chunk_tokens_for(vocab_size: int, budget_mib: float = DEFAULT_CHUNK_BUDGET_MIB, *, label_only: bool = False) -> int:
    """Tokens per chunk so that one fp32 `[chunk, V]` logits block fits `budget_mib`
    (`LABEL_CHUNK_FACTOR` times that for the label path)."""
    return max(1, int(budget_mib * 2**20) // (4 * vocab_size)) * (LABEL_CHUNK_FACTOR if label_only else 1)


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
    two matmul gradients are formed by hand (`FusedHead.backprop`) into preallocated buffers."""
    with torch.no_grad():
        return (hidden_nD @ weight_VD.T).requires_grad_()


class _ChunkedStats(torch.autograd.Function):
    """Per-token stats; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, labels_N, teacher, want_entropy, chunk):
        out = _zeros_like_stats(hidden_ND.shape[0], hidden_ND, labels_N, teacher, want_entropy)
        for sl in _slices(hidden_ND.shape[0], chunk):
            labels_n = None if labels_N is None else labels_N[sl]
            if teacher is None:
                stats = _label_stats(hidden_ND[sl], weight_VD, labels_n, want_entropy)[0]
            else:
                logits_nV = hidden_ND[sl] @ weight_VD.T
                stats = _stats_from_logits(logits_nV, labels_n, _teacher_chunk(teacher, sl), teacher.spec, want_entropy)
            _store(out, stats, sl)
        ctx.save_for_backward(hidden_ND, weight_VD)
        ctx.labels, ctx.teacher, ctx.want_entropy, ctx.chunk = labels_N, teacher, want_entropy, chunk
        return _outputs(out, hidden_ND)

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy, g_divergence):
        hidden_ND, weight_VD = ctx.saved_tensors
        head = FusedHead(weight_VD, track_weight=ctx.needs_input_grad[1])
        grad_h = head.input_grad(hidden_ND, needed=ctx.needs_input_grad[0])
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
        weighted = lambda stats, sl: sum((getattr(stats, k) * g[sl]).sum() for k, g in upstream.items())  # noqa: E731
        if upstream:
            for sl in _slices(hidden_ND.shape[0], ctx.chunk):
                _token_chunk(
                    head, hidden_ND[sl], None if labels is None else labels[sl], teacher, "entropy" in upstream,
                    weighted, sl, 1.0, None if grad_h is None else grad_h[sl],
                )
        grad_w = head.grad_w_VD
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


def _label_stats(
    hidden_nD: torch.Tensor, weight_VD: torch.Tensor, labels_n: torch.Tensor | None, want_entropy: bool
) -> tuple[TokenStats, torch.Tensor, torch.Tensor]:
    """One chunk's label logprobs / entropy without autograd, keeping what the gradient needs.

    Returns (stats, p_nV, logp_nV): the softmax is written over the logits buffer
    (no third `[n, V]` block), entropy is a batched dot product.
    """
    z_nV = upcast(hidden_nD @ weight_VD.T)
    logp_nV = z_nV.log_softmax(-1)
    # z is a fresh fp32 block (upcast or matmul output)
    p_nV = torch.exp(logp_nV, out=z_nV)
    logprobs = entropy = None
    if labels_n is not None:
        valid_n = (labels_n >= 0) & (labels_n < logp_nV.shape[-1])
        picked_n = logp_nV.gather(-1, torch.where(valid_n, labels_n, 0).unsqueeze(-1)).squeeze(-1)
        logprobs = torch.where(valid_n, picked_n, 0.0)
    if want_entropy:
        entropy = -(p_nV.unsqueeze(1) @ logp_nV.unsqueeze(2)).view(-1)  # [n]
    return TokenStats(logprobs, entropy, None), p_nV, logp_nV


def _label_logits_grad(
    p_nV: torch.Tensor,
    logp_nV: torch.Tensor,
    labels_n: torch.Tensor | None,
    g_logprobs_n: torch.Tensor | None,
    g_entropy_n: torch.Tensor | None,
    entropy_n: torch.Tensor | None,
) -> torch.Tensor:
    """d(Σ g_lp·log p(label) + Σ g_H·H) / d logits, in place over p (and logp).

    d log p_y / dz = onehot(y) − p;  dH / dz = −p ⊙ (log p + H).  Labels outside `[0, V)`
    have the constant logprob 0: no gradient.
    """
    if g_logprobs_n is not None:
        valid_n = (labels_n >= 0) & (labels_n < p_nV.shape[-1])
        g_logprobs_n = torch.where(valid_n, g_logprobs_n, 0.0)
    if g_entropy_n is not None:
        g_nV = logp_nV.add_(entropy_n.unsqueeze(-1)).mul_(p_nV).mul_(-g_entropy_n.unsqueeze(-1))
        if g_logprobs_n is not None:
            g_nV.addcmul_(p_nV, g_logprobs_n.unsqueeze(-1), value=-1.0)
    else:
        g_nV = p_nV.mul_(-g_logprobs_n.unsqueeze(-1))
    if g_logprobs_n is not None:
        g_nV.scatter_add_(-1, torch.where(valid_n, labels_n, 0).unsqueeze(-1), g_logprobs_n.unsqueeze(-1))
    return g_nV


class FusedHead:
    """Gradients of one scalar loss w.r.t. the LM-head weight and the hidden states it is
    applied to, accumulated in forward chunk by chunk (as Liger's fused linear
    cross-entropy does), so logits are built once per chunk and backward is a scale.

    All channels of a step share one head-gradient buffer `[V, D]` (one more,
    `scratch`, only for sequence-level losses over several pairs). `attach` turns
    the loss value into a differentiable scalar whose backward scales the buffers,
    in place, by the incoming gradient.
    """

    def __init__(self, weight_VD: torch.Tensor, track_weight: bool | None = None) -> None:
        self.weight_VD = weight_VD
        if track_weight is None:
            track_weight = weight_VD.requires_grad and torch.is_grad_enabled()
        self.tracks_weight = track_weight
        self.grad_w_VD: torch.Tensor | None = None
        self._scratch_VD: torch.Tensor | None = None
        self._inputs: list[torch.Tensor] = []
        self._input_grads: list[torch.Tensor] = []

    def input_grad(self, hidden_ND: torch.Tensor, needed: bool | None = None) -> torch.Tensor | None:
        """A zeroed gradient buffer for `hidden_ND` (None when it needs no gradient)."""
        if not (hidden_ND.requires_grad and torch.is_grad_enabled() if needed is None else needed):
            return None
        self._inputs.append(hidden_ND)
        self._input_grads.append(torch.zeros_like(hidden_ND))
        return self._input_grads[-1]

    def weight_grad(self) -> torch.Tensor | None:
        """The shared `[V, D]` accumulator (math dtype), allocated on first use."""
        if self.tracks_weight and self.grad_w_VD is None:
            self.grad_w_VD = torch.zeros_like(self.weight_VD, dtype=math_dtype(self.weight_VD))
        return self.grad_w_VD

    def segment_grad(self) -> torch.Tensor | None:
        """A zeroed accumulator for one sequence-level term whose scale is known only at its end:
        the shared buffer itself while nothing else is in it, else `scratch`."""
        if not self.tracks_weight:
            return None
        if self.grad_w_VD is None:
            return self.weight_grad()
        if self._scratch_VD is None:
            self._scratch_VD = torch.zeros_like(self.grad_w_VD)
        return self._scratch_VD.zero_()

    def fold_segment(self, segment_VD: torch.Tensor | None, scale: torch.Tensor) -> None:
        """grad_W += scale · segment (in place when the segment is the shared buffer)."""
        if segment_VD is None:
            return
        if segment_VD is self.grad_w_VD:
            segment_VD.mul_(scale)
        else:
            self.grad_w_VD.add_(segment_VD * scale)

    def backprop(
        self,
        g_nV: torch.Tensor,
        hidden_nD: torch.Tensor,
        grad_h_nD: torch.Tensor | None,
        grad_w_VD: torch.Tensor | None,
    ) -> None:
        """grad_h = g·W (written) and grad_W += gᵀ·h for one chunk of logits gradient g."""
        g_nV = g_nV.to(self.weight_VD.dtype)
        if grad_h_nD is not None:
            torch.mm(g_nV, self.weight_VD, out=grad_h_nD)
        if grad_w_VD is not None:
            if grad_w_VD.dtype == g_nV.dtype:
                grad_w_VD.addmm_(g_nV.T, hidden_nD)
            # low-precision head: accumulate the chunk products in fp32
            else:
                grad_w_VD += (g_nV.T @ hidden_nD).to(grad_w_VD.dtype)

    def attach(self, value: torch.Tensor) -> torch.Tensor:
        """`value` (detached) as a scalar whose gradient is what this head accumulated."""
        if not (self.tracks_weight or self._inputs):
            return value
        # zeros when no token reached the head: the graph still includes it
        self.weight_grad()
        return _Attach.apply(value, self, self.weight_VD, *self._inputs)


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, head: FusedHead, weight_VD, *hiddens):
        ctx.head = head
        return value.detach().clone()

    @staticmethod
    def backward(ctx, g_total):
        head = ctx.head
        # in place, so no second [V, D] buffer; a retain_graph second backward is therefore not supported
        scale = lambda g: None if g is None else g.mul_(g_total.to(g.dtype))  # noqa: E731
        grad_w = scale(head.grad_w_VD)
        grad_w = None if grad_w is None else grad_w.to(head.weight_VD.dtype)
        return None, None, grad_w, *(scale(g) for g in head._input_grads)


def _token_chunk(
    head: FusedHead,
    hidden_nD: torch.Tensor,
    labels_n: torch.Tensor | None,
    teacher: Teacher | None,
    want_entropy: bool,
    loss_fn: ChunkLossFn,
    sl: slice,
    scale: float,
    grad_h_nD: torch.Tensor | None,
) -> tuple[torch.Tensor, TokenStats]:
    """One chunk of a token-separable loss: value, stats, and its gradients into `head`."""
    grads_needed = grad_h_nD is not None or head.tracks_weight
    # divergences: autograd from a logits leaf (the per-kind math is in distill.py)
    if teacher is not None:
        logits = _logits_leaf(hidden_nD, head.weight_VD)
        with torch.enable_grad():
            stats = _stats_from_logits(logits, labels_n, _teacher_chunk(teacher, sl), teacher.spec, want_entropy)
            loss = loss_fn(stats, sl)
            g_nV = torch.autograd.grad(loss * scale, logits)[0] if grads_needed and loss.requires_grad else None
        if g_nV is not None:
            head.backprop(g_nV, hidden_nD, grad_h_nD, head.weight_grad())
        return loss.detach(), stats
    stats, p_nV, logp_nV = _label_stats(hidden_nD, head.weight_VD, labels_n, want_entropy)
    leaves = TokenStats(*(None if v is None else v.requires_grad_() for v in vars(stats).values()))
    with torch.enable_grad():
        loss = loss_fn(leaves, sl)
        wrt = [v for v in (leaves.logprobs, leaves.entropy) if v is not None]
        grads = None
        if grads_needed and loss.requires_grad:
            grads = iter(torch.autograd.grad(loss * scale, wrt, allow_unused=True))
    if grads is not None:
        g_lp = next(grads) if leaves.logprobs is not None else None
        g_h = next(grads) if leaves.entropy is not None else None
        if g_lp is not None or g_h is not None:
            g_nV = _label_logits_grad(p_nV, logp_nV, labels_n, g_lp, g_h, stats.entropy)
            head.backprop(g_nV, hidden_nD, grad_h_nD, head.weight_grad())
    return loss.detach(), stats


def fused_token_loss(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor | None,
    loss_fn: ChunkLossFn,
    *,
    teacher: Teacher | None = None,
    want_entropy: bool = False,
    chunk_tokens: int | None = None,
    head: FusedHead | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, TokenStats]:
    """Σ over chunks of `loss_fn(chunk stats, chunk slice)` with exact gradients.

    `loss_fn` must return a scalar that depends on the chunk's stats only through
    per-token terms (the chunk's share of a token-separable loss). Returns the
    scalar loss and the detached per-token stats for metrics. Without `head` the
    loss is differentiable w.r.t. hidden and weight; with a shared `head` the
    gradient of `scale`·loss goes into it and the returned loss is a detached value
    (the caller attaches the total once).
    """
    chunk, teacher = _prepare(hidden_ND, weight_VD, labels_N, teacher, chunk_tokens)
    own = head is None
    head = FusedHead(weight_VD) if own else head
    grad_h = head.input_grad(hidden_ND)
    out = _zeros_like_stats(hidden_ND.shape[0], hidden_ND, labels_N, teacher, want_entropy)
    total = hidden_ND.new_zeros((), dtype=math_dtype(hidden_ND))
    with torch.no_grad():
        for sl in _slices(hidden_ND.shape[0], chunk):
            loss, stats = _token_chunk(
                head, hidden_ND[sl], None if labels_N is None else labels_N[sl], teacher, want_entropy,
                loss_fn, sl, scale, None if grad_h is None else grad_h[sl],
            )
            total += loss
            _store(out, stats, sl)
    return (head.attach(total) if own else total), out


def fused_pair_logprobs(
    head: FusedHead,
    hidden_ND: torch.Tensor,
    labels_N: torch.Tensor | None,
    token_weight_N: torch.Tensor,
    segments: list[slice],
    segment_scale: Callable[[int, torch.Tensor], torch.Tensor],
    chunk_tokens: int,
) -> torch.Tensor:
    """Per-token label logprobs for a loss Σ_s f_s(u_s), u_s = Σ_{t∈s} w_t·log p(y_t), in one pass.

    `segments` are contiguous token ranges (one preference pair each); after a
    segment's tokens `segment_scale(s, logprobs of s)` returns f_s'(u_s). Its
    gradient then scales that segment's accumulated gradient (`head.segment_grad`),
    so sequence-level losses need no recomputation in backward. Returns the
    detached logprobs `[N]`.
    """
    _check(hidden_ND, head.weight_VD, labels_N, None)
    grad_h = head.input_grad(hidden_ND)
    logprobs_N = hidden_ND.new_zeros(hidden_ND.shape[0], dtype=math_dtype(hidden_ND))
    with torch.no_grad():
        for s, seg in enumerate(segments):
            acc_VD = head.segment_grad()
            for i in range(seg.start, seg.stop, chunk_tokens):
                sl = slice(i, min(i + chunk_tokens, seg.stop))
                logprobs_N[sl] = _weighted_label_chunk(
                    head, hidden_ND[sl], None if labels_N is None else labels_N[sl], token_weight_N[sl],
                    None if grad_h is None else grad_h[sl], acc_VD,
                )
            k = segment_scale(s, logprobs_N[seg])
            if grad_h is not None:
                grad_h[seg] *= k.to(grad_h.dtype)
            head.fold_segment(acc_VD, k)
    return logprobs_N


def _weighted_label_chunk(
    head: FusedHead,
    hidden_nD: torch.Tensor,
    labels_n: torch.Tensor | None,
    weight_n: torch.Tensor,
    grad_h_nD: torch.Tensor | None,
    acc_VD: torch.Tensor | None,
) -> torch.Tensor:
    """Label logprobs of one chunk; gradients of Σ w_t·log p(y_t) into grad_h and acc.  # [n]
    (A function, so that the chunk's `[n, V]` blocks are freed before the next chunk's.)"""
    stats, p_nV, logp_nV = _label_stats(hidden_nD, head.weight_VD, labels_n, False)
    if grad_h_nD is not None or acc_VD is not None:
        g_nV = _label_logits_grad(p_nV, logp_nV, labels_n, upcast(weight_n), None, None)
        head.backprop(g_nV, hidden_nD, grad_h_nD, acc_VD)
    return stats.logprobs
