"""`build_model`: a `[model]` section as a ready TorchTitan model on one device.

Resolve (`titan_ext.models`) -> build on meta -> seeded init -> check and load
the HF checkpoint when `hf_path` is set (`titan_ext.hf.parity`,
`titan_ext.hf.read`) -> cast. The parallel trainer does the same steps with
parallelization between the meta build and the init.
"""

from __future__ import annotations

import torch

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.hf.parity import verify_hf_checkpoint
from composer_mesh.titan_ext.hf.read import load_hf_into_titan
from composer_mesh.titan_ext.models import init_model, resolve_model
from composer_mesh.titan_ext.platform import Platform


def build_model(
    model_cfg: ModelConfig,
    device: torch.device | str | None = None,
    platform: Platform | None = None,
) -> torch.nn.Module:
    """Build and initialize a model on one device; load `hf_path` when set.

    With no hf_path the weights are TorchTitan's init under `seed`; for the
    tiny flavours on CPU that is exactly what the built assets hold. A
    checkpoint is first checked against transformers (`hf.parity`). The
    parallel trainer does the same steps with parallelization between
    the meta build and `init_model`: resolve_model -> build on meta ->
    parallelize -> init_model -> load_hf_into_titan.
    """
    resolved = resolve_model(model_cfg, platform)
    device = torch.device(device) if device is not None else resolved.platform.device_type
    with torch.device("meta"):
        model = resolved.spec.model.build()
    init_model(model, device, model_cfg.seed)
    if model_cfg.hf_path:
        verify_hf_checkpoint(model_cfg)
        load_hf_into_titan(model, model_cfg.hf_path)
    dtype = getattr(torch, model_cfg.dtype)
    # Floating tensors only: `Module.to(dtype)` would also cast ComplexRoPE's complex cache to real (Llama).
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
