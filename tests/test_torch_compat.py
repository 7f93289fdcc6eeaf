"""Every private torch name in ``lightning_shard.torch_compat`` does what the package relies on it for.

CI runs this file on each torch version ``pyproject.toml`` admits (2.11 and 2.13): a torch release that renames or
changes one of them fails here, by name, rather than somewhere inside a sharded run.
"""

from __future__ import annotations

import ast
import gc
import io
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import REPO
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_shard.torch_compat.checkpoint import (
    DCP_READER_SLICE_HOOK,
    PyTorchFileReader,
    check_hf_reader_hook,
    file_view,
    gc_paused,
    load_state_dict_from_keys,
    set_element,
)
from lightning_shard.torch_compat.compile_config import set_activation_memory_budget
from lightning_shard.torch_compat.dispatch import (
    TorchDispatchMode,
    draws_random_numbers,
    holds_values,
    op_arguments,
    tree_map,
)
from lightning_shard.torch_compat.distributed import flatten_mesh_dims, group_timeout, local_chunk
from lightning_shard.torch_compat.fsdp import (
    call_as_fsdp_forward,
    fsdp_comm_base_classes,
    fsdp_param_group,
    memory_simulation_tools,
    reregister_sharded_parameters,
    root_is_gathered,
    unsharded_gradient,
)
from lightning_shard.torch_compat.modules import (
    CHECKPOINT_WRAPPED_MODULE,
    HIDDEN_MODULE_NAMES,
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    is_persistent_buffer,
    visible_name,
)
from lightning_shard.torch_compat.optim import foreach_form
from lightning_shard.torch_compat.tensors import storage_key, storage_use_count


class Scaled(nn.Module):
    """A module with a method besides ``forward`` that uses its parameters (as ``generate`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(8.0).view(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T

    def double(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * (x @ self.weight.T)


# ------------------------------------------------------------------------------------------- FSDP2 state


def test_fsdp_param_group_and_gathered_state(mesh) -> None:
    assert fsdp_param_group(nn.Linear(2, 2)) is None
    model = fully_shard(Scaled(), mesh=mesh)
    group = fsdp_param_group(model)
    assert [p._module_info.param_name for p in group.fsdp_params] == ["weight"]
    assert not root_is_gathered(model)
    model(torch.ones(1, 2))  # the root keeps its parameters gathered after forward
    assert root_is_gathered(model)
    model.reshard()
    assert not root_is_gathered(model)


def test_call_as_fsdp_forward_gathers_for_another_method(mesh) -> None:
    model = fully_shard(Scaled(), mesh=mesh)
    x = torch.ones(1, 2)
    expected = Scaled().double(x)
    assert torch.equal(call_as_fsdp_forward(model, model.double, x), expected)


def test_unsharded_gradient_between_micro_batches(mesh) -> None:
    model = fully_shard(Scaled(), mesh=mesh)
    model.set_requires_gradient_sync(False)
    model(torch.ones(1, 2)).sum().backward()
    (fsdp_param,) = fsdp_param_group(model).fsdp_params
    grad = unsharded_gradient(fsdp_param)
    assert grad is not None and grad.shape == (4, 2) and torch.equal(grad, torch.ones(4, 2))


def test_reregister_sharded_parameters_after_allocation(mesh) -> None:
    with torch.device("meta"):
        model = Scaled()
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu", recurse=False)
    reregister_sharded_parameters(model)
    with torch.no_grad():
        model.weight.to_local().copy_(torch.arange(8.0).view(4, 2))
    # FSDP gathers from the allocated shard, not the meta one it was created with
    assert torch.equal(model(torch.ones(1, 2)), Scaled()(torch.ones(1, 2)))


# ------------------------------------------------------------------------------------------- activation checkpointing


def test_checkpoint_wrapper_names_and_hidden_module_names() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, nn.Linear),
    )
    assert isinstance(model[0], CheckpointWrapper)
    assert next(iter(dict(model.named_parameters()))) == f"0.{CHECKPOINT_WRAPPED_MODULE}.weight"
    assert list(get_model_state_dict(model)) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    compiled = torch.compile(nn.Linear(2, 2))
    assert next(iter(dict(compiled.named_parameters()))).split(".")[0] in HIDDEN_MODULE_NAMES
    assert CHECKPOINT_WRAPPED_MODULE in HIDDEN_MODULE_NAMES


# ------------------------------------------------------------------------------------------- averaging


def test_foreach_form_of_torchs_averaging_functions() -> None:
    from torch.optim.swa_utils import get_ema_avg_fn, get_swa_avg_fn

    averaged, current = [torch.zeros(3), torch.ones(2)], [torch.ones(3), torch.zeros(2)]
    expected = [get_ema_avg_fn(0.75)(a, c, 1) for a, c in zip(averaged, current, strict=True)]
    foreach_form(get_ema_avg_fn(0.75))(averaged, current, torch.tensor(1))
    assert all(torch.equal(a, e) for a, e in zip(averaged, expected, strict=True))  # the decay was read
    averaged = [torch.zeros(3)]
    foreach_form(get_swa_avg_fn())(averaged, [torch.full((3,), 3.0)], torch.tensor(2))
    assert torch.equal(averaged[0], torch.ones(3))  # 0 + (3 - 0) / 3
    assert foreach_form(torch.no_grad()(lambda a, c, n: c)) is None
    assert foreach_form(None) is None


def test_is_persistent_buffer() -> None:
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("computed", torch.zeros(1), persistent=False)
    assert is_persistent_buffer(module, "kept")
    assert not is_persistent_buffer(module, "computed")


# ------------------------------------------------------------------------------------------- DCP


def test_set_element_builds_nested_containers() -> None:
    state: dict = {}
    set_element(state, ("optimizer_states", 0, "param_groups"), [{"lr": 0.1}])
    assert state == {"optimizer_states": [{"param_groups": [{"lr": 0.1}]}]}


def test_gc_paused() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_load_state_dict_from_keys(tmp_path) -> None:
    dcp.save({"global_step": 7, "weight": torch.ones(3)}, checkpoint_id=tmp_path, no_dist=True)
    assert load_state_dict_from_keys({"global_step"}, str(tmp_path)) == {"global_step": 7}


def test_archive_reader_finds_a_tensor_inside_a_file_at_an_offset(tmp_path) -> None:
    archive = io.BytesIO()
    torch.save(torch.arange(4.0), archive)
    path = tmp_path / "data"
    path.write_bytes(b"x" * 100 + archive.getvalue())
    with open(path, "rb") as stream:
        reader = PyTorchFileReader(file_view(stream, 100, len(archive.getvalue())))
        offset = reader.get_record_offset("data/0")
        stream.seek(100 + offset)
        assert torch.equal(torch.frombuffer(bytearray(stream.read(16)), dtype=torch.float32), torch.arange(4.0))


def test_local_chunk_of_a_dtensor(mesh) -> None:
    dtensor = distribute_tensor(torch.zeros(4, 8), mesh, [Shard(0)])
    assert local_chunk(dtensor) == ((0, 0), (4, 8))


def test_hf_reader_keeps_the_request_hook_the_slice_reader_overrides() -> None:
    check_hf_reader_hook(dcp.HuggingFaceStorageReader)
    with pytest.raises(RuntimeError, match="has no `_process_read_request`.*tested range"):
        check_hf_reader_hook(dcp.FileSystemReader)


def test_filesystem_reader_reads_every_item_through_the_slice_hook_the_checksummed_reader_overrides() -> None:
    from lightning_shard.checkpoint.reader import InPlaceFileSystemReader

    hook = DCP_READER_SLICE_HOOK
    assert callable(getattr(dcp.FileSystemReader, hook))
    assert getattr(InPlaceFileSystemReader, hook) is not getattr(dcp.FileSystemReader, hook)


# ------------------------------------------------------------------------------------------- dispatch


def test_dispatch_mode_sees_random_ops_and_tree_map_maps() -> None:
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(draws_random_numbers(func))
            return func(*args, **(kwargs or {}))

    with Record():
        torch.empty(2).normal_()
        torch.ones(2) + 1
    assert True in seen and seen[-1] is False
    assert tree_map(lambda v: v * 2, {"a": [1, (2,)]}) == {"a": [2, (4,)]}


# ------------------------------------------------------------------------------------------- processes


def test_storage_use_count_counts_views() -> None:
    tensor = torch.zeros(4)
    before = storage_use_count(tensor)
    view = tensor.view(2, 2)
    assert storage_use_count(tensor) == before + 1
    del view
    assert storage_use_count(tensor) == before


def test_group_timeout(mesh) -> None:
    assert isinstance(group_timeout(dist.group.WORLD), timedelta)


def test_fsdp_comm_base_classes_are_fsdp2s_comm_interfaces(mesh) -> None:
    all_gather, reduce_scatter = fsdp_comm_base_classes()
    for cls in (all_gather, reduce_scatter):
        assert {"allocate", "__call__"} <= cls.__abstractmethods__
    model = fully_shard(nn.Linear(2, 2), mesh=mesh)

    class Recorded(all_gather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            output_tensor.copy_(input_tensor)

    model.set_custom_all_gather(Recorded())
    model(torch.ones(1, 2))  # FSDP2 takes the instance as its all-gather


def test_memory_simulation_tools() -> None:
    tools = memory_simulation_tools()
    assert tools["UNSHARDED_GRAD"].value == "Unsharded Grad"
    assert callable(tools["FSDPMemTracker"].get_tracker_snapshot)
    with tools["FakeTensorMode"]():
        assert type(torch.empty(2)).__name__ == "FakeTensor"


def test_the_opt_in_cpu_transport_is_imported_only_when_asked_for() -> None:
    # It builds on FSDP2's private comm interfaces; the default path (what GPU users run) must not depend on them.
    code = (
        "import sys, lightning_shard; lightning_shard.ShardedStrategy(); "
        "assert not {'lightning_shard.cpu.shm_comms', 'lightning_shard.cpu.gloo_comms'} & set(sys.modules); "
        "from lightning_shard.cpu import install_shared_memory_collectives; "
        "assert 'lightning_shard.cpu.shm_comms' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_visible_name_drops_the_wrappers_names() -> None:
    wrapped = f"layers.0.{CHECKPOINT_WRAPPED_MODULE}.attn.weight"
    assert visible_name(wrapped) == "layers.0.attn.weight"
    assert visible_name("_orig_mod.head.bias") == "head.bias"


def test_storage_key_is_shared_by_views_and_parameters() -> None:
    weight = torch.empty(2, 2, device="meta")
    assert storage_key(nn.Parameter(weight)) == storage_key(weight[0])
    assert storage_key(weight) != storage_key(torch.empty(2, 2, device="meta"))


def test_op_arguments_say_which_arguments_an_op_writes() -> None:
    written = [a.name for a in op_arguments(torch.ops.aten.copy_.default) if a.alias_info is not None]
    assert written == ["self"] and torch.ops.aten.copy_.default.name() == "aten::copy_"


def test_holds_values_is_false_for_fake_tensors_only() -> None:
    assert holds_values(torch.zeros(2))
    with memory_simulation_tools()["FakeTensorMode"]():
        assert not holds_values(torch.zeros(2))


def test_flatten_mesh_dims_names_the_dimensions_together(mesh) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    grid = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("replicate", "shard", "tensor_parallel"))
    flatten_mesh_dims(grid, ("replicate", "shard"), "data_parallel")
    assert grid["data_parallel"].size() == 1 and grid["data_parallel"].mesh_dim_names == ("data_parallel",)


def test_set_activation_memory_budget_sets_the_partitioners_budget() -> None:
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    try:
        set_activation_memory_budget(0.25)
        assert functorch_config.activation_memory_budget == 0.25
    finally:
        functorch_config.activation_memory_budget = before


def test_fused_kernel_devices() -> None:
    from lightning_shard.torch_compat.optim import fused_kernel_devices

    assert {"cpu", "cuda"} <= set(fused_kernel_devices())


def _private_torch_names(tree: ast.AST) -> list[str]:
    """The private torch names a module's source reaches: ``torch.x._y`` attributes, imports from ``torch.x._y``
    modules and of ``_y`` names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [node.module or "", *(alias.name for alias in node.names)]
            found += [f"line {node.lineno}: from {node.module}"] * any(
                part.startswith("_") for name in names for part in name.split(".")
            )
        elif isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {alias.name}"
                for alias in node.names
                if alias.name.startswith("torch.") and any(part.startswith("_") for part in alias.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            while isinstance(value, ast.Attribute):
                value = value.value
            if isinstance(value, ast.Name) and value.id == "torch":
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_private_torch_names_are_reached_through_torch_compat_only() -> None:
    # A private name used elsewhere would escape the per-version checks above (and the branches of torch_compat).
    package = REPO / "lightning_shard"
    found = {
        str(path.relative_to(REPO)): names
        for path in sorted(package.rglob("*.py"))
        if "torch_compat" not in path.relative_to(package).parts
        and (names := _private_torch_names(ast.parse(path.read_text())))
    }
    assert found == {}, f"private torch names outside lightning_shard/torch_compat/: {found}"
