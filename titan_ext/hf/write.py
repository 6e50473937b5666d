"""TorchTitan models out to HF directories: safetensors, config.json, and servable directories.

`save_hf_weights` writes `config.json` + a byte-deterministic
`model.safetensors`, streamed bucket by bucket (`titan_ext.hf.adapters`).
`save_hf_dir` writes what `save_pretrained` writes: the weights, a complete
`config.json` (`architectures`, `dtype` / `torch_dtype`),
`generation_config.json` and the tokenizer files with the chat template
(`chat_template.jinja`), so `vllm serve DIR` runs it as a generative model
with no flags. Collective on a sharded model; rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, GenerationConfig

from composer_mesh.titan_ext.hf.adapters import iter_hf_buckets
from composer_mesh.titan_ext.hf.config import serving_config_json
from composer_mesh.titan_ext.hf.derive import hf_config_for
from composer_mesh.titan_ext.hf.read import SAFETENSORS_DTYPES

SAVE_BUCKET_BYTES = 64 << 20
_DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def save_hf_weights(
    model: torch.nn.Module,
    out_dir: str | Path,
    hf_config: Any = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` as an HF directory: `config.json` + `model.safetensors`.

    hf_config: a transformers `PretrainedConfig`; derived with `hf_config_for`
    when omitted; written complete for serving (`serving_config_json`).
    dtype: cast the weights (e.g. bf16 for serving). The output is
    byte-identical for identical weights. Call on every rank of a sharded
    model (the gathers are collective); only rank 0 writes. Streams the
    buckets (`write_safetensors`): no rank holds more than one bucket beside
    the model.
    """
    out_dir = Path(out_dir)
    rank0 = _rank() == 0
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
    buckets = iter_hf_buckets(model, SAVE_BUCKET_BYTES, dtype=dtype)
    saved_dtype = write_safetensors(out_dir / "model.safetensors", buckets, write=rank0)
    if not rank0:
        return out_dir
    hf_config = hf_config if hf_config is not None else hf_config_for(model.config)
    (out_dir / "config.json").write_text(serving_config_json(hf_config, saved_dtype))
    return out_dir


def write_safetensors(path: Path, buckets: Iterable[list[tuple[str, torch.Tensor]]], write: bool = True) -> torch.dtype:
    """Write `(name, tensor)` buckets as one safetensors file, a bucket at a time; returns the first tensor's dtype.

    The data goes to a side file as the buckets arrive (their names and shapes
    are not known before), then the header (sorted names, `{"format": "pt"}`,
    padded to 8 bytes as the format asks) and the data are joined into `path`.
    `write=False` consumes the buckets without writing (the other ranks of a
    collective export).
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    first: torch.dtype | None = None
    offset = 0
    data_path = path.with_name(f".{path.name}.data")
    with open(data_path, "wb") if write else contextlib.nullcontext() as data:
        for bucket in buckets:
            for name, tensor in bucket:
                first = first or tensor.dtype
                if not write:
                    continue
                raw = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                data.write(memoryview(raw))
                header[name] = {"dtype": _DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + raw.nbytes]}
                offset += raw.nbytes
    if first is None:
        raise ValueError(f"{path}: no tensors to write")
    if write:
        encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(path, "wb") as out, open(data_path, "rb") as data:
            out.write(struct.pack("<Q", len(encoded)) + encoded)
            shutil.copyfileobj(data, out, 16 << 20)
        data_path.unlink()
    return first


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _generation_config(hf_config: Any, source_dir: Path | None) -> Any:
    """The base checkpoint's generation_config.json when it has one, else the config's token ids."""
    if source_dir is not None and (source_dir / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(source_dir)
    return GenerationConfig.from_model_config(hf_config)


def save_hf_dir(
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
    out_dir = Path(out_dir)
    if _rank() == 0:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-")) if _rank() == 0 else out_dir
    try:
        # collective gather; rank 0 writes
        save_hf_weights(model, staging, hf_config, dtype=dtype)
        if _rank() != 0:
            return out_dir
        staging.chmod(0o755)
        _generation_config(hf_config, Path(generation_from) if generation_from else None).save_pretrained(staging)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        # transformers records HF_HUB_OFFLINE's `local_files_only` in the saved config: the files would depend on
        # the environment they were written in
        tokenizer.init_kwargs.pop("local_files_only", None)
        tokenizer.save_pretrained(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
