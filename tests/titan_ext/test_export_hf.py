"""HF round trip from a sharded trainer: FSDP2 on 2 gloo ranks, after 6 training steps.

The buckets streamed by `Trainer.export_weights` (64 KiB-class buckets, each rank
gathering one bucket at a time) are written as safetensors with the trainer's
HF config and loaded by transformers, which must give the trainer's logits.
"""

from __future__ import annotations

import pytest

from test_trainer_harness import EXPORT_BUCKET_MIB, two_rank_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_exported_weights_give_the_trainer_logits(tiny_assets):
    export = two_rank_run(str(tiny_assets.dense_dir))[0]["export"]
    assert export["missing"] == [] and export["unexpected"] == []
    assert export["max_abs_diff"] < 1e-4 * max(1.0, export["logit_scale"])
    assert export["trained_vs_start"] > 1e-2  # the trained weights, not the starting checkpoint


def test_export_is_streamed_in_buckets(tiny_assets):
    export = two_rank_run(str(tiny_assets.dense_dir))[0]["export"]
    limit = int(EXPORT_BUCKET_MIB * 2**20)
    embedding = 2048 * 128 * 4  # the one tensor larger than a bucket travels alone
    assert export["buckets"] >= 5
    assert max(export["bucket_bytes"]) <= max(limit, embedding)
    assert sorted(export["bucket_bytes"])[-2] <= limit
    assert "model.layers.1.self_attn.q_proj.weight" in export["names"]  # split from the fused QKV
