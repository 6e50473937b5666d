"""`iter_hf_buckets` on a plain tiny model: the same HF state dict as a one-shot conversion, in buckets."""

from __future__ import annotations

import pytest
import torch
from torchtitan.distributed.activation_checkpoint import FullAC

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.build import build_model
from composer_mesh.titan_ext.hf.adapters import iter_hf_buckets, titan_to_hf_state_dict


@pytest.mark.parametrize("flavour", ["tiny", "tiny_moe"])
def test_buckets_equal_full_conversion(flavour):
    model = build_model(ModelConfig(flavour=flavour, device="cpu"))
    expected = titan_to_hf_state_dict(model)
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    bucket_bytes = 64 * 1024
    FullAC.Config().build(dump_folder="").apply(model)  # wrapper names must not leak into the export
    buckets = list(iter_hf_buckets(model, bucket_bytes))
    names = [name for bucket in buckets for name, _ in bucket]
    assert len(names) == len(set(names))  # nothing twice (tied embedding / head)
    assert sorted(names) == sorted(expected)
    got = dict(kv for bucket in buckets for kv in bucket)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert len(buckets) > 5
    assert max(sum(t.numel() * t.element_size() for _, t in b) for b in buckets) <= max(bucket_bytes, largest)


def test_dtype_cast_and_bad_bucket_size():
    model = build_model(ModelConfig(flavour="tiny", device="cpu"))
    buckets = list(iter_hf_buckets(model, 1 << 20, dtype=torch.bfloat16))
    assert {t.dtype for b in buckets for _, t in b} == {torch.bfloat16}
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        next(iter_hf_buckets(model, 0))
