"""``Fabric(strategy="fully_sharded")``: Fabric training loops on 2 ranks against plain Fabric on one process.

Three launches of ``tests/fabric_run.py`` serve every multi-process test but the example's (32 s at load average 2,
about 70 s at 6, on 2 cores): the 2-rank runs of all scenarios, the one-process reference (Fabric's single-device
strategy on the whole global batch), and one process on the strategy that resumes from the 2-rank run's checkpoints;
the example's two launches take 23 s more. Tolerance 1e-5 for
fp32 (measured: at most 1e-6 for losses, 3e-7 for weights); resumed runs and the Trainer -> Fabric continuation are
exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import assert_matches_reference, load, max_weight_diff, run_script
from fabric_run import ACCUMULATE, MAX_NORM, SAVE_AT, STEPS
from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import lightning_shard
from lightning_shard.fabric import ShardedPrecision, ShardedStrategy

TOL = 1e-5
SCENARIOS = ["gpt", "llama", "litgpt_sharded", "litgpt_full"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("fabric")
    # the 2-rank run first: it writes the litgpt starting weights the reference loads too
    run_script("tests/fabric_run.py", "--devices", "2", "--out", str(out / "two"), timeout=400)
    run_script("tests/fabric_run.py", "--devices", "1", "--reference", "--out", str(out / "ref"), timeout=200)
    run_script("tests/fabric_run.py", "--devices", "1", "--resume", str(out / "two"), "--out", str(out / "one"))
    return {"two": out / "two", "ref": out / "ref", "one": out / "one"}


# ---------------------------------------------------------------- training loops


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_match_one_process(runs: dict[str, Path], scenario: str) -> None:
    two, ref = load(runs, "two", scenario), load(runs, "ref", scenario)
    assert_matches_reference(two, ref, TOL)
    if "generated" in ref:  # the model's own `generate` after setup, called directly on every rank
        assert two["generated"] == ref["generated"]


def test_litgpt_starts_from_load_raw_and_resumes_exactly(runs: dict[str, Path]) -> None:
    for state_dict_type in ("sharded", "full"):
        two, ref = load(runs, "two", f"litgpt_{state_dict_type}"), load(runs, "ref", f"litgpt_{state_dict_type}")
        initial = torch.load(runs["two"].parent / "lit_model.pth")
        assert max_weight_diff(two["start"], initial) == 0.0  # `fabric.load_raw` replaced the init
        resumed = two["resumed"]
        # a fresh model and optimizer loaded the step-2 checkpoint: the same micro-batch losses from there on
        assert len(resumed["losses"]) == (STEPS - SAVE_AT) * ACCUMULATE
        assert resumed["losses"] == pytest.approx(two["losses"][-len(resumed["losses"]) :], abs=TOL)
        assert max_weight_diff(resumed["weights"], ref["weights"]) < TOL


def test_checkpoints_load_at_another_world_size(runs: dict[str, Path]) -> None:
    resumed = load(runs, "one", "resume")
    for state_dict_type in ("sharded", "full"):
        one, ref = resumed[f"litgpt_{state_dict_type}"], load(runs, "ref", f"litgpt_{state_dict_type}")
        assert one["losses"] == pytest.approx(ref["losses"][-len(one["losses"]) :], abs=TOL)
        assert max_weight_diff(one["weights"], ref["weights"]) < TOL


def test_no_backward_sync_follows_gradient_accumulation(runs: dict[str, Path]) -> None:
    # gradient_accumulation="unsharded": the first of 2 micro-batches keeps whole fp32 gradients (its reduce-scatter
    # skipped), the second reduce-scatters them; the litgpt loops ("sharded", the default) match the reference too.
    whole = 4 * sum(t.numel() for t in load(runs, "ref", "gpt")["weights"].values())
    held = load(runs, "two", "gpt")["held_unsharded_gradient_bytes"]
    assert held == [whole, 0] * STEPS


def test_clip_gradients_returns_the_global_norm(runs: dict[str, Path]) -> None:
    two, ref = load(runs, "two", "gpt"), load(runs, "ref", "gpt")
    assert two["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert min(two["norms"]) > MAX_NORM  # every step was clipped


def test_collectives(runs: dict[str, Path]) -> None:
    # (fabric.broadcast(rank + 7), fabric.all_reduce(rank + 1, "sum")) as ranks 0 and 1 saw them
    assert load(runs, "two", "gpt")["collectives"] == [(7, 3.0), (7, 3.0)]


@pytest.mark.parametrize(
    ("scenario", "compute", "stored", "tolerance"),
    [
        # against the fp32 losses over 8 micro-batches; measured on torch 2.13 / 2.11:
        ("bf16_mixed", "torch.bfloat16", "torch.float32", 2e-2),  # 1.2e-4 on both
        ("fp16_mixed", "torch.float16", "torch.float32", 2e-2),  # 1.8e-5 on both
        ("bf16_true", "torch.bfloat16", "torch.bfloat16", 5e-2),  # 2.9e-4 / 2.1e-2: every update rounded to bf16
    ],
)
def test_precision_strings_map_to_fsdp_mixed_precision(
    runs: dict[str, Path], scenario: str, compute: str, stored: str, tolerance: float
) -> None:
    run, fp32 = load(runs, "two", scenario), load(runs, "ref", "gpt")
    assert run["forward_dtypes"] == {"input": compute, "weight": compute}  # inside the FSDP unit
    assert run["stored_dtype"] == stored  # the sharded parameters the optimizer updates
    assert run["losses"] == pytest.approx(fp32["losses"], abs=tolerance)


def test_compile_per_block_survives_fabrics_whole_model_compile(runs: dict[str, Path]) -> None:
    # `torch.compile(model)` before `fabric.setup`: Fabric strips it and compiles the sharded model again after
    # setup. The strategy's per-block graph is what runs (both blocks share it); the whole-model compile captures
    # nothing, so the blocks are neither inlined into another graph nor compiled twice.
    run, ref = load(runs, "two", "compile"), load(runs, "ref", "gpt")
    assert (run["unit_graphs"], run["outer_graphs"]) == (1, 0)
    assert run["losses"] == pytest.approx(ref["losses"], abs=TOL)


# ---------------------------------------------------------------- checkpoints between the Trainer and Fabric


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_trainer_checkpoint_loads_into_fabric_and_back(runs: dict[str, Path], state_dict_type: str) -> None:
    run = load(runs, "two", "interop")[state_dict_type]
    # Fabric trained on from the Trainer's step-2 checkpoint (weights, AdamW states, the scheduler from the rest)
    assert run["fabric_losses"] == pytest.approx(run["trainer_losses"], abs=1e-6)
    assert max_weight_diff(run["fabric_weights"], run["trainer_weights"]) < 1e-6
    assert {"loops", "lr_schedulers", "global_step"} <= set(run["restored_rest"])
    # ... and the Trainer read the Fabric checkpoint back: on 2 ranks and on one
    assert max_weight_diff(run["back_weights"], run["fabric_weights"]) == 0.0
    one = load(runs, "one", "resume")[f"back_{state_dict_type}"]
    assert max_weight_diff(one, run["fabric_weights"]) == 0.0


def test_a_filtered_save_loads_non_strictly(runs: dict[str, Path]) -> None:
    filtered = load(runs, "one", "resume")["filtered"]
    saved, target, loaded = filtered["saved"], filtered["target"], filtered["loaded"]
    for name, value in loaded.items():
        expected = target[name] if ".h.0." in name else saved[name]  # left out of the checkpoint: kept
        assert torch.equal(value, expected), name
    assert "missing keys" in filtered["strict_error"] and "transformer.h.0." in filtered["strict_error"]


def test_damaged_or_mismatched_checkpoints_raise_before_loading(runs: dict[str, Path]) -> None:
    errors = load(runs, "one", "resume")["errors"]
    assert errors["truncated_shard"].startswith("CheckpointIntegrityError: Damaged checkpoint")
    assert "truncated shard file" in errors["truncated_shard"]
    assert errors["damaged_file"].startswith("CheckpointIntegrityError: Damaged checkpoint file")
    assert "does not fit the model" in errors["other_model"]
    assert "fabric.load(..., strict=False)" in errors["other_model"]
    assert errors["fit_from_fabric"].startswith("ValueError: The checkpoint")
    assert "trainer.validate(model, ckpt_path=...)" in errors["fit_from_fabric"]


# ---------------------------------------------------------------- construction (no processes)


def test_same_settings_and_fsdp1_translations_as_the_trainer_strategy() -> None:
    fsdp1 = {
        "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
        "auto_wrap_policy": ModuleWrapPolicy({nn.Linear}),
        "activation_checkpointing_policy": {nn.Linear},
        "cpu_offload": CPUOffload(offload_params=False),
        "state_dict_type": "full",
        "compile": {"fullgraph": True},
    }
    assert ShardedStrategy(**fsdp1).config == lightning_shard.ShardedStrategy(**fsdp1).config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"limit_all_gathers": True},
        {"mixed_precision": object()},
        {"sharding_strategy": "FULLY"},
        {"gradient_accumulation": 4},
        {"async_save": True, "state_dict_type": "full"},
        {"start_method": "thread"},
        {"cpu_offload": True, "sharding_strategy": "NO_SHARD"},
        {"not_a_setting": 1},
    ],
)
def test_bad_settings_raise_the_trainer_strategys_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(Exception) as trainer_error:
        lightning_shard.ShardedStrategy(**kwargs)
    with pytest.raises(type(trainer_error.value), match="^" + _escaped(str(trainer_error.value)) + "$"):
        ShardedStrategy(**kwargs)


def _escaped(message: str) -> str:
    import re

    return re.escape(message)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true"])
def test_fabric_precision_strings_become_the_shared_policy(precision: str) -> None:
    plugin = L.Fabric(strategy="fully_sharded", accelerator="cpu", devices=2, precision=precision).strategy.precision
    trainer = lightning_shard.ShardedPrecision(precision)
    assert isinstance(plugin, ShardedPrecision)
    assert (plugin.precision, plugin.param_dtype, plugin.mp_policy) == (
        trainer.precision,
        trainer.param_dtype,
        trainer.mp_policy,
    )


@pytest.fixture
def strategy(mesh) -> ShardedStrategy:  # noqa: ANN001  (conftest's one-rank process group)
    strategy = ShardedStrategy(parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment())
    strategy.accelerator = CPUAccelerator()
    strategy._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    return strategy


def test_an_optimizer_on_replaced_parameters_is_refused(strategy: ShardedStrategy) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # created before `setup_module`: sharding replaces them
    strategy.setup_module(model)
    with pytest.raises(
        ValueError, match=r"holds 4 parameters that sharding replaced.*fabric.setup\(model, optimizer\)"
    ):
        strategy.setup_optimizer(stale)
    strategy.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_setup_points_optimizers_at_the_sharded_parameters(strategy: ShardedStrategy) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}])
    model, (optimizer,), _ = strategy.setup_module_and_optimizers(model, [optimizer])
    assert [list(group["params"]) for group in optimizer.param_groups] == [
        list(model[0].parameters()),
        list(model[1].parameters()),
    ]
    stepped = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    stepped.state[stepped.param_groups[0]["params"][0]] = {"momentum_buffer": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="has state already"):
        strategy.setup_module_and_optimizers(nn.Linear(2, 2), [stepped])
    with pytest.raises(ValueError, match="holds a parameter that is not the model's"):
        strategy.setup_module_and_optimizers(nn.Linear(2, 2), [torch.optim.SGD(nn.Linear(2, 2).parameters())])


# ---------------------------------------------------------------- the example


def test_fabric_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    small = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4"]
    small += ["--max-bytes", "50000", "--log-every", "1", "--save-every", "3", "--out", str(tmp_path)]
    first = run_script("examples/fabric/train.py", "--max-steps", "6", *small, timeout=240)
    losses = [float(line.split()[-1]) for line in first.splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert "--- sample ---" in first
    assert (tmp_path / "last.ckpt" / ".metadata").is_file()  # sharded, written at steps 3 and 6
    resumed = run_script(
        "examples/fabric/train.py", "--max-steps", "8", "--resume", str(tmp_path / "last.ckpt"), *small
    )
    assert "resumed from" in resumed and "at step 6" in resumed
    assert [line.split()[1] for line in resumed.splitlines() if line.startswith("step ")] == ["7", "8"]
