"""`TrainBatch`: validation that names the field, exact splitting, pickling."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from test_trainer_harness import global_batch
from composer_mesh.titan_ext.batch import IGNORE_INDEX, TrainBatch


def _fields(batch: TrainBatch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: f.update(labels_BL=f["labels_BL"][:, :-1]), "labels_BL must have shape"),
        (lambda f: f.update(policy_mask_BL=f["policy_mask_BL"].long()), "policy_mask_BL must be a bool"),
        (lambda f: f.update(advantages_BL=f["advantages_BL"].long()), "advantages_BL must be a float"),
        (lambda f: f.update(hint_tokens_BH=None), "hint distillation needs all of"),
        (lambda f: f.update(hint_index_BL=torch.full_like(f["hint_index_BL"], 10_000)), "hint_index_BL must lie in"),
        (lambda f: f.update(distill_mask_BL=torch.ones_like(f["distill_mask_BL"])), "whose hint_index_BL is -1"),
        (lambda f: f.update(rejected_labels_PS=None), "preference pairs need all of"),
        (lambda f: f.update(ref_chosen_logprobs_P=None), "come together"),
        (lambda f: f.update(ref_rejected_logprobs_P=f["ref_rejected_logprobs_P"][:1]), "ref_rejected_logprobs_P must have shape"),
        (lambda f: f.update(pairs=-1), "pairs must be >= 0"),
    ],
)
def test_bad_batches_name_the_field(change, message):
    fields = _fields(global_batch(0))
    change(fields)
    with pytest.raises(ValueError, match=message):
        TrainBatch(**fields)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_microbatches_cover_every_row_once_and_keep_global_counts(n):
    batch = global_batch(1, rows=4, pairs=3)
    parts = batch.microbatches(n)
    assert len(parts) == n
    assert len({p.rows for p in parts}) == 1 and len({p.num_pairs for p in parts}) == 1  # equal work per part
    for p in parts:
        assert (p.policy_tokens, p.distill_tokens, p.pairs) == (batch.policy_tokens, batch.distill_tokens, batch.pairs)
    for name in ("tokens_BL", "labels_BL", "policy_mask_BL", "hint_index_BL", "chosen_labels_PS", "ref_chosen_logprobs_P"):
        joined = torch.cat([getattr(p, name) for p in parts])
        original = getattr(batch, name)
        assert torch.equal(joined[: original.shape[0]], original), name
    # padding rows carry no loss: no masked token, no label, no teacher position
    padded = torch.cat([p.labels_BL for p in parts])[batch.rows :]
    assert (padded == IGNORE_INDEX).all()
    assert not torch.cat([p.policy_mask_BL for p in parts])[batch.rows :].any()
    assert (torch.cat([p.hint_index_BL for p in parts])[batch.rows :] == -1).all()
    assert sum(int(p.policy_mask_BL.sum()) for p in parts) == batch.policy_tokens


def test_batch_pickles_and_optional_channels():
    batch = global_batch(2)
    again = pickle.loads(pickle.dumps(batch))
    for name, value in _fields(batch).items():
        assert torch.equal(value, getattr(again, name)) if torch.is_tensor(value) else value == getattr(again, name)
    policy_only = {k: v for k, v in _fields(batch).items() if k.endswith("_BL") and not k.startswith(("distill", "hint"))}
    slim = TrainBatch(**policy_only, policy_tokens=batch.policy_tokens)
    assert not slim.has_distill and not slim.has_pairs and slim.num_pairs == 0
    assert slim.shard(1, 2).rows == batch.rows // 2
    with pytest.raises(ValueError, match="shard index 2"):
        slim.shard(2, 2)
