"""Policies, settings and their errors: pure functions and a one-rank process group, no Trainer."""

from __future__ import annotations

import datetime

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from toy import Block, ToyModel

import lightning_shard
from lightning_shard import ShardedStrategy, ShardingConfig
from lightning_shard.cpu.shm_comms import SharedMemoryAllGather, SharedMemoryReduceScatter
from lightning_shard.init.materialize import materialize_sharded_module
from lightning_shard.memory import estimate_memory
from lightning_shard.memory.auto_sharding import choose_sharding
from lightning_shard.plan.parallelize import parallelize_module
from lightning_shard.plan.precision import clip_grad_norm
from lightning_shard.plan.replicated import unshardable_parameters
from lightning_shard.plan.wrap import candidate_block_classes, plan_units, select_modules


def unit_names(model: nn.Module, mesh, **config) -> list[str]:
    parallelize_module(
        model,
        mesh,
        ShardingConfig(**config),
        mp_policy=MixedPrecisionPolicy(),
        offload_policy=OffloadPolicy(),
        device=torch.device("cpu"),
    )
    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


BLOCKS = ["", "blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ({Block}, BLOCKS),
        ([Block], BLOCKS),
        (["Block"], BLOCKS),
        (["toy.Block"], BLOCKS),
        ("auto", BLOCKS),
        (lambda m: isinstance(m, nn.Linear) and m.out_features == 1, ["", "head"]),
        (None, [""]),
        # size-based: a block holds 1,104 parameters (fc1 544, fc2 528, norm 32; embed 144, head 17);
        # a unit claims only what the smaller units below it left
        (1000, BLOCKS),
        (200, ["", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "blocks.2.fc1", "blocks.2.fc2"]),
    ],
    ids=["class-set", "class-list", "name", "import-path", "auto", "callable", "none", "min-params", "small-units"],
)
def test_wrap_policy_forms_select_units(mesh, policy, expected) -> None:
    assert unit_names(ToyModel(), mesh, auto_wrap_policy=policy) == expected


def fsdp_comm_groups(model: nn.Module) -> list:
    return [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]


def test_a_cpu_mesh_keeps_fsdp2s_own_collectives_by_default(mesh) -> None:
    model = ToyModel()
    unit_names(model, mesh, auto_wrap_policy={Block})
    groups = fsdp_comm_groups(model)
    assert len(groups) == 4
    # No custom comm hook: FSDP2 runs its own all-gather / reduce-scatter, as it does on nccl.
    assert {type(g._all_gather_comm).__name__ for g in groups} == {"DefaultAllGather"}
    assert {type(g._reduce_scatter_comm).__name__ for g in groups} == {"DefaultReduceScatter"}


def test_shared_memory_cpu_collectives_go_on_every_unit_when_asked_for(mesh) -> None:
    model = ToyModel()
    unit_names(model, mesh, auto_wrap_policy={Block}, cpu_collectives="shared_memory")
    groups = fsdp_comm_groups(model)
    assert len(groups) == 4
    assert {type(g._all_gather_comm) for g in groups} == {SharedMemoryAllGather}
    assert {type(g._reduce_scatter_comm) for g in groups} == {SharedMemoryReduceScatter}
    assert len({id(g._all_gather_comm) for g in groups}) == 1  # one pool of buffers shared by all units
    assert len({id(g._reduce_scatter_comm.transport) for g in groups}) == 1  # and one pair of shared segments


def test_forward_prefetch_links_each_unit_to_the_next(mesh) -> None:
    model = ToyModel()
    unit_names(model, mesh, auto_wrap_policy={Block}, forward_prefetch=True)
    prefetch = [[s._modules for s in b._get_fsdp_state()._states_to_forward_prefetch] for b in model.blocks]
    assert prefetch == [[(model.blocks[1],)], [(model.blocks[2],)], []]


def test_activation_checkpointing_wraps_before_sharding(mesh) -> None:
    model = ToyModel()
    names = unit_names(model, mesh, auto_wrap_policy=["Block"], activation_checkpointing=["Block"])
    wrappers = [name for name, module in model.named_modules() if isinstance(module, CheckpointWrapper)]
    assert wrappers == ["blocks.0", "blocks.1", "blocks.2"]
    assert names == BLOCKS  # the checkpoint wrappers became the units
    # state dicts keep the plain names
    assert set(model.state_dict()) == set(ToyModel().state_dict())


def test_unknown_class_name_lists_candidates() -> None:
    with pytest.raises(ValueError, match=r"'Blok'.*Candidate block classes: \['Block'\]"):
        select_modules(ToyModel(), ["Blok"])


def test_candidate_block_classes_keeps_outermost_repeats() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(2)])

    assert candidate_block_classes(ToyModel()) == ["Block"]
    assert candidate_block_classes(Outer()) == ["Sequential"]


def test_meta_model_without_reset_parameters_fails_loudly() -> None:
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3, device="meta"))

    with pytest.raises(TypeError, match=r"\['Custom'\].*reset_parameters"):
        materialize_sharded_module(nn.Sequential(Custom()), torch.device("cpu"))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sharding_strategy": "FULL"}, ValueError, "sharding_strategy='FULL'"),
        ({"state_dict_type": "zip"}, ValueError, "state_dict_type='zip'"),
        ({"cpu_collectives": "shm"}, ValueError, "cpu_collectives='shm'"),
        ({"forward_prefetch": "yes"}, TypeError, "forward_prefetch='yes'"),
        ({"auto_wrap_policy": -5}, ValueError, "auto_wrap_policy=-5"),
        ({"auto_wrap_policy": True}, TypeError, "not a bool"),
        ({"auto_wrap_policy": []}, ValueError, "is empty"),
        ({"auto_wrap_policy": [3.5]}, TypeError, "3.5"),
        ({"auto_wrap_policy": [int]}, TypeError, "not an nn.Module subclass"),
        ({"activation_checkpointing": 0}, ValueError, "activation_checkpointing=0"),
        ({"cpu_offload": "yes"}, TypeError, "cpu_offload='yes'"),
        ({"cpu_offload": True, "sharding_strategy": "NO_SHARD"}, ValueError, "FULL_SHARD"),
        ({"reshard_after_forward": 1}, ValueError, "reshard_after_forward=1"),
        ({"reshard_after_forward": "no"}, TypeError, "reshard_after_forward='no'"),
        ({"reshard_after_forward": True, "sharding_strategy": "NO_SHARD"}, ValueError, "NO_SHARD"),
        ({"hybrid_shard_size": 2}, ValueError, "HYBRID_SHARD"),
        ({"hybrid_shard_size": 0, "sharding_strategy": "HYBRID_SHARD"}, ValueError, "hybrid_shard_size=0"),
        ({"start_method": "thread"}, ValueError, "start_method='thread'"),
        ({"timeout": 30}, TypeError, "timedelta"),
        ({"reduce_dtype": torch.int8}, TypeError, "reduce_dtype"),
        ({"sharding_strategy": "auto", "cpu_offload": True}, ValueError, "sharding_strategy='auto'"),
        ({"async_save": True, "state_dict_type": "full"}, ValueError, "state_dict_type='sharded'"),
        ({"gradient_accumulation": "whole"}, ValueError, "gradient_accumulation='whole'"),
        ({"gradient_accumulation": 4}, TypeError, "gradient_accumulation=4.*accumulate_grad_batches"),
    ],
)
def test_bad_settings_raise_at_construction(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        ShardedStrategy(**kwargs)


def test_hybrid_size_must_divide_world() -> None:
    config = ShardingConfig(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=3)
    with pytest.raises(ValueError, match="hybrid_shard_size=3.*divide the world size 4"):
        config.mesh_shape(world_size=4, devices_per_node=4)
    assert ShardingConfig(sharding_strategy="NO_SHARD").mesh_shape(4, 4) == (4, 1)


@pytest.mark.parametrize(
    ("name", "sharding", "offload"),
    [
        ("fully_sharded", "FULL_SHARD", False),
        ("fully_sharded_grad_op", "SHARD_GRAD_OP", False),
        ("fully_sharded_offload", "FULL_SHARD", True),
        ("hybrid_sharded", "HYBRID_SHARD", False),
    ],
)
def test_registry_names(name: str, sharding: str, offload: bool) -> None:
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ShardedStrategy)
    # the same name in Fabric's registry: the Fabric strategy with the same settings
    fabric_strategy = L.Fabric(strategy=name, accelerator="cpu", devices=2).strategy
    assert isinstance(fabric_strategy, lightning_shard.fabric.ShardedStrategy)
    assert fabric_strategy.config == trainer.strategy.config
    assert trainer.strategy.config.sharding_strategy == sharding
    assert trainer.strategy.config.cpu_offload is offload
    assert trainer.strategy.config.gradient_accumulation == "sharded"
    assert trainer._accelerator_connector.is_distributed


def test_generic_precision_plugin_is_converted() -> None:
    trainer = L.Trainer(strategy="fully_sharded", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, lightning_shard.ShardedPrecision)
    assert plugin.mp_policy.param_dtype is torch.bfloat16 and plugin.mp_policy.reduce_dtype is torch.float32
    low = ShardedStrategy(reduce_dtype=torch.bfloat16)
    low.precision_plugin = lightning_shard.ShardedPrecision("bf16-mixed", reduce_dtype=torch.bfloat16)
    assert low.precision_plugin.mp_policy.reduce_dtype is torch.bfloat16


def test_foreign_checkpoint_io_is_refused_when_the_trainer_is_built() -> None:
    from lightning.fabric.plugins import TorchCheckpointIO

    with pytest.raises(TypeError, match="ShardedCheckpointIO"):
        L.Trainer(strategy="fully_sharded", accelerator="cpu", devices=2, plugins=[TorchCheckpointIO()])


def test_unknown_strategy_name_is_named() -> None:
    with pytest.raises(ValueError, match="fully_shardd"):
        L.Trainer(strategy="fully_shardd", accelerator="cpu", devices=2)


def test_precision_errors() -> None:
    with pytest.raises(ValueError, match="precision='64-true'"):
        lightning_shard.ShardedPrecision("64-true")
    with pytest.raises(ValueError, match="reduce_dtype"):
        lightning_shard.ShardedPrecision("32-true", reduce_dtype=torch.float16)


def test_timeout_is_accepted_as_timedelta() -> None:
    assert ShardedStrategy(timeout=datetime.timedelta(minutes=5))._timeout == datetime.timedelta(minutes=5)


@pytest.mark.parametrize(
    ("memory_mib", "expected"),
    [
        # budget = 70% of the memory; 4M fp32 parameters with AdamW: 61 MiB of model state whole, and one unit's
        # reduce-scatter input (3.8 MiB) besides the gathered units
        (1024, ("NO_SHARD", False)),  # 61 + all units gathered 15.3 + 3.8 = 80.2 MiB fits: least communication wins
        (72, ("SHARD_GRAD_OP", False)),  # 30.5 MiB sharded + 15.3 + 3.8 = 49.6 <= 50.4
        (68, ("FULL_SHARD", False)),  # 30.5 MiB + three gathered units 11.5 + 3.8 = 45.8 <= 47.6
        (30, ("FULL_SHARD", True)),  # only offloading fits: 15.3 MiB on the device
    ],
)
def test_auto_sharding_takes_the_cheapest_option_that_fits(memory_mib: float, expected: tuple[str, bool]) -> None:
    model = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(4)])
    choice = choose_sharding(
        model,
        world_size=2,
        precision="32-true",
        activation_checkpointing=False,
        device_memory_bytes=int(memory_mib * 2**20),
        can_offload=True,
    )
    assert (choice.sharding_strategy, choice.cpu_offload) == expected
    assert expected[0] in choice.reason and "budget" in choice.reason


def test_auto_sharding_counts_whole_gradients_kept_between_micro_batches() -> None:
    # gradient_accumulation="unsharded" keeps the whole fp32 gradients (15.3 MiB) on the device of every option:
    # SHARD_GRAD_OP needs 57.3 MiB, FULL_SHARD 53.5, so 72 MiB (budget 50.4) now takes offload (30.5 on the device).
    model = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(4)])
    settings = {"world_size": 2, "precision": "32-true", "activation_checkpointing": False}
    unsharded = {"accumulate_grad_batches": 4, "gradient_accumulation": "unsharded"}
    choice = choose_sharding(model, **settings, **unsharded, device_memory_bytes=72 * 2**20, can_offload=True)
    assert (choice.sharding_strategy, choice.cpu_offload) == ("FULL_SHARD", True)
    with pytest.raises(MemoryError, match="gradient_accumulation='sharded'"):
        choose_sharding(model, **settings, **unsharded, device_memory_bytes=72 * 2**20, can_offload=False)
    # one micro-batch per step holds no whole gradients, whatever the setting
    one_micro_batch = {**unsharded, "accumulate_grad_batches": 1}
    choice = choose_sharding(model, **settings, **one_micro_batch, device_memory_bytes=72 * 2**20, can_offload=True)
    assert choice.sharding_strategy == "SHARD_GRAD_OP"


def test_auto_sharding_says_when_nothing_fits() -> None:
    with pytest.raises(MemoryError, match="No sharding fits.*Use more ranks"):
        choose_sharding(
            nn.Linear(1000, 1000),
            world_size=2,
            precision="32-true",
            activation_checkpointing=False,
            device_memory_bytes=2**20,
            can_offload=False,
        )


# ---------------------------------------------------------------------------------------------- what "auto" picks


class NestedLayers(nn.Module):
    """x-transformers' layout: ``layers[i]`` is a ModuleList of (norm, block); forward calls them one by one."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList([nn.LayerNorm(8), Block(8)]) for _ in range(depth))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, block in self.layers:
            x = block(norm(x))
        return self.head(x)


class AttentionWithHead(nn.Module):
    """nn.MultiheadAttention blocks beside a Linear head in a Sequential (MONAI's MIL model, open_clip's style)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0) for _ in range(2))
        self.head = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            x = layer(x)
        return self.head(x)


class ReadsFirstBlock(nn.Module):
    """diffusers' DiT: the forward calls a submodule of its first block itself."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.blocks[0].fc1(x)[..., :8]
        for _index, block in enumerate(self.blocks):
            x = block(x)
        return x


def names_of(model: nn.Module, modules: list[nn.Module]) -> list[str]:
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(module)] for module in modules]


def test_auto_finds_the_blocks_inside_nested_containers() -> None:
    model = NestedLayers()
    # the blocks, not the inner ModuleLists (fully_shard refuses a container without forward) nor the tiny norms
    assert names_of(model, select_modules(model, "auto")) == ["layers.0.1", "layers.1.1", "layers.2.1"]
    assert candidate_block_classes(model) == ["Block"]


def test_a_stray_linear_head_does_not_make_linear_a_block() -> None:
    model = AttentionWithHead()
    plan = plan_units(model, "auto")
    assert names_of(model, plan.modules) == ["encoder.0", "encoder.1"]
    # A policy that names Linear gets the head's: MultiheadAttention hands `out_proj.weight` to its attention function,
    # and TransformerEncoderLayer's inference fast path hands over its Linears' weights too.
    plan = plan_units(model, {nn.Linear})
    assert names_of(model, plan.modules) == ["head.0", "head.2"]
    assert plan.left_out["encoder.0.self_attn.out_proj"] == (
        "TransformerEncoderLayer.forward reads `self.self_attn.out_proj.weight`"
    )
    assert {name.split(".", 2)[-1] for name in plan.left_out} == {"self_attn.out_proj", "linear1", "linear2"}


def test_a_block_its_parent_reads_into_stays_in_the_parent() -> None:
    model = ReadsFirstBlock()
    plan = plan_units(model, "auto")
    assert names_of(model, plan.modules) == ["blocks.1", "blocks.2"]
    assert plan.left_out == {"blocks.0": "ReadsFirstBlock.forward reads `self.blocks[0].fc1`"}


def test_without_a_repeated_block_auto_shards_the_root_and_says_so() -> None:
    plan = plan_units(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8)), "auto")
    assert plan.modules == [] and "the root alone is sharded as one unit" in plan.note
    assert plan_units(ToyModel(), "auto").note is None


def test_forward_reads_follow_aliases_and_ignore_structure_and_metadata() -> None:
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(8) for _ in range(2))
            self.seq = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            self.norm = nn.LayerNorm(8)
            self.proj = nn.Linear(8, 8)
            self.other = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block, layer in zip(self.blocks, self.seq, strict=True):  # iterating the Sequential reads into it
                x = layer(block(x))
            assert len(self.blocks) == 2 and self.proj.weight.dtype == x.dtype  # structure and metadata only
            if hasattr(self.norm, "emb"):
                x = self.norm.emb(x)  # a branch this LayerNorm cannot take
            return self._helper(x)

        def _helper(self, x: torch.Tensor) -> torch.Tensor:
            return self.other.forward(x)  # bypasses the unit's hooks

    model = Parent()
    reads = {names_of(model, [m])[0]: reason for m in model.modules() if (reason := _read(model, m))}
    assert reads == {"seq": "Parent.forward reads `layer`", "other": "Parent.forward reads `self.other.forward`"}


def _read(model: nn.Module, module: nn.Module) -> str | None:
    from lightning_shard.plan.forward_reads import modules_read_from_outside

    return modules_read_from_outside(model).get(id(module))


# ---------------------------------------------------------------------------------------------- replicated parameters


class WithScale(nn.Module):
    """CLIP's pattern: a 0-d ``logit_scale`` beside the blocks, and a non-contiguous (transposed) parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(8) for _ in range(2))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.proj = nn.Parameter(torch.randn(4, 8).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (x @ self.proj) * self.logit_scale.exp()


def test_parameters_fully_shard_refuses_are_kept_whole_and_clipped_once(mesh) -> None:
    torch.manual_seed(0)
    model, reference = WithScale(), WithScale()
    reference.load_state_dict(model.state_dict())
    assert [name for name, _ in unshardable_parameters(model)] == ["logit_scale", "proj"]
    names = unit_names(model, mesh)  # failed before: "fully_shard doesn't support scalar parameters"
    assert names == ["", "blocks.0", "blocks.1"]
    assert not isinstance(model.logit_scale, DTensor) and not isinstance(model.proj, DTensor)
    assert isinstance(model.blocks[0].fc1.weight, DTensor)
    x = torch.randn(3, 8)
    for m in (model, reference):
        m(x).square().sum().backward()
    total = clip_grad_norm(model.parameters(), max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1.0)
    assert torch.allclose(total, expected)
    assert torch.allclose(model.logit_scale.grad, reference.logit_scale.grad)
    assert torch.allclose(model.blocks[0].fc1.weight.grad.full_tensor(), reference.blocks[0].fc1.weight.grad)


def test_the_estimate_counts_replicated_parameters_whole_on_every_rank() -> None:
    # 4 x 1000 x 1000 weights + biases sharded over 2 ranks, and 10 0-d scales kept whole: AdamW, fp32
    model = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(4)])
    model.scales = nn.ParameterList(nn.Parameter(torch.tensor(1.0)) for _ in range(10))
    estimate = estimate_memory(model, world_size=2)
    sharded = 4 * 1_001_000 // 2
    assert estimate.device.params == 4 * (sharded + 10)
    assert estimate.device.grads == 4 * (sharded + 10)
    assert estimate.device.optimizer_states == 2 * 4 * (sharded + 10)
    offloaded = estimate_memory(model, world_size=2, cpu_offload=True)
    assert (offloaded.device.params, offloaded.cpu.params) == (4 * 10, 4 * sharded)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"selective_checkpointing_ops": ["aten.mm.default"]}, ValueError, "needs `activation_checkpointing='select"),
        (
            {"activation_checkpointing": "selective", "selective_checkpointing_ops": ["aten.matmult.default"]},
            ValueError,
            "'aten.matmult.default', which is not an op overload",
        ),
        ({"activation_memory_budget": 0.5}, ValueError, "needs `compile=True`"),
        ({"activation_memory_budget": 1.5, "compile": True}, ValueError, "a number between 0 and 1"),
        (
            {"activation_memory_budget": 0.5, "compile": True, "activation_checkpointing": ["Block"]},
            ValueError,
            "replaces `activation_checkpointing=\\['Block'\\]`",
        ),
    ],
)
def test_checkpointing_forms_are_checked_at_construction(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ShardedStrategy(**kwargs)


def test_selective_checkpointing_wraps_the_auto_blocks_with_the_per_op_policy(mesh) -> None:
    model = ToyModel()
    config = ShardingConfig(activation_checkpointing="selective", selective_checkpointing_ops=["aten.addmm.default"])
    parallelize_module(model, mesh, config, mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                       device=torch.device("cpu"))  # fmt: skip
    wrappers = [module for module in model.modules() if isinstance(module, CheckpointWrapper)]
    assert [type(w._checkpoint_wrapped_module).__name__ for w in wrappers] == ["Block"] * 3
    assert all("context_fn" in w.checkpoint_fn.keywords for w in wrappers)


def test_true_precision_walks_the_model_only_when_something_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"32-true"`` on an fp32 model (every setup of the default path) changes nothing and walks nothing; a tensor or
    a Lightning module's reported dtype that differs is converted as ``.to`` converts it."""
    from lightning_shard.plan.precision import ShardedPrecision

    walked: list[nn.Module] = []
    apply = nn.Module._apply
    monkeypatch.setattr(nn.Module, "_apply", lambda self, *a, **k: walked.append(self) or apply(self, *a, **k))

    class Model(L.LightningModule):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2, dtype=dtype)

    fp32 = Model(torch.float32)
    assert ShardedPrecision("32-true").convert_module(fp32) is fp32 and not walked
    built_in_bf16 = Model(torch.bfloat16)  # its tensors in bf16, its reported dtype fp32: `.to` sets it
    ShardedPrecision("bf16-true").convert_module(built_in_bf16)
    assert walked and built_in_bf16.dtype == torch.bfloat16
    ShardedPrecision("32-true").convert_module(built_in_bf16)
    assert {param.dtype for param in built_in_bf16.parameters()} == {torch.float32}
    assert built_in_bf16.dtype == torch.float32
