"""Calling the sharded model outside the step methods never computes with stale gathered parameters.

One rank (a gloo group of one) is enough to show it: the gathered copies FSDP keeps are separate tensors from the
shards the optimizer and checkpoint loads write, at any world size. The 2-rank case with a real optimizer step is
``test_parity.py``'s ``call_before_step`` scenario.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import IN_FEATURES, Block, ToyModel  # noqa: E402

from lightning_shard import ShardingConfig  # noqa: E402
from lightning_shard.plan.direct_calls import drop_gathered_parameters  # noqa: E402
from lightning_shard.plan.parallelize import parallelize_module  # noqa: E402
from lightning_shard.torch_compat.fsdp import root_is_gathered  # noqa: E402


def _sharded_toy(mesh) -> tuple[ToyModel, ToyModel, dict[str, torch.Tensor]]:
    """The toy model sharded, an unsharded copy, and its sharded parameters (what an optimizer holds)."""
    torch.manual_seed(0)
    model = ToyModel()
    reference = copy.deepcopy(model)
    parallelize_module(
        model,
        mesh,
        ShardingConfig(auto_wrap_policy={Block}),
        mp_policy=MixedPrecisionPolicy(),
        offload_policy=OffloadPolicy(),
        device=torch.device("cpu"),
        forward_methods=["training_step"],
    )
    return model, reference, dict(model.named_parameters())


def _change_weights(shards: dict[str, torch.Tensor], reference: ToyModel) -> None:
    """What an optimizer step or a checkpoint load does: new values in the shards."""
    with torch.no_grad():
        shards["embed.weight"].to_local().add_(1.0)
        reference.embed.weight.add_(1.0)


def test_a_direct_call_drops_what_it_gathered(mesh) -> None:
    # `lightning_module.model.generate(...)` after fit goes through this path (a direct child of the root)
    model, reference, shards = _sharded_toy(mesh)
    x = torch.randn(4, IN_FEATURES)
    assert torch.equal(model.embed(x), reference.embed(x))
    assert not root_is_gathered(model)  # before: gathered until the next backward
    _change_weights(shards, reference)
    assert torch.equal(model.embed(x), reference.embed(x))  # before: the pre-change values


def test_gathered_copies_are_dropped_once_the_shards_change(mesh) -> None:
    # The root's own forward keeps its parameters gathered (FSDP's root behaviour); the strategy drops them after
    # every optimizer step and checkpoint load.
    model, reference, shards = _sharded_toy(mesh)
    x = torch.randn(4, IN_FEATURES)
    with torch.no_grad():
        model(x)
    assert root_is_gathered(model)
    _change_weights(shards, reference)
    drop_gathered_parameters(model)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
