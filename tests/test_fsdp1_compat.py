"""Lightning ``FSDPStrategy`` / FSDP1 arguments: translated to ShardedStrategy's settings where FSDP2 means the same,
refused with the replacement where it does not, and never overriding an explicit setting silently."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from lightning_shard import ShardedStrategy, ShardingConfig


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}, {"sharding_strategy": "SHARD_GRAD_OP"}),
        ({"sharding_strategy": "full_shard"}, {"sharding_strategy": "FULL_SHARD"}),
        (
            {"sharding_strategy": ShardingStrategy._HYBRID_SHARD_ZERO2},
            {"sharding_strategy": "HYBRID_SHARD", "reshard_after_forward": False},
        ),
        ({"cpu_offload": CPUOffload(offload_params=True)}, {"cpu_offload": True}),
        ({"cpu_offload": CPUOffload(offload_params=False)}, {"cpu_offload": False}),
        ({"auto_wrap_policy": ModuleWrapPolicy({nn.Linear})}, {"auto_wrap_policy": {nn.Linear}}),
        (
            {"auto_wrap_policy": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})},
            {"auto_wrap_policy": {nn.Linear}},
        ),
        ({"activation_checkpointing_policy": {nn.Linear}}, {"activation_checkpointing": {nn.Linear}}),
        (
            {"activation_checkpointing_policy": ModuleWrapPolicy({nn.Linear})},
            {"activation_checkpointing": {nn.Linear}},
        ),
        ({"save_distributed_checkpoint": False}, {"state_dict_type": "full"}),
        (
            {"sharding_strategy": "hybrid_shard", "device_mesh": (2, 4)},
            {"hybrid_shard_size": 4, "hybrid_replicas": 2},
        ),
        # an explicit state_dict_type that agrees with save_distributed_checkpoint
        ({"save_distributed_checkpoint": True, "state_dict_type": "sharded"}, {"state_dict_type": "sharded"}),
        ({}, {"state_dict_type": "sharded"}),
        ({"state_dict_type": "full"}, {"state_dict_type": "full"}),
    ],
)
def test_fsdp1_arguments_are_translated(kwargs: dict[str, Any], expected: dict[str, Any]) -> None:
    config = ShardedStrategy(**kwargs).config
    for field, value in expected.items():
        assert getattr(config, field) == value, field


def test_lambda_policy_is_translated_to_its_function() -> None:
    def is_linear(module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=is_linear)
    assert ShardedStrategy(auto_wrap_policy=policy).config.auto_wrap_policy is is_linear


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}, ValueError, r"Trainer\(precision="),
        ({"use_orig_params": True}, ValueError, "always keeps the original parameters .*drop it"),
        ({"limit_all_gathers": True}, ValueError, "drop it"),
        ({"sync_module_states": True}, ValueError, "broadcast from rank 0"),
        ({"param_init_fn": lambda m: None}, ValueError, "reset_parameters"),
        ({"data_parallel_size": 2}, ValueError, "world size divided by `tensor_parallel_size`"),
        (
            {"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=1000)},
            ValueError,
            "auto_wrap_policy=1000",
        ),
        ({"auto_wrap_policy": lambda module, recurse, nonwrapped_numel: True}, TypeError, "FSDP1 policy"),
        (
            {"activation_checkpointing": {nn.Linear}, "activation_checkpointing_policy": {nn.Linear}},
            ValueError,
            "not both",
        ),
        ({"device_mesh": "2x4"}, TypeError, "hybrid_shard_size"),
        # an explicit state_dict_type is never overridden silently
        (
            {"save_distributed_checkpoint": False, "state_dict_type": "sharded"},
            ValueError,
            "save_distributed_checkpoint=False` contradicts `state_dict_type='sharded'",
        ),
        ({"sharding_strategy": "quarter_shard"}, ValueError, "quarter_shard"),
        ({"no_such_argument": 1}, TypeError, r"unexpected keyword argument 'no_such_argument'.*'sharding_strategy'"),
    ],
)
def test_fsdp1_arguments_without_fsdp2_meaning_are_refused(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ShardedStrategy(**kwargs)


def test_fsdp1_policy_given_to_sharding_config_directly_is_refused() -> None:
    with pytest.raises(TypeError, match="FSDP1 policy"):
        ShardingConfig(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def test_lightning_cli_yaml_takes_fsdp1_spellings_of_the_sharding_strategy() -> None:
    # LightningCLI builds the strategy through jsonargparse, which checks the argument's type before our translation
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(ShardedStrategy, "strategy")
    config = parser.parse_object({"strategy": {"sharding_strategy": "full_shard"}})
    assert parser.instantiate_classes(config).strategy.config.sharding_strategy == "FULL_SHARD"


@pytest.mark.parametrize(("world_size", "fits"), [(8, True), (16, False), (4, False)])
def test_device_mesh_replicas_are_checked_against_the_world_size(world_size: int, fits: bool) -> None:
    # FSDPStrategy's `device_mesh=(replicas, shard_size)`: the replicas were dropped before, so (2, 4) ran 4 x 4 on
    # 16 ranks without a word.
    config = ShardedStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4)).config
    if fits:
        assert config.mesh_shape(world_size, devices_per_node=4) == (2, 4)
        return
    with pytest.raises(ValueError, match=rf"`device_mesh=\(2, 4\)` describes 8 ranks, but the job has {world_size}"):
        config.mesh_shape(world_size, devices_per_node=4)
