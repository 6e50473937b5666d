"""The frozen DPO reference kept in the serving dtype (`trainer.dpo_reference_dtype`), on 1 and 2 gloo ranks.

Built from the policy's own loaded weights (no second checkpoint read): each
bf16 parameter must equal the initial fp32 policy parameter cast with
`Tensor.to` (round to nearest even, what the weight export sends the
generators), gathered across FSDP shards; the copy holds half the policy's
bytes on every rank, never receives gradients, and its logprobs stay put
while the policy trains. Its logprobs at init are those of the same weights
in bf16: close to the fp32 policy's, not equal. The fp32 reference (the
option's other value, and every recipe serving in fp32) stays bitwise the policy.
Kept in a file of the run folder read through mmap (`trainer.dpo_reference_storage
= "file"`), every parameter maps that file and the reference scores bitwise as
the in-memory one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_trainer_harness import _scratch, run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tiny_assets):
    args = {"hf_path": str(tiny_assets.dense_dir), "optimizer": "adamw"}
    return {
        ("bfloat16", 1): run_ranks("reference", 1, _scratch("ref_bf16_1"), {**args, "reference_dtype": "bfloat16"}),
        ("bfloat16", 2): run_ranks("reference", 2, _scratch("ref_bf16_2"), {**args, "reference_dtype": "bfloat16"}),
        ("float32", 1): run_ranks("reference", 1, _scratch("ref_fp32_1"), {**args, "reference_dtype": "float32"}),
        ("bfloat16", "file"): run_ranks("reference", 1, _scratch("ref_bf16_file"),
                                        {**args, "reference_dtype": "bfloat16", "reference_storage": "file"}),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_reference_is_the_initial_policy_cast_and_stays_frozen(runs, world):
    r = runs[("bfloat16", world)]
    assert r["dtypes"] == ["torch.bfloat16"] and not r["requires_grad"]
    assert r["params_are_cast_policy"] and r["buffers_equal"]
    # this rank's shard of the copy: 2 bytes per parameter against the policy's 4
    assert 2 * r["bytes"]["reference"] == r["bytes"]["policy"]
    # bf16 weights and compute: log π_ref moves, by far less than a nat (tiny model, 23 tokens per row)
    assert 0 < r["lp_diff_max"] < 0.05
    assert r["reference_unchanged"] and r["lp_reference_after_equal"] and r["policy_moved"]
    # freed after the optimizer step: the weight sync and checkpoints run without them
    assert r["grads_after_step"] == 0


def test_sharded_bf16_reference_scores_like_the_unsharded_one(runs):
    one, two = (torch.tensor(runs[("bfloat16", w)]["lp_reference"]) for w in (1, 2))
    torch.testing.assert_close(two, one, atol=1e-2, rtol=0)


def test_fp32_reference_is_the_policy_bitwise(runs):
    r = runs[("float32", 1)]
    assert r["dtypes"] == ["torch.float32"] and r["params_are_cast_policy"] and r["buffers_equal"]
    assert r["bytes"]["reference"] == r["bytes"]["policy"]
    assert r["lp_diff_max"] == 0.0
    assert r["reference_unchanged"] and r["policy_moved"] and r["grads_after_step"] == 0


def test_file_backed_reference_maps_the_run_folder_and_scores_bitwise_as_in_memory(runs):
    memory, mapped = runs[("bfloat16", 1)], runs[("bfloat16", "file")]
    assert memory["storage_files"] == [""]
    # one file, in the run folder the trainer was given
    [path] = map(Path, mapped["storage_files"])
    assert path.name == "dpo_reference.rank0.safetensors" and path.parent.name.startswith("trainer_ref_bf16_file_")
    assert mapped["dtypes"] == ["torch.bfloat16"] and not mapped["requires_grad"]
    assert mapped["params_are_cast_policy"] and mapped["buffers_equal"]
    assert mapped["lp_reference"] == memory["lp_reference"]
    assert mapped["reference_unchanged"] and mapped["lp_reference_after_equal"] and mapped["policy_moved"]
