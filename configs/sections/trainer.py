"""[trainer]: the RL loop's sizes and the train step's knobs."""

from __future__ import annotations

from dataclasses import dataclass

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = option(100, ge=1, doc="Optimizer steps to run (also the length of the LR schedule).")
    prompts_per_step: int = option(8, ge=1, doc="Prompts per step (each sampled group_size times by the generator).")
    microbatches: int = option(1, ge=1, doc="Gradient-accumulation microbatches per step (global token counts keep the loss exact).")
    max_seq_len: int = option(512, ge=8, doc="Packed sequence length [B, L] of a training microbatch.")
    grad_clip: float = option(1.0, ge=0.0, doc="Max global grad norm; 0 disables clipping.")
    mode: str = option("sync", choices=("sync", "async"), doc="sync = on-policy; async = generator runs ahead up to max_staleness.")
    max_staleness: int = option(0, ge=0, doc="Async mode: drop samples older than this many policy versions.")
    eval_every: int = option(
        0, ge=0, doc="Held-out evaluation every N steps, before the first and after the last (greedy and sampled reward "
        "on the environment's held-out split; never trained on); 0 = off.",
    )
    eval_samples: int = option(8, ge=1, doc="Held-out problems per evaluation (the same fixed set every time).")
    eval_split: str = option(
        "heldout", choices=("heldout", "validation"),
        doc="The split evaluations draw from: heldout (for reporting), or validation (for choosing settings: "
        "env.demo / env.coding validation_fraction carves it out of train, so the held-out split stays unseen).",
    )
    eval_hinted: bool = option(
        False, doc="Coding tasks: each evaluation also samples its problems with the task's reference as a privileged "
        "note after the prompt (where the hint channel puts hints; never trained on): eval/heldout_hinted_sampled_pass "
        "and eval/heldout_hint_gap (hinted minus unhinted sampled pass rate). Costs a second sampled pass.",
    )
    dpo_reference: str = option(
        "frozen", choices=("frozen", "policy"),
        doc="DPO's reference π_ref: frozen = the initial weights, kept by the trainer (one more parameter copy, "
        "sharded like the policy, no grads or optimizer state); policy = the current policy just before the step "
        "(no memory; the DPO loss then reads log 2).",
    )
    dpo_reference_dtype: str = option(
        "serving", choices=("serving", "float32", "bfloat16"),
        doc="dtype the frozen DPO reference is kept and run in: serving = generator.dtype (the weights the "
        "generators started from, 2 bytes/param in bfloat16 instead of 4), or float32 / bfloat16.",
    )
    dpo_reference_storage: str = option(
        "memory", choices=("memory", "file"),
        doc="Where the frozen DPO reference's parameters live: memory = the trainer's private memory; file = a "
        "safetensors copy in the run folder (<output_dir>/<name>/dpo_reference.rank<R>.safetensors) read through "
        "mmap, held as page cache the kernel may evict (the same bytes: DPO's numbers are unchanged; one "
        "unsharded trainer rank only).",
    )
    export_bucket_mib: float = option(
        256.0, gt=0.0, doc="Weight export for generators: MiB of full (gathered) tensors materialised per bucket."
    )
