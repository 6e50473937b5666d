"""`composer-mesh export`: a training run's DCP checkpoint as a servable HF directory.

The run records what it needs in `<run dir>/model.json` (`record_run_model`);
`export_run` rebuilds the model on CPU from it, loads the checkpoint's model
state through DCP and writes it with `titan_ext.hf.write.save_hf_dir`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from composer_mesh.configs.sections.checkpoint import CheckpointConfig
from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.checkpoint import COMPLETE, Checkpointer, step_dir_name
from composer_mesh.titan_ext.platform import detect_platform

RUN_MODEL_FILE = "model.json"


def record_run_model(run_dir: str | Path, model_cfg: ModelConfig, checkpoint_dir: str | Path) -> Path:
    """Write `<run dir>/model.json`: the `[model]` section the run trained (hf_path resolved) and its checkpoints."""
    path = Path(run_dir) / RUN_MODEL_FILE
    path.write_text(json.dumps({"model": dataclasses.asdict(model_cfg), "checkpoint_dir": str(checkpoint_dir)},
                               indent=2) + "\n")
    return path


def _run_model(run_dir: Path) -> tuple[ModelConfig, Path]:
    path = run_dir / RUN_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a `composer-mesh train` run directory?")
    try:
        record = json.loads(path.read_text())
        return ModelConfig(**record["model"]), Path(record["checkpoint_dir"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a run model record ({type(e).__name__}: {e})") from None


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               dtype: torch.dtype | None = None) -> tuple[Path, int]:
    """Export the run's checkpoint of `step` (default: the newest complete one) to `out_dir`; returns (dir, step).

    The model is rebuilt on CPU from the run's `[model]` section and the
    checkpoint's model state loaded through DCP (any training mesh reshards).
    """
    run_dir = Path(run_dir)
    model_cfg, checkpoint_dir = _run_model(run_dir)
    steps = Checkpointer(CheckpointConfig(), checkpoint_dir).complete_steps()
    if step is None:
        if not steps:
            raise FileNotFoundError(
                f"no complete checkpoint in {checkpoint_dir} (the run's final weights: {run_dir / 'hf'})")
        step = steps[-1]
    path = checkpoint_dir / step_dir_name(step)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"no complete checkpoint of step {step} in {checkpoint_dir} (complete steps: {steps})")

    # lazy: the controller records the run's model through this module (titan_ext.spec)
    from composer_mesh.titan_ext.hf.write import save_hf_dir
    from composer_mesh.titan_ext.models import init_model, resolve_model

    model_cfg = dataclasses.replace(model_cfg, device="cpu")
    resolved = resolve_model(model_cfg, detect_platform("cpu"))
    with torch.device("meta"):
        model = resolved.spec.model.build()
    init_model(model, "cpu", model_cfg.seed)
    loaded = {"model": model.state_dict()}
    dcp.load(loaded, checkpoint_id=str(path))
    model.load_state_dict(loaded["model"])
    tokenizer_dir = model_cfg.tokenizer_path or model_cfg.hf_path
    out = save_hf_dir(model, out_dir, resolved.hf_config, tokenizer_dir=tokenizer_dir,
                      generation_from=model_cfg.hf_path or None, dtype=dtype)
    return out, step
