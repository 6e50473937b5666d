"""The train step: one `TrainBatch` → three-channel loss → one optimizer step.

`Trainer` builds the TorchTitan model for `[model]` on the meshes of
`[parallelism]` (meta build → FSDP2/HSDP/EP → seeded init → optional HF
weights), the optimizer of `[optimizer]` (sharded Muon + AdamW) with
TorchTitan's warmup-stable-decay LR schedule, and checkpoints of
`[checkpoint]`. Device and backend come from `titan_ext.platform` only.

One step, per gradient-accumulation microbatch (`TrainBatch.microbatches`):

1. hint distillation: a no-grad forward of the policy on the hint-injected
   teacher rows; its hidden states are gathered to the student's positions
   (`hint_index_BL`); with `[loss.distill] rlsd` they also size the policy
   channel's advantages on the hinted rollouts' tokens (`hinted_BL`);
2. the student forward on the packed rows gives hidden states for the policy
   and distillation channels; `losses.composer.compose_loss` applies the LM
   head chunk by chunk (no `[B, L, V]` logits) → backward;
3. trace replay: one forward on chosen + rejected rows → DPO / SimPO → backward.

Each loss is divided by the batch's *global* counts, so gradients summed over
microbatches and data-parallel ranks (FSDP reduces with SUM) are those of the
whole batch. Then: global grad-norm clipping (expert-parallel aware), the
optimizer and LR-scheduler step, the TAID schedule, metrics reduced over ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.distributed.utils import clip_grad_norm_

from composer_mesh.losses.composer import (
    DistillInputs,
    PolicyInputs,
    PreferenceInputs,
    compose_loss,
    metric_reduce_op,
    summarize_metrics,
)
from composer_mesh.losses.distill import TAIDSchedule
from composer_mesh.losses.mismatch import packed_sequence_ids
from composer_mesh.titan_ext.assets import tokenizer_dir_for
from composer_mesh.titan_ext.attention import attention_masks
from composer_mesh.titan_ext.batch import TrainBatch
from composer_mesh.titan_ext.checkpoint import Checkpointer
from composer_mesh.titan_ext.file_backed import map_parameters_to_file
from composer_mesh.titan_ext.hf.adapters import HFBucket, iter_hf_buckets
from composer_mesh.titan_ext.hf.parity import verify_hf_checkpoint
from composer_mesh.titan_ext.hf.read import load_hf_into_titan
from composer_mesh.titan_ext.hf.write import save_hf_dir
from composer_mesh.titan_ext.models import init_model, resolve_model
from composer_mesh.titan_ext.optimizer import build_lr_scheduler, build_optimizer
from composer_mesh.titan_ext.parallelize import build_parallel_dims, parallelize_model, prepare_model_config
from composer_mesh.titan_ext.platform import Platform, detect_platform, init_process_group
from composer_mesh.titan_ext.rendezvous import master_port
from composer_mesh.titan_ext.spec import TrainerSpec
from composer_mesh.titan_ext.torchtitan_compat import skip_lm_head


def ensure_process_group(platform: Platform) -> torch.device:
    """Join the torchrun-style process group, or start a one-rank group on loopback."""
    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        port = master_port("127.0.0.1")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_process_group(platform)


class Trainer:
    """A TorchTitan model, its optimizer and schedule, and the three-channel train step.

    Collective: every rank of the process group constructs it and calls
    `train_step` / `save_checkpoint` / exports in the same order.
    """

    def __init__(self, spec: TrainerSpec, platform: Platform | None = None) -> None:
        if spec.model.dtype != "float32":
            raise ValueError(
                f"model.dtype = {spec.model.dtype!r}: the trainer keeps float32 master weights (optimizer states and "
                "updates in float32); for bfloat16 compute set parallelism.param_dtype = 'bfloat16' instead")
        self.spec = spec
        self.platform = platform or detect_platform(spec.model.device)
        self.device = ensure_process_group(self.platform)
        self.loss_cfg = spec.loss

        resolved = resolve_model(spec.model, self.platform)
        self._verify_checkpoint()
        self.model_spec = resolved.spec
        self.hf_config = resolved.hf_config
        prepare_model_config(self.model_spec.model, spec.parallelism)
        self.parallel_dims = build_parallel_dims(spec.parallelism, dist.get_world_size(), self.platform)
        self.model = model = self._build_model()
        # DPO's π_ref: the initial weights, frozen (built before any checkpoint is loaded into the policy),
        # in the serving dtype unless set otherwise
        self.reference: torch.nn.Module | None = None
        if spec.trainer.dpo_reference == "frozen" and spec.loss.beta > 0 and spec.loss.preference.needs_reference:
            reference_dtype = getattr(torch, spec.reference_dtype)
            self.reference = self._build_model(copy_of=model, dtype=reference_dtype).requires_grad_(False).eval()
            if spec.trainer.dpo_reference_storage == "file":
                if not spec.run_dir:
                    raise ValueError("trainer.dpo_reference_storage = 'file' needs a run folder (TrainerSpec.run_dir)")
                map_parameters_to_file(self.reference,
                                       Path(spec.run_dir) / f"dpo_reference.rank{dist.get_rank()}.safetensors")

        self.optimizer = build_optimizer(model, spec.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, spec.optimizer, spec.trainer.steps)
        # MoE load-balancing bias updates
        if self.model_spec.post_optimizer_build_fn is not None:
            self.model_spec.post_optimizer_build_fn(self.optimizer, [model], self.parallel_dims)

        d = spec.loss.distill
        self.taid = (
            TAIDSchedule(d.taid_t_start, d.taid_t_end, d.taid_alpha, d.taid_beta, d.taid_adaptive)
            if d.kind == "taid" else None
        )
        self.step = 0
        self.data_cursors: dict[str, Any] = {}
        # a context per named phase of a step (the actor's peak-memory accounting, actors.phase_memory)
        self.phase: Callable[[str], ContextManager[None]] = lambda name: contextlib.nullcontext()
        # state of wrappers around model + optimizer (DiLoCo), saved in the checkpoint beside the trainer's
        self.wrappers: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        # loaded from a checkpoint before its wrapper registered
        self._wrapper_state: dict[str, Any] = {}
        self.checkpointer = Checkpointer(spec.checkpoint, spec.checkpoint_dir) if spec.checkpoint_dir else None
        if self.checkpointer is not None:
            resume = self.checkpointer.resume_step()
            if resume is not None:
                self.load_checkpoint(resume)

    def _verify_checkpoint(self) -> None:
        """`hf.parity.verify_hf_checkpoint` on rank 0 only (a CPU copy of a few layers per host is enough);
        every rank raises its error, so no rank waits in a collective for one that failed."""
        error = [None]
        if dist.get_rank() == 0:
            try:
                verify_hf_checkpoint(self.spec.model)
            except ValueError as e:
                error[0] = str(e)
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise ValueError(error[0])

    def _build_model(self, copy_of: torch.nn.Module | None = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """Meta build → parallelize (FSDP2 / HSDP / EP) → seeded init → `hf_path` weights, or a copy of the
        weights of `copy_of` (built the same way: same shards, so each rank copies its own; no second file read).

        `dtype` other than float32 (a frozen copy only): parameters are stored in it and FSDP gathers and
        computes in it (its mixed precision set to that dtype: nothing to cast); buffers keep theirs.
        """
        with torch.device("meta"):
            model = self.model_spec.model.build()
        parallelism = self.spec.parallelism
        if dtype != torch.float32:
            name = str(dtype).removeprefix("torch.")
            parallelism = dataclasses.replace(parallelism, param_dtype=name, reduce_dtype=name)
            # in place: a tied weight stays one parameter
            for p in model.parameters():
                p.data = p.data.to(dtype)
        parallelize_model(model, self.model_spec, self.parallel_dims, parallelism, self.platform)
        init_model(model, self.device, self.spec.model.seed)
        if copy_of is not None:
            with torch.no_grad():
                for mine, theirs in zip(itertools.chain(model.parameters(), model.buffers()),
                                        itertools.chain(copy_of.parameters(), copy_of.buffers()), strict=True):
                    # parameters, not state-dict entries: the fused-QKV hook returns copies; a cast rounds to
                    # nearest even, as the weight export to generators does
                    mine.copy_(theirs)
        elif self.spec.model.hf_path:
            load_hf_into_titan(model, self.spec.model.hf_path)
        skip_lm_head(model)
        return model

    # ---- forward pieces ----------------------------------------------------------------------

    def hidden_states(
        self, tokens_BL: torch.Tensor, positions_BL: torch.Tensor, model: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """Final (normed) hidden states `[B, L, D]` of packed rows (of the policy unless `model` is given)."""
        model = self.model if model is None else model
        tokens_BL, positions_BL = tokens_BL.to(self.device), positions_BL.to(self.device)
        return model(tokens_BL, positions_BL, attention_masks(model, positions_BL))

    def head_weight(self, model: torch.nn.Module | None = None) -> torch.Tensor:
        """The LM-head weight `[V, D]` as the forward uses it (gathered when FSDP-sharded)."""
        head = (self.model if model is None else model).lm_head
        if isinstance(head, FSDPModule):
            # no-op right after a forward: the head group does not reshard
            head.unshard()
        return head.weight

    @torch.no_grad()
    def logits(self, tokens_BL: torch.Tensor, positions_BL: torch.Tensor | None = None) -> torch.Tensor:
        """Full `[B, L, V]` logits (evaluation and parity checks only; training never builds them)."""
        if positions_BL is None:
            positions_BL = torch.arange(tokens_BL.shape[1]).expand_as(tokens_BL)
        hidden_BLD = self.hidden_states(tokens_BL, positions_BL)
        weight_VD = self.head_weight()
        return hidden_BLD.float() @ weight_VD.float().T

    # ---- the step ----------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; returns reduced metrics."""
        self._check_batch(batch)
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[dict[str, torch.Tensor]] = []
        for mb in batch.microbatches(self.spec.trainer.microbatches):
            parts.append(self._student_pass(mb))
            if batch.pairs > 0:
                parts.append(self._preference_pass(mb))
        grad_norm = self._clip_gradients()
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"non-finite gradient norm ({float(grad_norm)}) at step {self.step + 1}; the step was skipped, "
                "weights and optimizer state are unchanged (check the batch's advantages and logprobs)"
            )
        # this step's own (the scheduler moves next)
        lr = float(self.lr_scheduler.schedulers[0].get_last_lr()[0])
        self.optimizer.step()
        # nothing reads them before the next step's backward: the weight sync, checkpoint and export run without
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.step += 1
        metrics = self._reduce_metrics(parts)
        if self.taid is not None and "distill/loss" in metrics:
            self.taid.update(metrics["distill/loss"], self.step, self.spec.trainer.steps)
        metrics.update(
            step=float(self.step),
            grad_norm=float(grad_norm),
            lr=lr,
        )
        metrics["time/step_s"] = time.perf_counter() - start
        if self.taid is not None:
            metrics["distill/taid_t"] = self.taid.t
        if self.checkpointer is not None and self.checkpointer.should_save(self.step):
            with self.phase("checkpoint"):
                self.save_checkpoint()
        return metrics

    def _check_batch(self, batch: TrainBatch) -> None:
        """Raise the same ValueError on every rank when any rank's batch is unusable.

        Token ids must lie inside the vocabulary, and every rank must run the same
        passes (channel presence follows the global counts); a rank that failed
        alone would leave the others waiting in a collective.
        """
        problem = self._batch_problem(batch)
        flag = torch.tensor([0 if problem is None else 1], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) or problem is not None:
            raise ValueError(problem or "another rank's share of the batch is invalid (see that rank's error)")

    def _batch_problem(self, batch: TrainBatch) -> str | None:
        vocab = self.model_spec.model.vocab_size
        for name in ("tokens_BL", "labels_BL", "hint_tokens_BH", "chosen_tokens_PS", "chosen_labels_PS",
                     "rejected_tokens_PS", "rejected_labels_PS"):
            ids = getattr(batch, name)
            if ids is not None and ids.numel() and int(ids.max()) >= vocab:
                return f"{name} holds token id {int(ids.max())} >= the model's vocabulary size {vocab}"
        if batch.distill_tokens > 0 and not batch.has_distill:
            return "batch.distill_tokens > 0 but this rank's batch has no hint-distillation tensors"
        if batch.pairs > 0 and not batch.has_pairs:
            return "batch.pairs > 0 but this rank's batch has no preference pairs"
        if batch.pairs > 0 and self.spec.loss.preference.needs_reference and not batch.has_reference:
            return f"{self.spec.loss.preference.kind} needs ref_chosen_logprobs_P / ref_rejected_logprobs_P in the batch"
        if batch.policy_tokens == 0 and batch.distill_tokens == 0 and batch.pairs == 0:
            return "empty batch: policy_tokens, distill_tokens and pairs are all 0"
        return None

    def _student_pass(self, mb: TrainBatch) -> dict[str, torch.Tensor]:
        """Policy + hint-distillation channels on the packed student rows; runs backward."""
        if mb.policy_tokens == 0 and mb.distill_tokens == 0:
            return {}
        dev = self.device
        teacher_BLD = None
        if mb.distill_tokens > 0:
            with torch.no_grad():
                teacher_BHD = self.hidden_states(mb.hint_tokens_BH, mb.hint_positions_BH)
            index_BL = mb.hint_index_BL.to(dev).clamp(min=0)
            teacher_BLD = teacher_BHD.gather(1, index_BL.unsqueeze(-1).expand(-1, -1, teacher_BHD.shape[-1]))
        hidden_BLD = self.hidden_states(mb.tokens_BL, mb.positions_BL)
        labels_BL = mb.labels_BL.to(dev)
        policy = distill = None
        if mb.policy_tokens > 0:
            policy = PolicyInputs(
                hidden_BTD=hidden_BLD,
                labels_BT=labels_BL,
                mask_BT=mb.policy_mask_BL.to(dev),
                advantages=mb.advantages_BL.to(dev),
                num_tokens=mb.policy_tokens,
                gen_logprobs_BT=mb.generator_logprobs_BL.to(dev),
                seq_ids_BT=packed_sequence_ids(mb.positions_BL).to(dev),
            )
        if teacher_BLD is not None:
            distill = DistillInputs(
                hidden_BTD=hidden_BLD,
                teacher_hidden_BTD=teacher_BLD,
                mask_BT=mb.distill_mask_BL.to(dev),
                num_tokens=mb.distill_tokens,
                labels_BT=labels_BL,
                gen_logprobs_BT=mb.generator_logprobs_BL.to(dev),
            )
            if policy is not None and mb.hinted_BL is not None:
                policy.rlsd_mask_BT = mb.hinted_BL.to(dev)
                policy.rlsd_teacher_hidden_BTD = teacher_BLD
        out = compose_loss(
            self.loss_cfg, self.head_weight(), policy=policy, distill=distill,
            taid_t=None if self.taid is None else self.taid.t,
        )
        self._backward(out.loss, hidden_BLD)
        return out.metrics

    def _preference_pass(self, mb: TrainBatch) -> dict[str, torch.Tensor]:
        """Trace-replay channel: one forward on chosen + rejected rows; runs backward."""
        dev = self.device
        P = mb.num_pairs
        tokens = torch.cat([mb.chosen_tokens_PS, mb.rejected_tokens_PS])
        positions = torch.cat([mb.chosen_positions_PS, mb.rejected_positions_PS])
        hidden_2PSD = self.hidden_states(tokens, positions)
        chosen_labels, rejected_labels = mb.chosen_labels_PS.to(dev), mb.rejected_labels_PS.to(dev)
        # Padding rows (no action tokens) are not pairs: they must not add −log σ(0)-style terms.
        real_P = (chosen_labels >= 0).any(-1) & (rejected_labels >= 0).any(-1)
        if not bool(real_P.any()):
            self._backward(None, hidden_2PSD)
            return {}
        ref_c = ref_r = None
        if mb.has_reference:
            ref_c, ref_r = mb.ref_chosen_logprobs_P.to(dev)[real_P], mb.ref_rejected_logprobs_P.to(dev)[real_P]
        inputs = PreferenceInputs(
            chosen_hidden_BTD=hidden_2PSD[:P][real_P],
            chosen_labels_BT=chosen_labels[real_P],
            chosen_mask_BT=chosen_labels[real_P] >= 0,
            rejected_hidden_BTD=hidden_2PSD[P:][real_P],
            rejected_labels_BT=rejected_labels[real_P],
            rejected_mask_BT=rejected_labels[real_P] >= 0,
            num_pairs=mb.pairs,
            ref_chosen_logps_P=ref_c,
            ref_rejected_logps_P=ref_r,
        )
        out = compose_loss(self.loss_cfg, self.head_weight(), preference=inputs)
        self._backward(out.loss, hidden_2PSD)
        return out.metrics

    def _backward(self, loss: torch.Tensor | None, hidden: torch.Tensor) -> None:
        """Backward through the whole forward and the LM head on every rank, even when this
        rank's share is empty.

        FSDP's reduce-scatters (and EP's all-to-alls) are collectives: every rank
        must produce gradients for the same parameters, including an untied LM
        head that only the loss touches. The zero-weighted sums keep the forward
        and the head in the graph without changing any gradient.
        """
        anchor = (hidden.sum() + self.head_weight().sum()) * 0.0
        (anchor if loss is None else loss + anchor).backward()

    def _clip_gradients(self) -> torch.Tensor:
        """Global grad norm over all ranks and meshes; clip to `grad_clip` (0 = measure only)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.spec.trainer.grad_clip or math.inf
        return clip_grad_norm_(params, max_norm, foreach=True, ep_enabled=self.parallel_dims.ep_enabled)

    def _reduce_metrics(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Combine microbatch metrics and all ranks' (SUM, or MAX for `*_max`), then means."""
        local: dict[str, torch.Tensor] = {}
        for part in parts:
            for name, value in part.items():
                value = value.detach().float().cpu()
                if name not in local:
                    local[name] = value
                elif metric_reduce_op(name) == "max":
                    local[name] = torch.maximum(local[name], value)
                else:
                    local[name] = local[name] + value
        names: list[Any] = [sorted(local)] * dist.get_world_size()
        dist.all_gather_object(names, sorted(local))
        keys = sorted(set().union(*names))
        for op, kind in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max")):
            group = [k for k in keys if metric_reduce_op(k) == kind]
            if not group:
                continue
            values = torch.stack([local.get(k, torch.zeros(())) for k in group]).to(self.device)
            dist.all_reduce(values, op=op)
            local.update(zip(group, values.cpu()))
        return summarize_metrics({k: local[k] for k in keys})

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict_extra(self) -> dict[str, Any]:
        """Trainer state outside model and optimizer tensors (goes into the checkpoint)."""
        return {
            "step": self.step,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "taid": None if self.taid is None else self.taid.state_dict(),
            "data_cursors": dict(self.data_cursors),
            "wrappers": {key: save() for key, (save, _) in self.wrappers.items()},
        }

    def register_wrapper(self, key: str, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Checkpoint `save()` under `key` from now on; if the resumed checkpoint holds `key`, `load` it now."""
        self.wrappers[key] = (save, load)
        if key in self._wrapper_state:
            load(self._wrapper_state.pop(key))

    def save_checkpoint(self) -> Path:
        if self.checkpointer is None:
            raise RuntimeError("no checkpoint folder configured (TrainerSpec.checkpoint_dir is empty)")
        return self.checkpointer.save(self.step, self.model, self.optimizer, self.state_dict_extra())

    def load_checkpoint(self, step: int) -> None:
        """Restore model, optimizer, scheduler, TAID, step, data cursors and RNG from `step`."""
        if self.checkpointer is None:
            raise RuntimeError("no checkpoint folder configured (TrainerSpec.checkpoint_dir is empty)")
        state = self.checkpointer.load(step, self.model, self.optimizer)
        self.step = state["step"]
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.taid is not None and state["taid"] is not None:
            self.taid.load_state_dict(state["taid"])
        self.data_cursors = dict(state["data_cursors"])
        self._wrapper_state = dict(state.get("wrappers", {}))
        for key, (_, load) in self.wrappers.items():
            if key in self._wrapper_state:
                load(self._wrapper_state.pop(key))

    def save_hf_dir(self, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
        """The current weights as a servable HF directory (collective; see `titan_ext.hf.write`)."""
        m = self.spec.model
        return save_hf_dir(self.model, out_dir, self.hf_config, tokenizer_dir=tokenizer_dir_for(m),
                           generation_from=m.hf_path or None, dtype=dtype)

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[HFBucket]:
        """HF-named weight buckets for generators (collective; see `titan_ext.hf.adapters`)."""
        return iter_hf_buckets(self.model, int(self.spec.trainer.export_bucket_mib * 2**20), dtype=dtype)

    def named_full_parameters(self) -> dict[str, torch.Tensor]:
        """The model's state dict as full CPU tensors (collective gathers; tests and small models)."""
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in self.model.state_dict().items()
        }
