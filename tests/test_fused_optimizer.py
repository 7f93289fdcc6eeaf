"""The optimizer step users get without changing their code: torch's fused kernel on the shards
(``lightning_shard.core.fused_optimizer``), equal to their optimizer over 50 steps within float rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_shard.core.fused_optimizer import use_fused_kernels

# 50 steps of fused against foreach kernels on the same shards: measured 1.6e-7 (AdamW), 1.2e-7 (Adam) on weights of
# order 0.1-1 - float32 rounding of the same update computed in another order.
TOLERANCE = 1e-6
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
}


def sharded_model(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_switched_optimizer_equals_the_users_over_50_steps(mesh, name: str) -> None:
    cls, kwargs = OPTIMIZERS[name]
    users, ours = sharded_model(mesh), sharded_model(mesh)  # the same seed: the same weights
    users_optimizer, our_optimizer = cls(users.parameters(), **kwargs), cls(ours.parameters(), **kwargs)
    assert use_fused_kernels([our_optimizer]) == [name]
    assert our_optimizer.param_groups[0]["fused"] and users_optimizer.param_groups[0]["fused"] is None
    data = torch.Generator().manual_seed(1)
    for _ in range(50):
        x = torch.randn(16, 32, generator=data)
        for model, optimizer in ((users, users_optimizer), (ours, our_optimizer)):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
    worst = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()
        for a, b in zip(users.parameters(), ours.parameters(), strict=True)
    )
    assert 0 < worst < TOLERANCE  # not the same kernel (> 0), the same update


def test_what_the_user_chose_is_kept(mesh) -> None:
    class MyAdamW(torch.optim.AdamW):  # a subclass may override `step`
        pass

    model = sharded_model(mesh)
    chosen = [
        torch.optim.AdamW(model.parameters(), fused=False),
        torch.optim.AdamW(model.parameters(), foreach=True),
        torch.optim.AdamW(model.parameters(), differentiable=True),
        MyAdamW(model.parameters()),
        torch.optim.SGD(model.parameters(), lr=0.1),  # fused, but DTensor has no rule for `_fused_sgd_`
        torch.optim.RMSprop(model.parameters()),  # no fused kernel
    ]
    assert use_fused_kernels(chosen) == []
    assert [o.param_groups[0].get("fused") for o in chosen] == [False, None, None, None, None, None]


def test_the_strategies_step_the_users_adamw_fused(init_skip_result: dict) -> None:
    """``torch.optim.AdamW(self.parameters(), lr=0.01)`` in ``configure_optimizers`` (Trainer) and before
    ``fabric.setup_optimizers`` (Fabric), resumed runs included."""
    scenarios = ["straight", "resume", "resume_full", "partial", "fabric", "fabric_resume"]
    assert [init_skip_result[name]["fused"] for name in scenarios] == [True] * len(scenarios)
