"""Load-time check that the TorchTitan model computes what transformers computes from a checkpoint.

A config.json field the mapping ignores (or maps wrongly) shows as different
logits, not as an error: this catches it when the checkpoint is loaded. The
check is cheap for any size: the first `layers` decoder layers and the first
`PROBE_VOCAB` vocabulary rows of the checkpoint (read selectively from the
safetensors) run on CPU in fp32, once as the TorchTitan model the `[model]`
section resolves to (truncated the same way) and once as the transformers
model of the truncated config.json; logits must agree to `TOL`.
"""

from __future__ import annotations

import copy
import functools
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.attention import attention_masks
from composer_mesh.titan_ext.hf.read import load_hf_state_dict, safetensors_files
from composer_mesh.titan_ext.models import init_model, resolve_model
from composer_mesh.titan_ext.platform import detect_platform

PROBE_VOCAB = 4096
TOL = 1e-4
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
_VOCAB_KEYS = ("model.embed_tokens.weight", "lm_head.weight")


def _read_probe_tensors(hf_dir: Path, layers: int, vocab: int) -> dict[str, torch.Tensor]:
    """Tensors of the first `layers` layers plus embeddings/norm/head, vocabulary rows cut to `vocab`."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(hf_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                layer = _LAYER_KEY.match(key)
                if layer is not None and int(layer.group(1)) >= layers:
                    continue
                out[key] = f.get_slice(key)[:vocab] if key in _VOCAB_KEYS else f.get_tensor(key)
    return {k: v.float().contiguous() for k, v in out.items()}


def _truncated_hf_config(hf_config: Any, layers: int, vocab: int) -> Any:
    cfg = copy.deepcopy(hf_config)
    cfg.num_hidden_layers, cfg.vocab_size = layers, vocab
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    if getattr(cfg, "mlp_only_layers", None):
        cfg.mlp_only_layers = [i for i in cfg.mlp_only_layers if i < layers]
    return cfg


def _truncated_titan_config(model_config: Any, layers: int, vocab: int) -> Any:
    cfg = copy.deepcopy(model_config)
    cfg.layers = cfg.layers[:layers]
    cfg.vocab_size = cfg.tok_embeddings.num_embeddings = cfg.lm_head.out_features = vocab
    return cfg


@torch.no_grad()
def probe_max_diff(model_cfg: ModelConfig, layers: int) -> tuple[float, float]:
    """(max |Δlogit|, max |logit|) between TorchTitan and transformers on the truncated checkpoint."""
    hf_dir = Path(model_cfg.hf_path)
    resolved = resolve_model(model_cfg, detect_platform("cpu"))
    layers = min(layers, len(resolved.spec.model.layers))
    vocab = min(PROBE_VOCAB, resolved.spec.model.vocab_size)
    tensors = _read_probe_tensors(hf_dir, layers, vocab)

    with torch.device("meta"):
        titan = _truncated_titan_config(resolved.spec.model, layers, vocab).build()
    init_model(titan, "cpu", seed=0)
    load_hf_state_dict(titan, dict(tensors), f"{hf_dir} (first {layers} layers)")
    titan = titan.float().eval()

    # Through files, so that from_pretrained applies transformers' weight conversions.
    with tempfile.TemporaryDirectory(prefix="hf-probe-") as tmp:
        _truncated_hf_config(resolved.hf_config, layers, vocab).save_pretrained(tmp)
        save_file(tensors, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        hf, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, output_loading_info=True)
    hf.eval()
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        raise ValueError(
            f"HF checkpoint {hf_dir}: transformers misses {sorted(info['missing_keys'])[:8]}, does not know "
            f"{sorted(info['unexpected_keys'])[:8]}, mis-shaped {sorted(info['mismatched_keys'])[:8]}"
        )

    tokens_BL = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    positions_BL = torch.arange(tokens_BL.shape[1]).expand_as(tokens_BL)
    titan_BLV = titan(tokens_BL, positions_BL, attention_masks(titan, positions_BL)).float()
    hf_BLV = hf(tokens_BL).logits.float()
    return float((titan_BLV - hf_BLV).abs().max()), float(hf_BLV.abs().max())


@functools.lru_cache(maxsize=8)
def verify_hf_checkpoint(model_cfg: ModelConfig) -> float:
    """Raise `ValueError` unless `model_cfg.hf_path` gives transformers' logits; returns max |Δlogit|.

    Checks `model_cfg.verify_layers` layers (0: no check, returns 0.0). Once per
    process and section (cached): the trainer and its frozen reference share it.
    """
    if not model_cfg.hf_path or model_cfg.verify_layers == 0:
        return 0.0
    diff, scale = probe_max_diff(model_cfg, model_cfg.verify_layers)
    if not diff <= TOL * max(1.0, scale):
        raise ValueError(
            f"model.hf_path {model_cfg.hf_path}: TorchTitan's logits differ from transformers' by {diff:.3g} "
            f"(tolerance {TOL * max(1.0, scale):.1g}) on its first {model_cfg.verify_layers} layers; a config.json "
            f"field is not reproduced (set model.verify_layers = 0 to load anyway)"
        )
    return diff
