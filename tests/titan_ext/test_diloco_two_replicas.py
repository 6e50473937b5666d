"""Two real replicas through torchft's DiLoCo: the first outer steps average BOTH pseudo-gradients.

Two replica threads, each with its own TCPStore, torchft Manager and
reconfigurable gloo group, under a real in-process lighthouse (quorum of 2).
Inner optimizer SGD(lr=1) fed hand-built per-replica gradients, so replica r
ends round k at θ_k − ΣΔ_{r,k} and its pseudo-gradient is ΣΔ_{r,k}; the outer
Nesterov SGD must step on the average of the two (torch's Nesterov:
b_k = μ b_{k−1} + g_k, θ_{k+1} = θ_k − lr (g_k + μ b_k)). A replica that
"heals" from replica 0 at the first quorum (torchft's init_sync) would
replace its own round with replica 0's, so the first step would use
replica 0's pseudo-gradient alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch import nn

from composer_mesh.configs.sections.diloco import DiLoCoConfig
from composer_mesh.titan_ext.diloco import DiLoCoReplica, ReplicaAssignment, parameters_digest

LR, MU = 0.7, 0.9


class _TwoBlocks(nn.Module):
    """Parameters in `blocks` (one `[1, dim]` weight per block): `fragments = n` splits them one block each."""

    def __init__(self, theta0: torch.Tensor, blocks: int) -> None:
        super().__init__()
        parts = theta0.chunk(blocks)
        self.blocks = nn.ModuleList(nn.Linear(p.numel(), 1, bias=False) for p in parts)
        with torch.no_grad():
            for block, part in zip(self.blocks, parts):
                block.weight.copy_(part.view(1, -1))

    def flat(self) -> torch.Tensor:
        return torch.cat([b.weight.detach().view(-1) for b in self.blocks])

    def set_grad(self, delta: torch.Tensor) -> None:
        for block, part in zip(self.blocks, delta.chunk(len(self.blocks))):
            block.weight.grad = part.view(1, -1).clone()


def _run(theta0: torch.Tensor, deltas: list[list[torch.Tensor]], cfg: DiLoCoConfig, *, inner_momentum: float = 0.0,
         snapshot_after: int = 0, resume: list[dict] | None = None):
    """Replica r takes inner step s with gradient deltas[r][s]; returns (θ after each step per replica,
    statuses, digests, snapshots). Inner optimizer SGD(lr=1, `inner_momentum`).

    `snapshot_after = k`: also return each replica's checkpoint (model, inner optimizer, DiLoCo state)
    taken after its k-th step of this call. `resume`: such checkpoints, loaded before the first step.
    """
    from torch.distributed import TCPStore
    from composer_mesh.titan_ext.torchft_compat import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=5000)
    stores, models, optimizers, replicas = [], [], [], []
    snapshots: list[dict] = [{}, {}]
    try:
        for r in range(2):
            stores.append(TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30)))
            models.append(_TwoBlocks(theta0, cfg.fragments))
            optimizers.append(torch.optim.SGD(models[-1].parameters(), lr=1.0, momentum=inner_momentum))
            if resume is not None:
                models[-1].load_state_dict(resume[r]["model"])
                optimizers[-1].load_state_dict(resume[r]["optimizer"])
            replicas.append(DiLoCoReplica(cfg, models[-1], optimizers[-1],
                                          ReplicaAssignment(f"replica_{r}", r, lighthouse.address()),
                                          store_addr="127.0.0.1", store_port=stores[-1].port,
                                          start_digest=None if resume else parameters_digest(models[0])))
            if resume is not None:
                replicas[-1].load_state_dict(resume[r]["diloco"])

        def body(r: int) -> list[torch.Tensor]:
            after = []
            for s, delta in enumerate(deltas[r], 1):
                models[r].set_grad(delta)
                optimizers[r].step()  # every H / fragments steps DiLoCo's hook syncs a fragment
                after.append(models[r].flat().clone())
                if s == snapshot_after:  # what the trainer's checkpoint holds (torch.save round trip)
                    snapshots[r] = _round_trip({"model": models[r].state_dict(), "diloco": replicas[r].state_dict(),
                                                "optimizer": optimizers[r].state_dict()})
            return after

        with ThreadPoolExecutor(2) as pool:
            thetas = list(pool.map(body, range(2)))
        statuses = [rep.status() for rep in replicas]
        digests = [parameters_digest(m) for m in models]
    finally:
        for rep in replicas:
            rep.close()
        lighthouse.shutdown()
    return thetas, statuses, digests, snapshots


def _round_trip(obj: dict) -> dict:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_smallest_case_first_outer_step_averages_both_replicas():
    """θ0 = 0, replicas end the round at −1 and −3: pseudo-gradient 2, θ1 = −0.7·(2 + 0.9·2) = −2.66."""
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=LR, outer_momentum=MU, nesterov=True, replica_groups=2,
                       min_replicas=2, timeout_s=30, quorum_timeout_s=60)
    thetas, statuses, _, _ = _run(torch.zeros(1), [[torch.ones(1)], [torch.full((1,), 3.0)]], cfg)
    got = [float(t[0][0]) for t in thetas]
    assert got == pytest.approx([-2.66, -2.66], abs=1e-6), f"θ1 per replica {got} (replica 0's work alone: −1.33)"
    assert [s["healed"] for s in statuses] == [0, 0]


def _expected(theta0: torch.Tensor, deltas: list[list[torch.Tensor]], H: int, fragments: int) -> list[list[torch.Tensor]]:
    """[step][replica] θ after every inner step, from the DiLoCo / Streaming DiLoCo definition, in float64.

    Fragment f owns the f-th chunk of θ; syncs come every H / F inner steps, the
    j-th sync (j = 0, 1, ...) is fragment j mod F. Between its syncs a fragment's
    local weights move by −Δ per step; at its sync the pseudo-gradient is
    θ_global − θ_local averaged over replicas, the outer Nesterov step updates
    θ_global and both replicas restart from it. All replicas hold the same θ at
    a sync, so one trajectory per replica suffices.
    """
    per_sync = H // fragments
    chunk = lambda t, f: t.double().chunk(fragments)[f]  # noqa: E731
    glob = [chunk(theta0, f).clone() for f in range(fragments)]
    mom = [torch.zeros_like(g) for g in glob]
    local = [[g.clone() for g in glob] for _ in range(2)]
    out = []
    for s in range(len(deltas[0])):
        for r in range(2):
            for f in range(fragments):
                local[r][f] -= chunk(deltas[r][s], f)
        if (s + 1) % per_sync == 0:
            f = ((s + 1) // per_sync - 1) % fragments
            g = sum(glob[f] - local[r][f] for r in range(2)) / 2
            mom[f] = MU * mom[f] + g
            glob[f] = glob[f] - LR * (g + MU * mom[f])
            for r in range(2):
                local[r][f] = glob[f].clone()
        out.append([torch.cat(local[r]) for r in range(2)])
    return out


@pytest.mark.parametrize("fragments", [1, 2])
def test_first_three_outer_steps_match_the_hand_formula(fragments):
    """Random per-replica inner gradients, H = 2 per fragment, three outer rounds: θ after every inner step
    (local drift and each outer step) equals the definition above to 1e-6.

    fragments = 2: Streaming DiLoCo on a two-block model (each sync moves one
    block, alternating; fragment_delay 0).
    """
    H, ROUNDS, DIM = 2 * fragments, 3, 6
    g = torch.Generator().manual_seed(1234)
    theta0 = torch.randn(DIM, generator=g)
    deltas = [[torch.randn(DIM, generator=g) for _ in range(H * ROUNDS)] for _ in range(2)]
    cfg = DiLoCoConfig(inner_steps=H, outer_lr=LR, outer_momentum=MU, nesterov=True, replica_groups=2,
                       min_replicas=2, fragments=fragments, timeout_s=30, quorum_timeout_s=60)
    thetas, statuses, digests, _ = _run(theta0, deltas, cfg)
    expected = _expected(theta0, deltas, H, fragments)
    for s in range(H * ROUNDS):
        for r in range(2):
            err = (thetas[r][s].double() - expected[s][r]).abs().max().item()
            assert err <= 1e-6, f"replica {r} after inner step {s + 1} (H = {H}): max |θ − hand formula| = {err:.3g}"
    if fragments == 1:  # with 2 fragments the last-synced one is shared, the other has drifted since its sync
        assert digests[0] == digests[1]
    assert all(s["commits"] == ROUNDS * fragments and s["failed_syncs"] == 0 and s["healed"] == 0 for s in statuses)


def test_different_start_weights_are_refused_at_join():
    cfg = DiLoCoConfig(inner_steps=1, replica_groups=2, min_replicas=2)
    model = _TwoBlocks(torch.zeros(2), 1)
    with pytest.raises(ValueError, match="replica_1 rank 0 starts from different weights than replica 0"):
        DiLoCoReplica(cfg, model, torch.optim.SGD(model.parameters(), lr=1.0),
                      ReplicaAssignment("replica_1", 1, "http://127.0.0.1:1"), store_addr="127.0.0.1", store_port=1,
                      start_digest=parameters_digest(_TwoBlocks(torch.ones(2), 1)))


@pytest.mark.parametrize("fragments", [1, 2])
def test_checkpoint_mid_round_resumes_bitwise(fragments):
    """Checkpoint both replicas one inner step into round 3 (model, inner SGD momentum, DiLoCo state:
    manager step, step into the round, global weights, outer momentum); fresh replicas that load it and
    take the remaining steps end bit for bit where the uninterrupted run ends."""
    H, DIM = 2 * fragments, 6
    steps, cut = 4 * H, 2 * H + 1
    g = torch.Generator().manual_seed(99)
    theta0 = torch.randn(DIM, generator=g)
    deltas = [[torch.randn(DIM, generator=g) for _ in range(steps)] for _ in range(2)]
    cfg = DiLoCoConfig(inner_steps=H, outer_lr=LR, outer_momentum=MU, nesterov=True, replica_groups=2,
                       min_replicas=2, fragments=fragments, timeout_s=30, quorum_timeout_s=60)
    whole, _, _, ckpt = _run(theta0, deltas, cfg, inner_momentum=0.5, snapshot_after=cut)
    assert all(c["diloco"]["manager"]["step"] == 2 * fragments and c["diloco"]["local_step"] == 1 for c in ckpt)
    rest, statuses, _, _ = _run(theta0, [d[cut:] for d in deltas], cfg, inner_momentum=0.5, resume=ckpt)
    for r in range(2):
        assert torch.equal(rest[r][-1], whole[r][-1]), f"replica {r}: resumed run differs from the uninterrupted one"
    assert all(s["outer_step"] == 4 * fragments and s["healed"] == 0 and s["failed_syncs"] == 0 for s in statuses)
