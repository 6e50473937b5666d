"""DiLoCo on Monarch: a manager actor (torchft lighthouse) and 2 trainer replica groups (own proc meshes).

2 groups × H = 2 inner `train_step`s × R = 2 outer rounds on the tiny model,
each group fed different batches: after every outer sync both groups hold the
same parameters (digest per rank), the parameters changed, and between syncs
(local steps) they differ. The manager's status counts the syncs and bytes.
"""

from __future__ import annotations

import time

import pytest
import torch

from composer_mesh.configs.sections.diloco import DiLoCoConfig
from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.configs.sections.optimizer import OptimizerConfig
from composer_mesh.configs.sections.trainer import TrainerConfig

pytestmark = pytest.mark.slow

H, ROUNDS, VOCAB, L = 2, 2, 2048, 16


def policy_batch(seed: int, rows: int = 2):
    """A policy-channel-only batch: random rows, the second half are generated tokens."""
    from composer_mesh.titan_ext.batch import IGNORE_INDEX, TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (rows, L), generator=g)
    labels = torch.full((rows, L), IGNORE_INDEX)
    labels[:, L // 2 - 1 : -1] = tokens[:, L // 2 :]
    mask = labels != IGNORE_INDEX
    return TrainBatch(
        tokens_BL=tokens, positions_BL=torch.arange(L).expand(rows, L).clone(), labels_BL=labels,
        policy_mask_BL=mask, advantages_BL=torch.randn(rows, 1, generator=g).expand(rows, L).clone(),
        generator_logprobs_BL=torch.where(mask, -7.6, 0.0), policy_tokens=int(mask.sum()),
    )


@pytest.fixture(scope="module")
def replicas(tiny_assets):
    from monarch.actor import this_host, this_proc
    from composer_mesh.actors.elastic import setup_elastic_env

    from composer_mesh.actors.diloco import DiLoCoManagerActor, DiLoCoTrainerActor
    from composer_mesh.titan_ext.spec import TrainerSpec

    cfg = DiLoCoConfig(enabled=True, replica_groups=2, min_replicas=2, inner_steps=H, timeout_s=60, quorum_timeout_s=120)
    spec = TrainerSpec(
        model=ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir)),
        trainer=TrainerConfig(steps=100, microbatches=1),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.0),
    )
    manager = this_proc().spawn("diloco_manager", DiLoCoManagerActor, cfg)
    meshes, groups = [], []
    for i in range(2):
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        setup_elastic_env(procs)
        meshes.append(procs)
        groups.append(procs.spawn(f"trainer_{i}", DiLoCoTrainerActor, spec, cfg))
    for g in groups:
        g.setup.call().get()
    start = list(groups[0].local_digest.call().get().values())
    for i, g in enumerate(groups):
        g.join.call(manager.assign.call_one(i).get(), start).get()
    yield manager, groups
    manager.shutdown.call_one().get()
    for procs in meshes:
        procs.stop().get()


def digests(groups) -> list[list[str]]:
    return [sorted(g.local_digest.call().get().values()) for g in groups]


def test_two_groups_identical_after_every_outer_sync(replicas):
    manager, groups = replicas
    before = digests(groups)[0]
    history = []
    for r in range(ROUNDS):
        for h in range(H):
            futures = [g.train_step.call(policy_batch(seed=100 * r + 10 * h + i)) for i, g in enumerate(groups)]
            metrics = [list(f.get().values())[0] for f in futures]
            assert all(m["step"] == r * H + h + 1 for m in metrics)
            d = digests(groups)
            if h < H - 1:
                assert d[0] != d[1], "local steps on different data must diverge between syncs"
        d = digests(groups)
        assert d[0] == d[1], f"round {r}: replica groups differ after the outer sync"
        assert d[0] != before
        history.append(d[0])
        before = d[0]
        for i, g in enumerate(groups):
            manager.report.call_one(i, list(g.diloco_status.call().get().values())[0]).get()
    assert len(set(map(tuple, history))) == ROUNDS
    status = manager.status.call_one().get()
    assert status["outer_step"] == ROUNDS and status["quorum_size"] == 2
    for rep in status["replicas"].values():
        assert rep["commits"] == ROUNDS and rep["failed_syncs"] == 0
        # one fp32 pseudo-gradient of every parameter per sync, counted at the process group
        assert rep["sync_bytes"] == [rep["sync_bytes"][0]] * ROUNDS
    params = sum(p.numel() for p in torch.nn.Module.parameters(_tiny_model()))
    assert status["replicas"][0]["sync_bytes"][0] == 4 * params


def test_shutting_the_lighthouse_fails_a_waiting_sync_within_seconds(replicas):
    """Runs last (it ends the groups' DiLoCo). Group 0 takes a round's steps alone, so its sync waits for
    group 1, which never comes (quorum_timeout_s = 120 here, 600 by default). Shutting the lighthouse down,
    what `mesh.replicas.run_groups` does when a group fails, fails that train_step inside the real trainer
    process within heartbeat_timeout_ms (3 s) plus a probe."""
    manager, groups = replicas
    for h in range(H - 1):
        groups[0].train_step.call(policy_batch(seed=900 + h)).get()
    # the round's last step: the sync
    waiting = groups[0].train_step.call(policy_batch(seed=999))
    time.sleep(3)
    start = time.monotonic()
    manager.shutdown.call_one().get()
    with pytest.raises(Exception, match="lighthouse") as info:
        waiting.get()
    seconds = time.monotonic() - start
    assert seconds < 15, f"the waiting sync failed {seconds:.1f} s after the lighthouse stopped: {info.value}"
    print(f"\ngroup 0's waiting sync failed {seconds:.2f} s after the lighthouse was shut down")


def _tiny_model():
    from composer_mesh.titan_ext.build import build_model

    return build_model(ModelConfig(flavour="tiny", device="cpu", seed=0), device="cpu")
