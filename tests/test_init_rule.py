"""The initialisation rule as a contract: a model built on the meta device equals its eager build, tensor by tensor, or
setup stops with an error naming the tensors - for construction styles found in common model code (``init_styles``).

One 2-rank launch (``init_corpus_run.py``: the Trainer for every reproducible style, Fabric for a subset, the error
styles and the random state) against eager builds in this process; then one-process checks of the recorder's parts.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import run_script  # noqa: E402
from init_corpus_run import AFTER_BUILD_STYLES, FABRIC_STYLES  # noqa: E402
from init_styles import ERROR_NAMES, ERRORS, SEED, STYLES, eager_after_build, eager_state  # noqa: E402

from lightning_shard.init.construction import record_construction  # noqa: E402
from lightning_shard.init.construction_log import construction_logs  # noqa: E402
from lightning_shard.init.materialize import materialize_sharded_module, meta_construction  # noqa: E402
from lightning_shard.init.op_recorder import OVERWRITES  # noqa: E402
from lightning_shard.torch_compat.dispatch import TorchDispatchMode, op_base_name  # noqa: E402

REPRODUCIBLE = [name for name in STYLES if name not in ERRORS]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("init_corpus")
    run_script("tests/init_corpus_run.py", "--out", str(out), timeout=900)
    return torch.load(out / "corpus.pt", weights_only=False)


def assert_equal_states(built: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> None:
    """Equal tensor by tensor. A tensor built in a lower floating precision is stored in fp32 under "32-true" (the
    precision upcasts it before sharding, as for an eager build): then its eager values upcast, bit for bit."""
    assert built.keys() == eager.keys()
    for key in eager:
        expected = eager[key]
        if built[key].dtype != expected.dtype:
            assert expected.is_floating_point() and built[key].dtype == torch.float32, key
            expected = expected.float()
        assert torch.equal(built[key], expected), f"{key}: {(built[key].float() - expected.float()).abs().max()}"


def test_the_corpus_has_at_least_twenty_styles() -> None:
    assert len(REPRODUCIBLE) >= 20 and len(ERRORS) >= 2


@pytest.mark.parametrize("name", REPRODUCIBLE)
def test_trainer_builds_each_style_as_eagerly(corpus: dict[str, Any], name: str) -> None:
    assert_equal_states(corpus["trainer"][name], eager_state(name))


# Styles whose every draw is counted (`normal_`, `uniform_`): each rank replays its share and jumps over the rest
SPLIT_STYLES = ["nanogpt", "tied_head_first", "uneven_shards", "generator_argument", "manual_seed_in_init",
                "fork_rng_and_set_rng_state", "cast_sequential_to_bf16", "deepcopy_clones_then_xavier",
                "copies_and_slices", "conv_kaiming_batchnorm", "litgpt_reset_parameters_overrides"]  # fmt: skip
# Not split: a draw no count is known for (an `nn.init` function run whole, `orthogonal_`'s QR, `trunc_normal_`)
WHOLE_STYLES = ["orthogonal_and_trunc_normal_through_nn_init", "timm_trunc_normal_imported_by_name"]


def test_the_replay_is_split_between_the_ranks_where_every_draw_is_counted(corpus: dict[str, Any]) -> None:
    assert all(corpus["split"][name] for name in SPLIT_STYLES)
    assert not any(corpus["split"][name] for name in WHOLE_STYLES)
    assert sum(corpus["split"].values()) >= 25  # of the reproducible styles, all equal to the eager build above


def test_weights_created_and_filled_whole_are_drawn_by_each_rank_in_its_chunk(corpus: dict[str, Any]) -> None:
    # nanoGPT: every Linear / Embedding weight (normal_), bias (zero_) and norm (fill_) - no tensor sent
    assert corpus["chunked"]["nanogpt"] >= 10
    # a weight computed from another (a copy, a cast, a tie made by assignment) goes through its owner's replay
    assert corpus["chunked"]["copies_and_slices"] < corpus["chunked"]["nanogpt"]


def test_a_miscounted_jump_is_caught_and_the_replay_runs_whole(corpus: dict[str, Any]) -> None:
    assert corpus["miscounted"]["warned"]
    assert_equal_states(corpus["miscounted"]["state"], eager_state("nanogpt"))


@pytest.mark.parametrize("name", FABRIC_STYLES)
def test_fabric_builds_styles_as_eagerly(corpus: dict[str, Any], name: str) -> None:
    torch.manual_seed(SEED)
    eager = STYLES[name]().state_dict()
    assert_equal_states(corpus["fabric"][name]["state"], eager)


@pytest.mark.parametrize("name", list(ERRORS))
def test_styles_an_eager_build_cannot_be_reproduced_from_stop_with_the_tensors_named(
    corpus: dict[str, Any], name: str
) -> None:
    result = corpus["fabric"][name]
    assert "state" not in result
    assert ERRORS[name] in result["error"]
    assert ERROR_NAMES[name] in result["error"]


@pytest.mark.parametrize("name", AFTER_BUILD_STYLES)
def test_code_between_init_module_and_setup_and_draws_after_it_match_the_eager_run(
    corpus: dict[str, Any], name: str
) -> None:
    """Recorded until setup: the style's code after the build (litgpt's ``reset_parameters`` overrides,
    ``model.apply(init)``), a real head assigned after ``init_module(empty_init=True)`` and a draw after setup (on
    both ranks) as in the eager run."""
    result, eager = corpus["after_build"][name], eager_after_build(name)
    assert_equal_states(result["state"], eager["state"])
    for rank in range(2):
        assert torch.equal(result["drawn"][rank], eager["drawn"]), (rank, result["drawn"][rank] - eager["drawn"])


def test_litgpt_pretrain_init_path_matches_its_eager_build(corpus: dict[str, Any]) -> None:
    """litgpt's own ``initialize_weights`` between ``init_module(empty_init=True)`` and ``fabric.setup`` on 2 ranks
    equals the same code run eagerly in one process, tensor by tensor, and so does the draw after setup."""
    from types import SimpleNamespace

    from init_corpus_run import litgpt_config
    from litgpt import GPT
    from litgpt.pretrain import initialize_weights

    config = litgpt_config()
    torch.manual_seed(SEED)
    model = GPT(config)
    initialize_weights(SimpleNamespace(strategy=None), model, n_layer=config.n_layer, n_embd=config.n_embd)
    eager = {key: value.detach().clone() for key, value in model.state_dict().items()}
    drawn = torch.rand(4)
    assert_equal_states(corpus["litgpt"]["state"], eager)
    assert torch.equal(corpus["litgpt"]["drawn"][0], drawn) and torch.equal(corpus["litgpt"]["drawn"][1], drawn)


def test_ranks_seeded_apart_get_rank_zeros_weights_and_their_own_streams(corpus: dict[str, Any]) -> None:
    result = corpus["seeded_apart"]
    assert_equal_states(result["state"], eager_after_build("nanogpt", seed=100)["state"])
    for rank in range(2):
        assert torch.equal(result["drawn"][rank], eager_after_build("nanogpt", seed=100 + rank)["drawn"]), rank


def test_each_rank_keeps_its_own_random_state(corpus: dict[str, Any]) -> None:
    drawn = corpus["fabric_per_rank_random_state"]["drawn"]
    for rank in range(2):
        torch.manual_seed(100 + rank)
        assert torch.equal(drawn[rank], torch.rand(4))
    assert not torch.equal(drawn[0], drawn[1])


# ---------------------------------------------------------------------------------------------- no processes


def build(make: Any) -> nn.Module:
    torch.manual_seed(SEED)
    with meta_construction():
        model = make()
    materialize_sharded_module(model, torch.device("cpu"))
    return model


def test_op_tables_name_what_torch_dispatches() -> None:
    """The tables hold overload-free names (c5f93f4 compared `aten::fill_.Scalar` against `aten::fill_`): each entry
    is an op of this torch, and what the recorder sees for a fill, a copy and a draw carries the same names."""
    for name in OVERWRITES:
        namespace, op = name.split("::")
        assert hasattr(getattr(torch.ops, namespace), op), name
    with torch.device("meta"), record_construction() as log:
        weight = torch.empty(3, 3)
        weight.fill_(1.0)
        weight.normal_()
        weight.copy_(torch.ones(3, 3))
        weight.zero_()
    on_weight = [op for op in log.ops if any(ref.storage == log.ops[0].outputs[0].storage for ref in op.writes)]
    assert op_base_name(log.ops[0].func) == "aten::empty"
    assert [op_base_name(op.func) for op in on_weight] == ["aten::fill_", "aten::normal_", "aten::copy_", "aten::zero_"]
    assert all(op_base_name(op.func) in OVERWRITES and op.overwritten for op in on_weight)


def test_a_meta_normal_is_recorded_without_torch_s_kernel_and_a_bad_std_still_raises_torch_s_error() -> None:
    """The recorder skips torch's meta kernel of ``normal_`` (a Python decomposition, a quarter of recording the GPT
    example): the op is recorded and replayed all the same, and a negative ``std`` still gets torch's error
    where the eager build raises it."""
    torch.manual_seed(SEED)
    eager = nn.Linear(4, 4, bias=False)
    nn.init.normal_(eager.weight, 0.5, 0.02)
    with torch.device("meta"), record_construction() as log:
        weight = torch.empty(4, 4)
        assert weight.normal_(0.5, 0.02) is weight
    assert [op_base_name(op.func) for op in log.ops] == ["aten::empty", "aten::normal_"]
    torch.manual_seed(SEED)
    with meta_construction():
        layer = nn.Linear(4, 4, bias=False)
        nn.init.normal_(layer.weight, 0.5, 0.02)
    materialize_sharded_module(layer, torch.device("cpu"))
    assert torch.equal(layer.weight.detach(), eager.weight.detach())
    with pytest.raises(RuntimeError, match="normal expects std >= 0.0"), meta_construction():
        nn.init.normal_(nn.Linear(2, 2).weight, 0.0, -1.0)


def test_the_recorder_s_bookkeeping_reaches_no_torch_function_mode() -> None:
    """Registering a parameter while recording runs the recorder's own tensor queries (storage, sizes, strides)
    with torch-function handling off: a mode around the build sees the model's calls only (through every mode's
    Python handler, those queries took about a seventh of the recording)."""
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Calls() as plain, torch.device("meta"):
        nn.Linear(2, 2)
    with Calls() as recorded, meta_construction():
        nn.Linear(2, 2)
    assert recorded.names == plain.names


def test_torch_empty_never_written_is_refused_even_with_reset_parameters() -> None:
    with pytest.raises(RuntimeError, match=r"nothing its construction did wrote \['w'\]"):
        build(STYLES["empty_never_written"])


def test_fill_after_empty_like_counts_as_written() -> None:
    model = build(STYLES["empty_like_then_fill"])
    assert torch.equal(model.decay, torch.full((3,), 0.9))


def test_replay_draws_on_the_cpu_generator_whatever_the_device() -> None:
    """The GPU path's stand-in: materialising onto another device (meta stands in for CUDA: it holds no values and
    draws nothing) still draws every random op on the CPU, from the CPU generator as the eager CPU build does, and
    leaves the caller's generator as it found it."""
    torch.manual_seed(SEED)
    with meta_construction():
        model = STYLES["nanogpt"]()

    class Draws(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.devices: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if torch.Tag.nondeterministic_seeded in func.tags:
                self.devices += [t.device.type for t in args if isinstance(t, torch.Tensor)]
            return func(*args, **(kwargs or {}))

    torch.manual_seed(99)
    before = torch.get_rng_state()
    with Draws() as draws:
        materialize_sharded_module(model, torch.device("meta"))
    assert draws.devices and set(draws.devices) == {"cpu"}
    assert torch.equal(torch.get_rng_state(), before)


def test_a_module_built_on_meta_outside_any_recording_runs_its_reset_parameters() -> None:
    torch.manual_seed(SEED)
    expected = nn.Linear(3, 3).state_dict()
    model = nn.Linear(3, 3, device="meta")
    torch.manual_seed(SEED)
    materialize_sharded_module(model, torch.device("cpu"))
    assert_equal_states(model.state_dict(), expected)


def test_logs_are_dropped_once_materialised() -> None:
    model = build(STYLES["layer_scale"])
    assert construction_logs(model) == []


def test_a_large_real_tensor_changed_through_data_before_setup_is_refused() -> None:
    """Read by value: a change through ``.data`` (which leaves the version counter as it was) stops the build."""
    table = torch.randn(300, 300)  # above the size kept by copy

    class FromTable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(300, 300))
            with torch.no_grad():
                self.w.copy_(table)  # a pretrained table copied in

    with meta_construction():
        model = FromTable()
    table.data.add_(1.0)
    with pytest.raises(RuntimeError, match=r"changed in place afterwards \(also through `.data`\)"):
        materialize_sharded_module(model, torch.device("cpu"))


def test_a_meta_tensor_changed_after_its_recording_ended_is_refused() -> None:
    """Recorded until setup or until the next model is started on the meta device; a change after that is refused
    (before sharding), not dropped."""
    from lightning_shard.init.meta_window import refuse_changes_after_recording

    with meta_construction():
        first = nn.Linear(2, 2)
    nn.init.ones_(first.weight)  # recorded: the recording is still open
    with meta_construction():
        nn.Linear(2, 2)  # the next model: the first one's recording ends
    refuse_changes_after_recording(first)
    nn.init.zeros_(first.bias)
    with pytest.raises(RuntimeError, match=r"\['bias'\] were changed on the meta device after their recording ended"):
        refuse_changes_after_recording(first)
