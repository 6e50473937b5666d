"""The outer step through torchft's DiLoCo, checked against hand computations.

One replica under a real in-process lighthouse (quorum of one: the average of
one pseudo-gradient is itself). The inner optimizer is SGD(lr=1) fed a
hand-built gradient Δ, so after H inner steps θ_local = θ_global − ΣΔ and the
pseudo-gradient torchft averages is exactly θ_global − θ_local = ΣΔ.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from composer_mesh.configs.sections.diloco import DiLoCoConfig
from composer_mesh.titan_ext.diloco import DiLoCoReplica, ReplicaAssignment, build_outer_optimizer, split_fragments


@pytest.fixture
def lighthouse():
    from composer_mesh.titan_ext.torchft_compat import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    yield server.address()
    server.shutdown()


def _replica(cfg: DiLoCoConfig, lighthouse: str, theta0: torch.Tensor, index: int = 0):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    model = nn.Linear(theta0.numel(), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(theta0.view(1, -1))
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    replica = DiLoCoReplica(cfg, model, inner, ReplicaAssignment(f"replica_{index}", index, lighthouse),
                            store_addr="127.0.0.1", store_port=store.port)
    return replica, model, inner, store


def _inner_steps(model: nn.Module, inner: torch.optim.Optimizer, deltas: list[torch.Tensor]) -> None:
    for delta in deltas:
        model.weight.grad = delta.view(1, -1).clone()
        inner.step()


def test_plain_sgd_outer_step_is_theta_minus_lr_delta(lighthouse):
    cfg = DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.0, min_replicas=1, replica_groups=1)
    theta0 = torch.tensor([1.0, -2.0, 0.5, 3.0])
    replica, model, inner, _store = _replica(cfg, lighthouse, theta0)
    try:
        d1, d2 = torch.tensor([0.1, 0.2, -0.3, 0.0]), torch.tensor([0.05, -0.1, 0.1, 0.4])
        _inner_steps(model, inner, [d1, d2])
        theta_local = theta0.clone().add_(d1, alpha=-1.0).add_(d2, alpha=-1.0)  # the inner SGD(lr=1) steps
        delta = theta0 - theta_local  # the pseudo-gradient θ_global − θ_local (= Δ₁ + Δ₂ up to rounding)
        expected = theta0.clone().add_(delta, alpha=-0.7)  # θ_global − lr·Δ
        assert torch.equal(model.weight.detach().view(-1), expected)  # exactly, bit for bit
        torch.testing.assert_close(delta, d1 + d2)
        assert replica.status()["outer_step"] == 1 and replica.commits == 1
        assert replica.sync_bytes == [theta0.numel() * 4]  # one fp32 all-reduce of the pseudo-gradient
    finally:
        replica.close()


def test_nesterov_over_two_outer_steps(lighthouse):
    """torch SGD Nesterov: b₁ = Δ₁, θ₁ = θ₀ − lr(Δ₁ + μb₁); b₂ = μb₁ + Δ₂, θ₂ = θ₁ − lr(Δ₂ + μb₂)."""
    lr, mu = 0.7, 0.9
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=lr, outer_momentum=mu, nesterov=True, min_replicas=1, replica_groups=1)
    theta0 = torch.tensor([0.3, -1.0, 2.0])
    replica, model, inner, _store = _replica(cfg, lighthouse, theta0)
    try:
        d1, d2 = torch.tensor([0.5, -0.25, 1.0]), torch.tensor([-0.2, 0.4, 0.1])
        _inner_steps(model, inner, [d1])
        b1 = d1
        theta1 = theta0 - lr * (d1 + mu * b1)
        torch.testing.assert_close(model.weight.detach().view(-1), theta1, rtol=0, atol=1e-6)
        _inner_steps(model, inner, [d2])  # Δ₂ is taken from θ₁, the new global weights
        b2 = mu * b1 + d2
        theta2 = theta1 - lr * (d2 + mu * b2)
        torch.testing.assert_close(model.weight.detach().view(-1), theta2, rtol=0, atol=1e-6)
        assert replica.status()["outer_step"] == 2
    finally:
        replica.close()


def test_outer_optimizer_defaults_and_config_errors():
    cfg = DiLoCoConfig()
    opt = build_outer_optimizer([nn.Parameter(torch.zeros(2))], cfg)
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    with pytest.raises(ValueError, match="must divide inner_steps"):
        DiLoCoConfig(inner_steps=8, fragments=3)
    with pytest.raises(ValueError, match="fragment_delay"):
        DiLoCoConfig(inner_steps=8, fragments=2, fragment_delay=4)


def test_split_fragments_covers_every_parameter_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(4)]), nn.Linear(4, 10))
    frags = split_fragments(model, 3)
    assert len(frags) == 3
    ids = [id(p) for f in frags for p in f.parameters()]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    with pytest.raises(ValueError, match="only 6 blocks"):
        split_fragments(model, 7)
    model[2].weight = model[0].weight  # tied embedding / head: one fragment holds both
    frags = split_fragments(model, 2)
    assert any(model[0] in list(f) and model[2] in list(f) for f in frags)
    ids = [id(p) for f in frags for p in f.parameters()]
    assert len(set(ids)) == len(ids) == len(list(model.parameters()))
