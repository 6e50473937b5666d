"""`load_hf_into_titan` on sharded models, parallelized the way the trainer does it.

The case that once failed: the tiny dense flavour (fused `wqkv`, whose state-dict
hooks split / merge wq / wk / wv) under FSDP on 2 gloo ranks ("aten.copy_ got
mixed torch.Tensor and DTensor"). Also HSDP 2x1 with activation checkpointing,
bf16 FSDP compute, and the tiny MoE with expert parallelism. The checkpoints are
the tiny assets with every tensor perturbed, so each one differs from the seeded
init and a weight that is not loaded shows; the read-back (gathered, converted
back to HF names) must equal the checkpoint bitwise. A wrong-flavour checkpoint
raises on every rank and changes nothing. HSDP 2x2 on 4 ranks loads through the
same function in the trainer trajectory tests.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_trainer_harness import _scratch, run_ranks

pytestmark = pytest.mark.slow

CONFIGS = {
    "tiny_fsdp": {"flavour": "tiny", "parallelism": {}},
    "tiny_hsdp21_ac": {"flavour": "tiny", "parallelism": {"dp_replicate": 2, "dp_shard": 1,
                                                          "activation_checkpoint": "full"}},
    "tiny_bf16_sac": {"flavour": "tiny", "parallelism": {"param_dtype": "bfloat16",
                                                         "activation_checkpoint": "selective"}},
    "tiny_moe_fsdp": {"flavour": "tiny_moe", "parallelism": {}},
    "tiny_moe_ep": {"flavour": "tiny_moe", "parallelism": {"ep": 2}},
}
MESHES = {
    "tiny_fsdp": ["fsdp"],
    "tiny_hsdp21_ac": ["dp_replicate/fsdp"],
    "tiny_bf16_sac": ["fsdp"],
    "tiny_moe_fsdp": ["fsdp"],
    "tiny_moe_ep": ["efsdp/ep", "fsdp"],
}


def _perturbed_copy(src, dst, seed: int) -> str:
    """The HF directory `src` with every tensor shifted by seeded noise."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(dst / "model.safetensors")
    noisy = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in sorted(tensors.items())}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def loaded(tiny_assets):
    scratch = _scratch("hf_load")
    hf_dirs = {
        "tiny": _perturbed_copy(tiny_assets.dense_dir, scratch / "hf_tiny", seed=11),
        "tiny_moe": _perturbed_copy(tiny_assets.moe_dir, scratch / "hf_tiny_moe", seed=12),
    }
    return run_ranks("hf_load", 2, scratch / "run", {"configs": CONFIGS, "hf_dirs": hf_dirs}, timeout=420)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sharded_load_equals_checkpoint(loaded, name):
    r = loaded[name]
    assert r["meshes"] == MESHES[name]  # really sharded, on the meshes the trainer uses
    assert r["differed_before"] == r["keys"]  # every tensor had to be loaded
    assert any(".self_attn.q_proj." in k for k in r["keys"])  # the fused-QKV path is exercised
    assert r["names_match"] and r["mismatched"] == []


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_wrong_flavour_raises_and_changes_nothing(loaded, name):
    r = loaded[name]
    assert r["wrong_error"] and ("does not match" in r["wrong_error"] or "cannot be converted" in r["wrong_error"])
    assert r["untouched_by_wrong"]
