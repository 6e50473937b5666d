"""[optimizer]: Muon for hidden matrices + AdamW for the rest, and the LR schedule knobs.

Consumed by `titan_ext.optimizer.build_optimizer` (the optimizer) and
`titan_ext.optimizer.build_lr_scheduler` (TorchTitan's warmup-stable-decay schedule). With `name = "adamw"` every parameter uses AdamW
at `lr`; with `name = "muon"` matrices use Muon at `lr` and embeddings, norms,
the head and biases use AdamW at `adamw_lr`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer choice, its hyper-parameters and the LR schedule."""

    name: Literal["muon", "adamw"] = option(
        "muon", doc="muon: Muon on hidden matrices + AdamW on the rest; adamw: AdamW everywhere",
        choices=("muon", "adamw"),
    )
    lr: float = option(
        1e-3, doc="learning rate of the Muon group (of every parameter when name = adamw)", ge=0.0,
    )
    adamw_lr: float = option(
        3e-4, doc="learning rate of the AdamW group (embeddings, norms, head, biases) when name = muon", ge=0.0,
    )
    weight_decay: float = option(0.1, doc="decoupled weight decay, both groups (θ ← θ·(1 − lr·wd))", ge=0.0)
    betas: tuple[float, float] = option((0.9, 0.95), doc="AdamW (β1, β2)")
    eps: float = option(1e-8, doc="AdamW denominator epsilon", gt=0.0)
    moments_dtype: Literal["float32", "bfloat16"] = option(
        "float32", doc="dtype AdamW keeps its two moments in: bfloat16 halves them (4 bytes/param less; float32 math, "
        "stored back by unbiased stochastic rounding, titan_ext.low_precision); parameters stay float32",
        choices=("float32", "bfloat16"),
    )
    momentum: float = option(0.95, doc="Muon momentum μ (EMA form: B ← μ·B + (1 − μ)·g)", ge=0.0, lt=1.0)
    nesterov: bool = option(True, doc="Muon Nesterov: orthogonalise (1 − μ)·g + μ·B instead of B")
    ns_steps: int = option(5, doc="quintic Newton–Schulz iterations", ge=1, lt=100)
    ns_coefficients: tuple[float, float, float] = option(
        (3.4445, -4.7750, 2.0315), doc="Newton–Schulz polynomial (a, b, c): X ← aX + (bA + cA²)X, A = XXᵀ",
    )
    ns_eps: float = option(1e-7, doc="floor of the Frobenius norm that normalises the update before Newton–Schulz", gt=0.0)
    ns_dtype: Literal["float32", "bfloat16"] = option(
        "bfloat16", doc="dtype of the Newton–Schulz matmuls (bfloat16 as torch.optim.Muon and DistMuon; float32 for exact checks)",
        choices=("float32", "bfloat16"),
    )
    ns_kernel: Literal["auto", "native", "fp32_accumulate", "emulated"] = option(
        "auto", doc="how bfloat16 Newton–Schulz computes: native = torch's bf16 matmuls (bit for bit torch.optim.Muon); "
        "fp32_accumulate = input and result rounded to bf16, iterations in fp32 (fp32 speed); emulated = every result "
        "rounded to bf16, matmuls as fp32 GEMMs (bf16 arithmetic); auto = fp32_accumulate on a CPU without bf16 matmul "
        "units, else native",
        choices=("auto", "native", "fp32_accumulate", "emulated"),
    )
    lr_adjust: Literal["match_rms_adamw", "original"] = option(
        "match_rms_adamw",
        doc="Muon per-matrix LR scale: match_rms_adamw = 0.2·√max(m, n) (Moonlight/Kimi); original = √max(1, m/n) (Keller Jordan)",
        choices=("match_rms_adamw", "original"),
    )
    adamw_patterns: tuple[str, ...] = option(
        (r"embed", r"(^|\.)(lm_head|output)\.", r"norm", r"(^|\.)bias$"),
        doc="regexes (re.search on the parameter name) of matrices kept on AdamW; nn.Embedding and norm modules always are",
    )
    bucket_mb: float = option(
        512.0, doc="owner path: most MiB of full matrices one exchange round moves to owners (bounds owner memory; rounds pipeline)",
        gt=0.0,
    )
    backend: Literal["auto", "owner", "dist_muon"] = option(
        "auto",
        doc="auto: TorchTitan DistMuon for CUDA DTensor params with named mesh axes, else owner; "
        "owner: gather → Newton–Schulz on one owner rank → scatter (any backend); dist_muon: TorchTitan's (CUDA only)",
        choices=("auto", "owner", "dist_muon"),
    )
    warmup_steps: int = option(
        0, doc="linear LR warmup: optimizer step s (from 0) runs at lr·(s + 1) / warmup_steps, so the first "
        "at lr / warmup_steps and step warmup_steps − 1 at lr; 0 = no warmup", ge=0,
    )
    decay_ratio: float | None = option(
        None, doc="fraction of trainer.steps spent decaying at the end (warmup-stable-decay); 0 = constant after "
        "warmup; none = decay right after warmup (TorchTitan: one more step at lr, then decay)",
        ge=0.0, le=1.0,
    )
    decay_type: Literal["linear", "sqrt", "cosine"] = option(
        "linear", doc="shape of the LR decay", choices=("linear", "sqrt", "cosine"),
    )
    min_lr_factor: float = option(
        0.0, doc="LR the decay ends at, as a fraction of the peak (reached after the last step)", ge=0.0, le=1.0,
    )
