"""Servable HF directories: a TorchTitan model (live, or a run's DCP checkpoint) as transformers / vLLM load it.

`write_hf_dir` writes what `save_pretrained` writes: `model.safetensors`, a
complete `config.json` (`architectures`, `dtype` / `torch_dtype`),
`generation_config.json` and the tokenizer files with the chat template
(`chat_template.jinja`), so `vllm serve DIR` runs it as a generative model
with no flags. `export_run` does the same from a training run's checkpoint;
the run records what it needs in `<run dir>/model.json` (`record_run_model`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from configs.sections.model import ModelConfig

RUN_MODEL_FILE = "model.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _generation_config(hf_config: Any, source_dir: Path | None) -> Any:
    """The base checkpoint's generation_config.json when it has one, else the config's token ids."""
    from transformers import GenerationConfig

    if source_dir is not None and (source_dir / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(source_dir)
    return GenerationConfig.from_model_config(hf_config)


def write_hf_dir(
    model: torch.nn.Module,
    out_dir: str | Path,
    hf_config: Any,
    *,
    tokenizer_dir: str | Path,
    generation_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` as a complete HF directory, replacing `out_dir` atomically.

    tokenizer_dir: where the tokenizer (with its chat template) is read from;
    generation_from: a directory whose generation_config.json is kept (else
    one is made from the config's bos/eos/pad ids); dtype: cast the weights
    (e.g. bf16 for serving). Collective on a sharded model (call on every
    rank); rank 0 writes.
    """
    from transformers import AutoTokenizer

    from titan_ext.hf_checkpoint import save_hf

    out_dir = Path(out_dir)
    if _rank() == 0:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-")) if _rank() == 0 else out_dir
    try:
        save_hf(model, staging, hf_config, dtype=dtype)  # collective gather; rank 0 writes
        if _rank() != 0:
            return out_dir
        staging.chmod(0o755)
        _generation_config(hf_config, Path(generation_from) if generation_from else None).save_pretrained(staging)
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


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
    import torch.distributed.checkpoint as dcp

    from configs.sections.checkpoint import CheckpointConfig
    from titan_ext.checkpoint import COMPLETE, Checkpointer, step_dir_name
    from titan_ext.models import init_model, resolve_model
    from titan_ext.platform import detect_platform

    run_dir = Path(run_dir)
    model_cfg, checkpoint_dir = _run_model(run_dir)
    steps = Checkpointer(CheckpointConfig(), checkpoint_dir).complete_steps()
    if step is None:
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {checkpoint_dir} (the run's final weights: {run_dir / 'hf'})")
        step = steps[-1]
    path = checkpoint_dir / step_dir_name(step)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"no complete checkpoint of step {step} in {checkpoint_dir} (complete steps: {steps})")

    model_cfg = dataclasses.replace(model_cfg, device="cpu")
    resolved = resolve_model(model_cfg, detect_platform("cpu"))
    with torch.device("meta"):
        model = resolved.spec.model.build()
    init_model(model, "cpu", model_cfg.seed)
    loaded = {"model": model.state_dict()}
    dcp.load(loaded, checkpoint_id=str(path))
    model.load_state_dict(loaded["model"])
    tokenizer_dir = model_cfg.tokenizer_path or model_cfg.hf_path
    out = write_hf_dir(model, out_dir, resolved.hf_config, tokenizer_dir=tokenizer_dir,
                       generation_from=model_cfg.hf_path or None, dtype=dtype)
    return out, step
