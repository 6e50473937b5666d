"""TrainerActor on two local processes (FSDP2 over gloo) and the endpoint weight sync (the test oracle)
to two generator procs.

`score` is checked against an independent HF transformers forward of the same
weights, and DPO's frozen reference (`score(reference=True)`) against the
initial weights after training; weight sync by digest (trainer export == every generator) and by a
changed digest after a real optimizer step; checkpoints by restoring the
exact weights of an earlier step.
"""

from __future__ import annotations

import os

import pytest
import torch

from composer_mesh.actors.rollout import EpisodeRequest

from test_actors_generator import SAMPLING, check_logprobs, hf_model

pytestmark = pytest.mark.slow

VOCAB = 2048


@pytest.fixture(scope="module")
def meshes(tiny_trainer_spec, generator_spec, tmp_path_factory):
    """Disaggregated placement: 2 FSDP trainer procs, 2 generator procs of their own."""
    from composer_mesh.configs.sections.mesh import MeshConfig
    from composer_mesh.mesh.placement import place

    out = tmp_path_factory.mktemp("trainer")
    spec = tiny_trainer_spec(out / "ckpt")
    placement = place(MeshConfig(placement="disaggregated", trainer_procs=2, generator_procs=2), spec, generator_spec)
    yield placement.trainer, placement.generators, placement.trainer_setup, out
    placement.stop()


@pytest.fixture(scope="module")
def oracle_meshes(tiny_trainer_spec, generator_spec, tmp_path_factory):
    """The same layout running the product actors plus the test oracle's endpoint sync
    (`tests/endpoint_sync.py`): 2 FSDP trainer procs, one single-process mesh per generator."""
    from monarch.actor import this_host
    from composer_mesh.actors.elastic import setup_elastic_env

    from endpoint_sync import EndpointGenerator, EndpointTrainer

    out = tmp_path_factory.mktemp("oracle")
    trainer_procs = this_host().spawn_procs(per_host={"gpus": 2})
    setup_elastic_env(trainer_procs)
    trainer = trainer_procs.spawn("trainer", EndpointTrainer, tiny_trainer_spec(out / "ckpt"))
    gen_procs = this_host().spawn_procs(per_host={"gpus": 2})
    gens = [gen_procs.slice(gpus=i).spawn("generator", EndpointGenerator, generator_spec) for i in range(2)]
    trainer.setup.call().get()
    yield trainer, gens
    trainer_procs.stop().get()
    gen_procs.stop().get()


def score_batch(seed: int = 0, n: int = 3, s: int = 12):
    from composer_mesh.actors.trainer import ScoreBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (n, s), generator=g)
    labels = torch.full((n, s), -100)
    labels[:, 4:-1] = tokens[:, 5:]
    return ScoreBatch(tokens, torch.arange(s).expand(n, s).clone(), labels)


def test_placement_fsdp_over_two_ranks_and_separate_generators(meshes):
    _, gens, setup, _ = meshes
    assert sorted(s["rank"] for s in setup) == [0, 1] and {s["world"] for s in setup} == {2}
    assert {s["step"] for s in setup} == {0}
    gen_info = [g.info.call_one().get() for g in gens]
    # one single-process actor mesh per generator (mesh.placement)
    assert [i["rank"] for i in gen_info] == [0, 0]
    pids = {s["pid"] for s in setup} | {i["pid"] for i in gen_info}
    assert len(pids) == 4  # disaggregated: four processes


def hf_scores(model_dir, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprob of the label and entropy `[N, S]` from an independent HF forward of `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        logp_NSV = model(batch.tokens_NS).logits.double().log_softmax(-1)
    valid = batch.labels_NS >= 0
    ref_lp = torch.where(valid, logp_NSV.gather(-1, batch.labels_NS.clamp(min=0)[..., None])[..., 0], 0.0)
    ref_h = torch.where(valid, -(logp_NSV.exp() * logp_NSV).sum(-1), 0.0)
    return ref_lp, ref_h


def test_score_matches_hf_forward(meshes, tiny_assets):
    trainer, _, _, _ = meshes
    batch = score_batch()
    results = list(trainer.score.call(batch).get().values())
    ref_lp, ref_h = hf_scores(tiny_assets.dense_dir, batch)
    valid = batch.labels_NS >= 0
    # both ranks agree with the reference
    for r in results:
        assert torch.allclose(r.logprobs_NS.double(), ref_lp, atol=2e-4)
        assert torch.allclose(r.entropy_NS.double(), ref_h, atol=2e-4)
        assert torch.allclose(r.logprob_sums_N.double(), ref_lp.sum(-1), atol=1e-3)
        assert r.tokens_N.tolist() == valid.sum(-1).tolist() and r.version == 0


def policy_batch(trainer, seed: int):
    """A policy-channel batch whose generator logprobs are the trainer's own (on-policy)."""
    from composer_mesh.titan_ext.batch import TrainBatch

    sb = score_batch(seed, n=4, s=16)
    scored = next(iter(trainer.score.call(sb).get().values()))
    mask = sb.labels_NS >= 0
    adv = torch.randn(4, 1, generator=torch.Generator().manual_seed(seed)).expand(4, 16).clone()
    return TrainBatch(
        tokens_BL=sb.tokens_NS, positions_BL=sb.positions_NS, labels_BL=sb.labels_NS, policy_mask_BL=mask,
        advantages_BL=adv, generator_logprobs_BL=scored.logprobs_NS, policy_tokens=int(mask.sum()),
    )


def test_train_step_weight_sync_and_checkpoint(oracle_meshes, tmp_path):
    from composer_mesh.actors.mesh_utils import rank0
    from endpoint_sync import sync_weights

    trainer, gens = oracle_meshes
    digest0 = rank0(trainer.weights_digest.call().get())
    # both start from the same HF files
    assert {g.weights_digest.call_one().get() for g in gens} == {digest0}

    metrics = list(trainer.train_step.call(policy_batch(trainer, 1)).get().values())
    untimed = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]
    assert untimed[0] == untimed[1]  # reduced over ranks
    assert metrics[0]["step"] == 1.0 and torch.isfinite(torch.tensor(metrics[0]["grad_norm"]))
    assert metrics[0]["grad_norm"] > 0
    assert set(trainer.policy_version.call().get().values()) == {1}

    reports = [sync_weights(trainer, g, str(tmp_path / "shm")) for g in gens]
    digest1 = rank0(trainer.weights_digest.call().get())
    assert {r.manifest.version for r in reports} == {1} and sum(r.generators for r in reports) == 2
    assert {r.manifest.digest for r in reports} == {digest1} != {digest0}
    assert {g.weights_digest.call_one(list(reports[0].manifest.names)).get() for g in gens} == {digest1}
    assert {g.policy_version.call_one().get() for g in gens} == {1}

    saved = set(trainer.save_checkpoint.call().get().values())
    assert len(saved) == 1 and saved.pop().endswith("step-00000001")
    trainer.train_step.call(policy_batch(trainer, 2)).get()
    digest2 = rank0(trainer.weights_digest.call().get())
    assert digest2 != digest1
    assert set(trainer.load_checkpoint.call(1).get().values()) == {1}
    assert rank0(trainer.weights_digest.call().get()) == digest1


def test_dpo_reference_stays_the_initial_weights(meshes, tiny_assets):
    """`score(reference=True)` is the frozen initial model (FSDP-sharded on both ranks) after optimizer
    steps and a checkpoint load, while `score()` follows the trained policy."""
    trainer, _, _, _ = meshes
    trainer.train_step.call(policy_batch(trainer, 3)).get()
    batch = score_batch(seed=5)
    init_lp, _ = hf_scores(tiny_assets.dense_dir, batch)
    saved = int(next(iter(trainer.save_checkpoint.call().get().values())).rsplit("-", 1)[1])
    trainer.load_checkpoint.call(saved).get()
    for ref, cur in zip(trainer.score.call(batch, reference=True).get().values(),
                        trainer.score.call(batch).get().values()):
        assert torch.allclose(ref.logprobs_NS.double(), init_lp, atol=2e-4)
        assert ref.version == cur.version >= 1
        # the policy moved, π_ref did not
        assert (cur.logprobs_NS - ref.logprobs_NS).abs().max() > 1e-2


def test_two_generator_procs_update_weights_in_place(oracle_meshes, tiny_assets, tmp_path):
    from monarch.actor import ActorError

    from composer_mesh.actors.weight_sync.digest import weights_digest
    from endpoint_sync import publish_buckets

    _, gens = oracle_meshes
    before = {g.weights_digest.call_one().get() for g in gens}
    assert len(before) == 1

    model = hf_model(tiny_assets.dense_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    state = model.state_dict()
    names = sorted(state)
    named = [(n, state[n]) for n in names if n != "lm_head.weight"]  # tied to the embedding
    manifest = publish_buckets([named[: len(named) // 2], named[len(named) // 2 :]], tmp_path / "w", version=3)
    assert manifest.digest == weights_digest(named)

    # a manifest that misses a parameter is refused before anything is copied
    partial = publish_buckets([named[1:]], tmp_path / "bad", version=4)
    with pytest.raises(ActorError, match="not covered"):
        gens[0].update_weights.call_one(partial).get()
    assert {g.weights_digest.call_one().get() for g in gens} == before

    results = [g.update_weights.call_one(manifest).get() for g in gens]
    assert {r["digest"] for r in results} == {manifest.digest}
    assert {g.policy_version.call_one().get() for g in gens} == {3}
    assert {g.weights_digest.call_one(list(manifest.names)).get() for g in gens} == {manifest.digest}

    # the live engine samples from the new weights: logprobs match a forward of the perturbed model
    requests = [EpisodeRequest(group_id=1, seed=4)]
    for gen in gens:
        groups = gen.generate.call_one(requests, SAMPLING).get()
        assert all(r.policy_version == 3 for r in groups[0].rollouts)
        assert check_logprobs(model, groups[0].rollouts, SAMPLING) > 10
    assert os.path.isdir(tmp_path / "w" / "v3")
