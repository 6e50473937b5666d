"""TrainerActor on two local processes (FSDP2 over gloo) and the baseline weight sync to two generator procs.

`score` is checked against an independent HF transformers forward of the same
weights; weight sync by digest (trainer export == every generator) and by a
changed digest after a real optimizer step; checkpoints by restoring the
exact weights of an earlier step.
"""

from __future__ import annotations

import pytest
import torch

from configs.sections.checkpoint import CheckpointConfig
from configs.sections.model import ModelConfig
from configs.sections.optimizer import OptimizerConfig
from configs.sections.trainer import TrainerConfig

VOCAB = 2048


@pytest.fixture(scope="module")
def meshes(tiny_assets, generator_spec, tmp_path_factory):
    from monarch.actor import this_host
    from monarch.spmd import setup_torch_elastic_env

    from actors.generator import GeneratorActor
    from actors.trainer import TrainerActor
    from titan_ext.trainer import TrainerSpec

    out = tmp_path_factory.mktemp("trainer")
    spec = TrainerSpec(
        model=ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir)),
        trainer=TrainerConfig(steps=10, microbatches=1),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.0),
        checkpoint=CheckpointConfig(every_steps=1000, keep_last=3),
        checkpoint_dir=str(out / "ckpt"),
    )
    trainer_procs = this_host().spawn_procs(per_host={"gpus": 2})
    setup_torch_elastic_env(trainer_procs)
    trainer = trainer_procs.spawn("trainer", TrainerActor, spec)
    gen_procs = this_host().spawn_procs(per_host={"gpus": 2})
    gens = gen_procs.spawn("gens", GeneratorActor, generator_spec)
    setup = list(trainer.setup.call().get().values())
    yield trainer, gens, setup, out
    trainer_procs.stop().get()
    gen_procs.stop().get()


def score_batch(seed: int = 0, n: int = 3, s: int = 12):
    from actors.trainer import ScoreBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (n, s), generator=g)
    labels = torch.full((n, s), -100)
    labels[:, 4:-1] = tokens[:, 5:]
    return ScoreBatch(tokens, torch.arange(s).expand(n, s).clone(), labels)


def test_setup_is_fsdp_over_two_ranks(meshes):
    _, _, setup, _ = meshes
    assert sorted(s["rank"] for s in setup) == [0, 1] and {s["world"] for s in setup} == {2}
    assert {s["step"] for s in setup} == {0}


def test_score_matches_hf_forward(meshes, tiny_assets):
    from transformers import AutoModelForCausalLM

    trainer, _, _, _ = meshes
    batch = score_batch()
    results = list(trainer.score.call(batch).get().values())
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.dense_dir)).eval()
    with torch.no_grad():
        logp_NSV = model(batch.tokens_NS).logits.double().log_softmax(-1)
    valid = batch.labels_NS >= 0
    ref_lp = torch.where(valid, logp_NSV.gather(-1, batch.labels_NS.clamp(min=0)[..., None])[..., 0], 0.0)
    ref_h = torch.where(valid, -(logp_NSV.exp() * logp_NSV).sum(-1), 0.0)
    for r in results:  # both ranks agree with the reference
        assert torch.allclose(r.logprobs_NS.double(), ref_lp, atol=2e-4)
        assert torch.allclose(r.entropy_NS.double(), ref_h, atol=2e-4)
        assert torch.allclose(r.logprob_sums_N.double(), ref_lp.sum(-1), atol=1e-3)
        assert r.tokens_N.tolist() == valid.sum(-1).tolist() and r.version == 0


def policy_batch(trainer, seed: int):
    """A policy-channel batch whose generator logprobs are the trainer's own (on-policy)."""
    from titan_ext.batch import TrainBatch

    sb = score_batch(seed, n=4, s=16)
    scored = next(iter(trainer.score.call(sb).get().values()))
    mask = sb.labels_NS >= 0
    adv = torch.randn(4, 1, generator=torch.Generator().manual_seed(seed)).expand(4, 16).clone()
    return TrainBatch(
        tokens_BL=sb.tokens_NS, positions_BL=sb.positions_NS, labels_BL=sb.labels_NS, policy_mask_BL=mask,
        advantages_BL=adv, generator_logprobs_BL=scored.logprobs_NS, policy_tokens=int(mask.sum()),
    )


def test_train_step_weight_sync_and_checkpoint(meshes, tmp_path):
    from mesh.weight_sync_baseline import rank0, sync_weights

    trainer, gens, _, _ = meshes
    digest0 = rank0(trainer.weights_digest.call().get())
    gen0 = set(gens.weights_digest.call().get().values())
    assert gen0 == {digest0}  # both start from the same HF files

    metrics = list(trainer.train_step.call(policy_batch(trainer, 1)).get().values())
    untimed = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]
    assert untimed[0] == untimed[1]  # reduced over ranks
    assert metrics[0]["step"] == 1.0 and torch.isfinite(torch.tensor(metrics[0]["grad_norm"]))
    assert metrics[0]["grad_norm"] > 0
    assert set(trainer.policy_version.call().get().values()) == {1}

    report = sync_weights(trainer, gens, str(tmp_path / "shm"))
    digest1 = rank0(trainer.weights_digest.call().get())
    assert report.manifest.version == 1 and report.generators == 2
    assert report.manifest.digest == digest1 != digest0
    assert set(gens.weights_digest.call(list(report.manifest.names)).get().values()) == {digest1}
    assert set(gens.policy_version.call().get().values()) == {1}

    saved = set(trainer.save_checkpoint.call().get().values())
    assert len(saved) == 1 and saved.pop().endswith("step-00000001")
    trainer.train_step.call(policy_batch(trainer, 2)).get()
    digest2 = rank0(trainer.weights_digest.call().get())
    assert digest2 != digest1
    assert set(trainer.load_checkpoint.call(1).get().values()) == {1}
    assert rank0(trainer.weights_digest.call().get()) == digest1
