"""The tiny MoE with expert parallelism (EP = 2 over 2 gloo ranks) trains and exports.

Checks the placements TorchTitan's plan gives (routed experts on the separate
`[efsdp, ep]` mesh, everything else on the dense `fsdp` mesh), that forward,
backward and the sharded-Muon step run and change every parameter (experts
included), and that the exported HF weights give the trainer's logits in
transformers' Qwen3-MoE.
"""

from __future__ import annotations

import functools
import math

import pytest

from test_trainer_harness import _scratch, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 2


@functools.lru_cache(maxsize=None)
def _moe_run(hf_path: str) -> dict:
    args = {"flavour": "tiny_moe", "hf_path": hf_path, "parallelism": {"ep": 2}, "optimizer": "muon",
            "steps": STEPS, "bucket_mib": 0.25}
    return run_ranks("moe_ep", 2, _scratch("moe"), args, timeout=420)


@pytest.fixture(scope="module")
def moe(tiny_assets):
    return _moe_run(str(tiny_assets.moe_dir))


def test_experts_on_expert_mesh_dense_on_fsdp_mesh(moe):
    placements = moe["placements"]
    experts = {k: v for k, v in placements.items() if "routed_experts" in k}
    dense = {k: v for k, v in placements.items() if "routed_experts" not in k}
    assert len(experts) == 2 * 3  # two MoE layers x (w1, w2, w3)
    for name, p in experts.items():
        assert p["mesh"] == ["efsdp", "ep"], name
        assert p["placements"][-1] == "Shard(dim=0)", name  # experts split over ep ranks (dim 0 = expert)
    assert dense and all(p["mesh"] == ["fsdp"] for p in dense.values())
    assert any("router.gate" in k for k in dense)


def test_moe_ep_trains(moe):
    history = moe["history"]
    assert len(history) == STEPS
    for m in history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        for channel in ("policy", "distill", "preference"):
            assert m[f"{channel}/loss"] != 0.0
    # every parameter moved, the routed experts included
    assert set(moe["changed"]) == set(moe["all_params"])
    assert any("routed_experts" in k for k in moe["changed"])


def test_a_bad_share_on_one_rank_fails_every_rank(moe):
    assert moe["bad_error_rank0"] == "another rank's share of the batch is invalid (see that rank's error)"


def test_moe_export_matches_transformers(moe):
    export = moe["export"]
    assert export["missing"] == [] and export["unexpected"] == []
    assert any(".mlp.experts.3.down_proj.weight" in n for n in export["names"])  # per-expert HF names
    assert export["max_abs_diff"] < 1e-4 * max(1.0, export["logit_scale"])
    assert export["trained_vs_start"] > 1e-3  # the exported weights are the trained ones
