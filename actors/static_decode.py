"""A static-KV-cache decode of dense HF decoder LMs (Llama, Qwen2, Qwen3), written in plain torch ops.

Why: on CPU a small model's rollout is bound by per-token overhead, not FLOPs.
transformers' forward spends most of a decode step in module dispatch, mask
building and its growing cache (measured in docs/tasks.md); this decoder runs
the same arithmetic on the live HF parameters with one preallocated cache per
batch, about 20 torch calls per layer and token:

- q/k/v and gate/up are one matmul each: `fuse_projections` re-homes the
  projections once as transposed views of one `[in, sum out]` tensor per group
  (no extra memory; in-place weight loads keep working);
- Qwen3's per-head q/k norms and RoPE are applied to q and k together;
- keys are cached transposed (`[N*Hkv, D, T]`) so decode attention is two
  `bmm`s over the filled prefix, with grouped-query heads folded into rows.

`support_reason` says why a model cannot use it (MoE, sliding windows, other
families); the HF engine then keeps transformers' own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# families whose decoder layer is: RMSNorm -> attention (optional per-head q/k RMSNorm) -> residual ->
# RMSNorm -> gated MLP -> residual, with rotary embeddings from `model.model.rotary_emb`
FAMILIES = ("llama", "qwen2", "qwen3")


def support_reason(model: torch.nn.Module) -> str:
    """"" when `model` can use `StaticKVDecoder`, else why not (one line)."""
    config = model.config
    kind = getattr(config, "model_type", "")
    if kind not in FAMILIES:
        return f"model_type {kind!r} is not one of {FAMILIES}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        return "sliding-window attention layers"
    for i, layer in enumerate(model.model.layers):
        if not all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i} has no gated dense MLP (gate_proj, up_proj, down_proj)"
        for name, group in _groups(layer).items():
            if len({lin.bias is None for lin in group}) > 1:
                return f"layer {i}: the {name} projections differ in having a bias"
    return ""


# attribute of a group's first linear: its fused, transposed weight [in, sum out] and bias [sum out]
_FUSED = "_static_decode_fused"


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(weight [in, sum out], bias [sum out])` behind `linears`: their weights re-homed as column blocks of
    one tensor (each parameter its transposed view) and their biases as one vector, unless they already
    are. x @ W_t is several times faster than F.linear's x @ W.T on CPU at decode shapes (docs/tasks.md),
    and no memory is added."""
    fused = _fused(linears)
    if fused is not None:
        return fused
    weight_IO = torch.cat([lin.weight.detach() for lin in linears]).t().contiguous()
    bias_O = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(weight_IO[:, start : start + rows].t(), requires_grad=False)
        if bias_O is not None:
            lin.bias = torch.nn.Parameter(bias_O[start : start + rows], requires_grad=False)
        start += rows
    object.__setattr__(linears[0], _FUSED, (weight_IO, bias_O))
    return weight_IO, bias_O


def _fused(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The group's `(weight [in, sum out], bias)` when every parameter is still the view `_fuse` made."""
    fused = getattr(linears[0], _FUSED, None)
    if fused is None:
        return None
    weight_IO, bias_O = fused
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        if (lin.weight.data_ptr() != weight_IO[:, start:].data_ptr() or lin.weight.stride() != (1, weight_IO.shape[1])
                or (bias_O is not None and lin.bias.data_ptr() != bias_O[start:].data_ptr())):
            return None
        start += rows
    return fused


def _groups(layer: torch.nn.Module) -> dict[str, list[torch.nn.Linear]]:
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj],
            "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}


def fuse_projections(model: torch.nn.Module) -> list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
    """Store every layer's projections as `_fuse` does (q/k/v as one tensor, gate/up as one, o and down each
    transposed; idempotent) and return, per layer, each group's fused weight and bias."""
    return [{name: _fuse(group) for name, group in _groups(layer).items()} for layer in model.model.layers]


def _linear(x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None],
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """(residual +) x [R, in] @ weight [in, out] (+ bias), in as few kernels as the bias allows."""
    weight_IO, bias_O = fused
    if residual is None:
        return x @ weight_IO if bias_O is None else torch.addmm(bias_O, x, weight_IO)
    out = torch.addmm(residual, x, weight_IO)
    return out if bias_O is None else out.add_(bias_O)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it, x*cos + rotate_half(x)*sin, with rotate_half(x) = [-x2, x1]
    written as roll(x) * [-sin1, sin2] (`signed_sin`)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


class StaticKVDecoder:
    """One batch's forward passes with a preallocated KV cache: the prompt once, then a token at a time.

    `valid_NW` marks the real (non-padding) tokens of the left-padded prompt batch; every later
    token is real. Call it with the prompt ids `[N, W]` first, then with `[N, 1]` per step; each call
    returns the last position's logits `[N, V]` (float32 when the model is).
    """

    def __init__(self, model: torch.nn.Module, valid_NW: torch.Tensor, max_new_tokens: int) -> None:
        # a parameter replaced since the last call (not loaded in place) is fused again here
        fused = fuse_projections(model)
        self.model = model
        config = model.config
        first = model.model.layers[0].self_attn
        self.D = first.head_dim
        self.H = config.num_attention_heads
        self.Hkv = config.num_key_value_heads
        N, W = valid_NW.shape
        T = W + max_new_tokens
        p = first.q_proj.weight
        self.T, self.end = T, 0
        layers = len(model.model.layers)
        # keys transposed: decode attention is q [N*Hkv, G*S, D] @ kT [N*Hkv, D, t]
        self.kT = torch.zeros((layers, N * self.Hkv, self.D, T), dtype=p.dtype, device=p.device)
        self.v = torch.zeros((layers, N * self.Hkv, T, self.D), dtype=p.dtype, device=p.device)
        # additive key mask [N, T]: 0 for real tokens, -inf for left padding
        self.key_bias_NT = torch.zeros((N, T), dtype=p.dtype, device=p.device)
        self.key_bias_NT[:, :W].masked_fill_(~valid_NW.to(p.device), float("-inf"))
        self.layers = [self._layer_weights(layer, f) for layer, f in zip(model.model.layers, fused)]

    @staticmethod
    def _layer_weights(layer: torch.nn.Module, fused: dict) -> dict:
        attn, mlp = layer.self_attn, layer.mlp
        qk_norm = None
        if getattr(attn, "q_norm", None) is not None:
            H, Hkv = attn.config.num_attention_heads, attn.config.num_key_value_heads
            # [H + Hkv, D]: each head's norm weight, q heads then k heads
            qk_norm = (torch.cat([attn.q_norm.weight.expand(H, -1), attn.k_norm.weight.expand(Hkv, -1)]),
                       attn.q_norm.variance_epsilon)
        return {
            **fused,
            "in_norm": (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            "post_norm": (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            "qk_norm": qk_norm, "scaling": attn.scaling, "act": mlp.act_fn, "inter": mlp.gate_proj.weight.shape[0],
        }

    @torch.no_grad()
    def __call__(self, ids_NS: torch.Tensor, pos_NS: torch.Tensor) -> torch.Tensor:
        N, S = ids_NS.shape
        start, end = self.end, self.end + S
        if end > self.T:
            raise ValueError(f"StaticKVDecoder: {end} positions exceed the cache's {self.T}")
        self.end = end
        H, Hkv, D = self.H, self.Hkv, self.D
        G = H // Hkv
        inner = self.model.model
        h_RM = inner.embed_tokens(ids_NS).view(N * S, -1)  # rows R = N * S
        M = h_RM.shape[-1]
        cos_NSD, sin_NSD = inner.rotary_emb(h_RM.view(N, S, M), pos_NS)
        cos = cos_NSD.view(N * S, 1, D)
        signed_sin = torch.cat((-sin_NSD[..., : D // 2], sin_NSD[..., D // 2 :]), -1).view(N * S, 1, D)
        # attention bias [N*Hkv, G*S, end], the same for every layer: padding keys and (within this
        # call) later keys are -inf
        bias = self.key_bias_NT[:, None, None, :end]  # [N, 1, 1, end]
        if S > 1:
            causal_SE = torch.ones((S, end), dtype=torch.bool, device=h_RM.device).tril(start)
            bias = bias.masked_fill(~causal_SE, float("-inf"))
            # a padding query sees no real key: it sees itself, so its (unused) row stays finite
            s_S = torch.arange(S, device=h_RM.device)
            bias[..., s_S, start + s_S] = 0.0
        bias = bias[:, None].expand(N, Hkv, G, S, end).reshape(N * Hkv, G * S, end)
        for li, w in enumerate(self.layers):
            x = F.rms_norm(h_RM, (M,), *w["in_norm"])
            qkv = _linear(x, w["qkv"])  # [R, (H + 2 Hkv) D]
            qk = qkv[:, : (H + Hkv) * D].view(N * S, H + Hkv, D)
            if w["qk_norm"] is not None:
                norm_w, eps = w["qk_norm"]
                qk = F.rms_norm(qk, (D,), None, eps) * norm_w
            qk = _rotate(qk, cos, signed_sin)
            # cache this call's keys [N*Hkv, D, S] and values [N*Hkv, S, D]
            k = qk[:, H:].view(N, S, Hkv, D).permute(0, 2, 3, 1).reshape(N * Hkv, D, S)
            v = qkv[:, (H + Hkv) * D :].view(N, S, Hkv, D).transpose(1, 2).reshape(N * Hkv, S, D)
            self.kT[li, :, :, start:end] = k
            self.v[li, :, start:end] = v
            # grouped heads as rows: q head h uses kv head h // G
            q = qk[:, :H].view(N, S, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(N * Hkv, G * S, D)
            scores = torch.baddbmm(bias, q, self.kT[li, :, :, :end], alpha=w["scaling"])
            o = torch.bmm(scores.softmax(-1), self.v[li, :, :end])
            o_RHD = o.view(N, Hkv, G, S, D).permute(0, 3, 1, 2, 4).reshape(N * S, H * D)
            h_RM = _linear(o_RHD, w["o"], residual=h_RM)
            x = F.rms_norm(h_RM, (M,), *w["post_norm"])
            gu = _linear(x, w["gate_up"])
            h_RM = _linear(w["act"](gu[:, : w["inter"]]) * gu[:, w["inter"] :], w["down"], residual=h_RM)
        last = inner.norm(h_RM.view(N, S, M)[:, -1])
        return self.model.get_output_embeddings()(last)
