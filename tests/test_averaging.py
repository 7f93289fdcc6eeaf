"""Weight averaging (EMA, SWA) for sharded models: Lightning's callbacks as users write them, and the Fabric form.

References: Lightning's own callbacks (``EMAWeightAveraging``, ``WeightAveraging`` and a docstring-style subclass)
under its single-device strategy on the whole global batch, against the same callback lines on 2 sharded ranks
(``tests/averaging_run.py``, one launch each): the averaged weights after every step, the validation losses computed
with them and the final weights agree within 1e-6 (measured: 2.4e-7). Under bf16 the two trajectories differ by bf16
rounding (``test_parity``: 2e-2), so the reference there is the callback's own update (torch's ``get_ema_avg_fn``,
in fp32) replayed on the run's recorded trained weights. Resuming is compared bit for bit with the uninterrupted run.
In-process tests (one rank) compare :class:`ShardedAveragedModel` with torch's ``AveragedModel`` for every kind of
averaging function, with and without buffers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import load, max_weight_diff, run_script
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

from lightning_shard.averaging import ShardedAveragedModel
from lightning_shard.averaging.averaged_model import averaged_placement
from lightning_shard.averaging.callbacks import (
    ShardedWeightAveraging,
    averaged_copy_place,
    averaged_models,
    restore_weight_averaging,
    shard_weight_averaging,
)
from lightning_shard.checkpoint import convert, read_sharded_keys
from lightning_shard.memory import estimate_main, estimate_memory
from lightning_shard.memory.auto_sharding import choose_sharding

TOL = 1e-6
SCRIPT = "tests/averaging_run.py"
COMPARED = ["ema", "custom", "swa"]  # against Lightning's own callbacks
TWO = [*COMPARED, "bf16_mixed", "bf16_true", "resume", "resume_full", "fabric"]
DECAY = 0.8
CHECKPOINT = "epoch=0-step=4.ckpt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("averaging")
    two, ref = out / "two", out / "ref"
    run_script(SCRIPT, "--devices", "2", "--out", str(two), *TWO, timeout=400)
    run_script(SCRIPT, "--devices", "1", "--reference", "--out", str(ref), "--from", str(two), *COMPARED, "resharded")
    return {"two": two, "ref": ref}


# ------------------------------------------------------------------ against Lightning's callbacks


@pytest.mark.parametrize("scenario", COMPARED)
def test_averaged_weights_match_lightnings_callback_after_every_step(runs: dict[str, Path], scenario: str) -> None:
    two, ref = load(runs, "two", scenario), load(runs, "ref", scenario)
    assert len(two["steps"]) == len(ref["steps"]) == 8
    for step, (ours, theirs) in enumerate(zip(two["steps"], ref["steps"], strict=True)):
        assert max_weight_diff(ours["averaged"], theirs["averaged"]) < TOL, f"step {step + 1}"
    assert [v["step"] for v in two["validations"]] == [v["step"] for v in ref["validations"]] == [2, 4, 6, 8]
    for ours, theirs in zip(two["validations"], ref["validations"], strict=True):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], abs=TOL)
    assert max_weight_diff(two["final"], ref["final"]) < TOL
    # Discriminating: the average is not the trained weights, and the final weights are the average.
    assert max_weight_diff(two["steps"][-1]["averaged"], two["steps"][-1]["trained"]) > 1e-3
    assert max_weight_diff(two["final"], two["steps"][-1]["averaged"]) == 0.0


def test_evaluating_a_checkpoint_evaluates_its_averaged_weights(runs: dict[str, Path]) -> None:
    # Lightning's callback writes the averaged weights as the checkpoint's `state_dict`; here they sit beside the
    # trained ones, and validate / test / predict from the checkpoint take them, with or without the callback.
    two, ref = load(runs, "two", "ema"), load(runs, "ref", "ema")
    assert two["val_from_checkpoint"] == two["validations"][-1]["val_loss"]
    assert two["val_from_checkpoint"] == pytest.approx(ref["val_from_checkpoint"], abs=TOL)


def test_the_model_is_built_by_the_strategy_not_copied_by_the_callback(runs: dict[str, Path]) -> None:
    # Lightning's callback calls `configure_model()` itself in `setup` and deep-copies the whole model; here the
    # strategy builds it on the meta device and the copy is made of the shards.
    assert load(runs, "ref", "ema")["built_on"] == "cpu"
    assert load(runs, "two", "ema")["built_on"] == "meta"
    # When the run ends the callback is the user's class again, ready for another Trainer.
    assert all(load(runs, "two", name)["class_after_fit"] for name in ("ema", "custom", "swa"))


@pytest.mark.parametrize(("scenario", "ratio"), [("ema", 1), ("bf16_mixed", 1), ("bf16_true", 2)])
def test_the_copy_is_fp32_and_sharded_like_the_parameters(runs: dict[str, Path], scenario: str, ratio: int) -> None:
    # fp32 shards: as large as this rank's parameter shards (fp32 masters), twice the bf16 ones under bf16-true
    run = load(runs, "two", scenario)
    assert run["averaged_bytes"] == ratio * run["model_bytes"]
    whole = 4 * sum(t.numel() for t in run["final"].values())
    assert whole / 2 <= run["averaged_bytes"] <= 1.1 * whole / 2
    assert all(t.dtype == torch.float32 for t in run["steps"][-1]["averaged"].values())


@pytest.mark.parametrize("scenario", ["ema", "custom", "bf16_mixed", "bf16_true"])
def test_validation_runs_with_the_averaged_weights_and_training_goes_on_with_its_own(
    runs: dict[str, Path], scenario: str
) -> None:
    run = load(runs, "two", scenario)
    for validation in run["validations"]:
        recorded = run["steps"][validation["step"] - 1]
        dtypes = {name: tensor.dtype for name, tensor in recorded["trained"].items()}
        swapped_in = {name: tensor.to(dtypes[name]) for name, tensor in recorded["averaged"].items()}
        assert max_weight_diff(validation["inside"], swapped_in) == 0.0
        assert max_weight_diff(validation["after"], recorded["trained"]) == 0.0  # never rounded through the average
    if "val_after_fit" in run:  # the final weights (the average) validated again give the logged loss
        assert run["val_after_fit"] == run["validations"][-1]["val_loss"]


@pytest.mark.parametrize("scenario", ["bf16_mixed", "bf16_true"])
def test_under_bf16_the_copy_is_the_fp32_average_of_the_trained_weights(runs: dict[str, Path], scenario: str) -> None:
    # EMAWeightAveraging's update (torch's get_ema_avg_fn) replayed in fp32 on the run's own trained weights
    run = load(runs, "two", scenario)
    ema, replayed = get_ema_avg_fn(DECAY), None
    for step, recorded in enumerate(run["steps"]):
        trained = {name: tensor.float() for name, tensor in recorded["trained"].items()}
        replayed = trained if replayed is None else {k: ema(replayed[k], trained[k], step) for k in trained}
        assert max_weight_diff(recorded["averaged"], replayed) < TOL, f"step {step + 1}"
    # bf16 increments would be lost: in a bf16 copy, most of the last update rounds away
    assert max_weight_diff({k: v.bfloat16() for k, v in replayed.items()}, replayed) > 1e-4


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("scenario", ["resume", "resume_full"])
def test_resuming_continues_the_uninterrupted_run_bit_for_bit(runs: dict[str, Path], scenario: str) -> None:
    resumed, whole = load(runs, "two", scenario), load(runs, "two", "ema")
    assert resumed["at_start"]["step"] == 4
    assert max_weight_diff(resumed["at_start"]["averaged"], whole["steps"][3]["averaged"]) == 0.0
    assert len(resumed["steps"]) == 4
    for ours, uninterrupted in zip(resumed["steps"], whole["steps"][4:], strict=True):
        assert max_weight_diff(ours["averaged"], uninterrupted["averaged"]) == 0.0
        assert max_weight_diff(ours["trained"], uninterrupted["trained"]) == 0.0
    assert max_weight_diff(resumed["final"], whole["final"]) == 0.0


def test_a_two_rank_checkpoint_resumes_on_one_rank(runs: dict[str, Path]) -> None:
    resharded, whole = load(runs, "ref", "resharded"), load(runs, "two", "ema")
    assert max_weight_diff(resharded["at_start"]["averaged"], whole["steps"][3]["averaged"]) == 0.0
    assert max_weight_diff(resharded["final"], whole["final"]) < TOL


def test_checkpoints_hold_the_averaged_copy_sharded_and_in_full_files(runs: dict[str, Path], tmp_path: Path) -> None:
    # bf16_mixed wrote full files, ema sharded directories; convert keeps the copy both ways.
    for scenario, path in (
        ("bf16_mixed", runs["two"] / "bf16_mixed" / CHECKPOINT),
        ("ema", runs["two"] / "ema" / CHECKPOINT),
    ):
        recorded = load(runs, "two", scenario)["steps"][3]
        if path.is_dir():
            convert(path, tmp_path / f"{scenario}.pt")
            path = tmp_path / f"{scenario}.pt"
        saved = torch.load(path, weights_only=False)
        assert saved["averaged_model"]["n_averaged"] == 4
        averaged = {k.removeprefix("module."): v for k, v in saved["averaged_model"].items() if k != "n_averaged"}
        assert max_weight_diff(averaged, recorded["averaged"]) == 0.0
        assert max_weight_diff(saved["state_dict"], recorded["trained"]) == 0.0
        # the full file is AveragedModel's state dict: torch's own class reads it
        assert "current_model_state" not in saved
        back = tmp_path / f"{scenario}-sharded.ckpt"
        convert(path, back)
        resharded = read_sharded_keys(back, {"averaged_model"})["averaged_model"]
        assert max_weight_diff(resharded, saved["averaged_model"]) == 0.0


def test_fabric_averaged_copy_trains_saves_and_resumes(runs: dict[str, Path]) -> None:
    run = load(runs, "two", "fabric")
    first, resumed = run["first"]["steps"], run["resumed"]["steps"]
    multi, replayed = get_ema_multi_avg_fn(DECAY), None
    for step, recorded in enumerate(first):
        if replayed is None:
            replayed = {name: tensor.clone() for name, tensor in recorded["trained"].items()}
        else:
            multi(list(replayed.values()), list(recorded["trained"].values()), step)
        assert max_weight_diff(recorded["averaged"], replayed) < TOL, f"step {step + 1}"
        assert max_weight_diff(recorded["inside"], recorded["averaged"]) == 0.0
        assert max_weight_diff(recorded["after"], recorded["trained"]) == 0.0
    assert len(resumed) == 4 and run["resumed"]["n_averaged"] == 8
    for ours, uninterrupted in zip(resumed, first[4:], strict=True):
        assert max_weight_diff(ours["averaged"], uninterrupted["averaged"]) == 0.0
        assert max_weight_diff(ours["trained"], uninterrupted["trained"]) == 0.0


# ------------------------------------------------------------------ ShardedAveragedModel against AveragedModel


def _batch_norm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def halfway(averaged: torch.Tensor, current: torch.Tensor, n_averaged: torch.Tensor) -> torch.Tensor:
    """A user's own averaging function: not torch's, so it runs tensor by tensor."""
    return (averaged + current) / 2


@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize(
    "averaging",
    [{}, {"avg_fn": get_ema_avg_fn(0.9)}, {"multi_avg_fn": get_ema_multi_avg_fn(0.9)}, {"avg_fn": halfway}],
    ids=["swa", "ema_avg_fn", "ema_multi_avg_fn", "own_avg_fn"],
)
def test_sharded_copy_matches_torch_averaged_model(mesh, averaging: dict[str, Any], use_buffers: bool) -> None:
    plain = _batch_norm_model()
    reference = AveragedModel(plain, use_buffers=use_buffers, **averaging)
    sharded = _batch_norm_model()
    for layer in (sharded[0], sharded[2], sharded):
        fully_shard(layer, mesh=mesh)
    averaged = ShardedAveragedModel(sharded, use_buffers=use_buffers, **averaging)
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    gathered = StateDictOptions(full_state_dict=True)
    for _ in range(4):
        sharded(torch.randn(16, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        averaged.update()
        plain.load_state_dict(get_model_state_dict(sharded, options=gathered))
        reference.update_parameters(plain)
        assert max_weight_diff(get_model_state_dict(averaged, options=gathered), reference.state_dict()) < TOL
    assert int(averaged.n_averaged) == 4
    # the state dict is AveragedModel's: torch's class loads it
    AveragedModel(_batch_norm_model(), use_buffers=use_buffers).load_state_dict(
        get_model_state_dict(averaged, options=gathered)
    )


def test_misuse_is_refused(mesh) -> None:
    model = fully_shard(_batch_norm_model(), mesh=mesh)
    averaged = ShardedAveragedModel(model)
    with pytest.raises(TypeError, match="swapped_in"):
        averaged(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="other than the one"):
        averaged.update_parameters(_batch_norm_model())
    with averaged.swapped_in():
        with pytest.raises(RuntimeError, match="swapped into the model"):
            averaged.update()
        with pytest.raises(RuntimeError, match="already"):
            averaged.swap_in()
    with pytest.raises(ValueError, match="not both"):
        ShardedAveragedModel(model, avg_fn=get_ema_avg_fn(), multi_avg_fn=get_ema_multi_avg_fn())


def test_where_the_copy_lives() -> None:
    gpu = torch.device("cuda", 1)  # a stand-in: nothing is allocated
    assert averaged_placement(None, gpu) == (gpu, False)
    assert averaged_placement("cpu", gpu) == (torch.device("cpu"), True)  # pinned: fast copies each step
    assert averaged_placement("cuda", gpu) == (gpu, False)
    assert averaged_placement(None, torch.device("cpu")) == (torch.device("cpu"), False)  # FSDP's CPU offload
    assert averaged_placement("cpu", torch.device("cpu")) == (torch.device("cpu"), False)


# ------------------------------------------------------------------ the callbacks, as users write them


class FromStep100(WeightAveraging):
    """Lightning's docstring example."""

    def __init__(self) -> None:
        super().__init__(avg_fn=get_ema_avg_fn())

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return (step_idx is not None) and (step_idx >= 100)


def test_the_users_callback_keeps_its_identity_name_state_key_and_methods() -> None:
    ema, own, plain = EMAWeightAveraging(decay=0.99, device="cpu"), FromStep100(), WeightAveraging()
    keys = [callback.state_key for callback in (ema, own, plain)]
    callbacks = [ema, own, plain]
    with pytest.raises(ValueError, match="Keep one"):
        shard_weight_averaging(callbacks)
    for callback in callbacks:
        shard_weight_averaging([callback])
    assert callbacks == [ema, own, plain]  # the same objects
    assert all(isinstance(callback, ShardedWeightAveraging) for callback in callbacks)
    assert [type(c).__name__ for c in callbacks] == ["EMAWeightAveraging", "FromStep100", "WeightAveraging"]
    assert [c.state_key for c in callbacks] == keys  # checkpoints written under DDP still match
    assert not own.should_update(step_idx=99) and own.should_update(step_idx=100)  # the user's method wins
    assert ema.should_update(step_idx=0) and ema._device == torch.device("cpu")
    assert averaged_copy_place([ema]) == "cpu" and averaged_copy_place([own]) == "device"
    assert averaged_models(callbacks) == {}  # copies exist from `on_fit_start` on
    shard_weight_averaging([ema])  # a second fit: nothing changes
    assert type(ema).__mro__.count(ShardedWeightAveraging) == 1
    restore_weight_averaging(callbacks)  # when the run ends
    assert [type(c) for c in callbacks] == [EMAWeightAveraging, FromStep100, WeightAveraging]


def test_stochastic_weight_averaging_is_refused_with_the_way_out() -> None:
    with pytest.raises(ValueError, match=r"WeightAveraging\(\)") as error:
        shard_weight_averaging([StochasticWeightAveraging(swa_lrs=0.01)])
    assert "SWALR" in str(error.value)


# ------------------------------------------------------------------ memory


def test_the_estimate_counts_the_averaged_copy_where_it_is_kept() -> None:
    n, ranks = 1_000_000, 4
    base = {"world_size": ranks, "precision": "bf16-mixed", "largest_unit_params": 0}
    without = estimate_memory(n, **base)
    beside = estimate_memory(n, **base, weight_averaging="device")
    assert beside.device.total_bytes - without.device.total_bytes == beside.device.averaged_weights == 4 * n // ranks
    offloaded = estimate_memory(n, **base, weight_averaging="cpu")
    assert offloaded.device == without.device and offloaded.cpu.averaged_weights == 4 * n // ranks
    assert estimate_memory(n, **base, cpu_offload=True, weight_averaging="device").cpu.averaged_weights == n
    # "auto": a copy beside the parameters can tip the choice towards more sharding
    settings = {"world_size": 2, "precision": "32-true", "activation_checkpointing": False, "can_offload": False}
    model = nn.Linear(1000, 1000)
    budget = int(estimate_memory(model, world_size=2, sharding_strategy="NO_SHARD").device.total_bytes / 0.7) + 1
    assert choose_sharding(model, **settings, device_memory_bytes=budget).sharding_strategy == "NO_SHARD"
    chosen = choose_sharding(model, **settings, device_memory_bytes=budget, weight_averaging="device")
    assert chosen.sharding_strategy != "NO_SHARD"
    assert choose_sharding(model, **settings, device_memory_bytes=budget, weight_averaging="cpu").sharding_strategy == (
        "NO_SHARD"
    )


def test_the_estimate_command_reads_the_callback_from_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "ema.yaml"
    model = "model:\n  class_path: torch.nn.Linear\n  init_args: {in_features: 64, out_features: 32}\n"
    per_rank = (64 * 32 + 32) * 4 // 2
    for callback, place in (("EMAWeightAveraging", "device"), ("lightning.pytorch.callbacks.WeightAveraging", "cpu")):
        device = "{device: cpu}" if place == "cpu" else "{decay: 0.99}"
        callbacks = f"  callbacks:\n  - class_path: {callback}\n    init_args: {device}\n"
        config.write_text(f"trainer:\n  devices: 2\n{callbacks}{model}")
        assert estimate_main(["--config", str(config), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[place]["averaged_weights"] == per_rank


# ------------------------------------------------------------------ export and sampling


def _checkpoint_with_a_copy(
    tmp_path: Path, weights: dict[str, torch.Tensor], prefix: str, **entries: Any
) -> tuple[Path, Path]:
    """A full and a sharded Trainer checkpoint holding ``weights``, an averaged copy of them (halved) and
    ``entries``."""
    checkpoint = {
        "state_dict": {prefix + name: tensor for name, tensor in weights.items()},
        "averaged_model": {
            **{"module." + prefix + name: tensor / 2 for name, tensor in weights.items()},
            "n_averaged": torch.tensor(3),
        },
        **entries,
    }
    full, sharded = tmp_path / "full.ckpt", tmp_path / "sharded.ckpt"
    torch.save(checkpoint, full)
    convert(full, sharded)
    return full, sharded


def test_export_hf_writes_the_trained_or_the_averaged_weights(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
    from hf_run import llama_config
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lightning_shard.cli import main as cli_main

    config = llama_config()
    config.save_pretrained(tmp_path / "config")
    weights = AutoModelForCausalLM.from_config(config).state_dict()
    for checkpoint in _checkpoint_with_a_copy(tmp_path, weights, "model."):
        for choice, expected in (("trained", 1.0), ("averaged", 0.5)):
            out = tmp_path / f"{checkpoint.stem}-{choice}"
            options = ["--weights", choice] if choice == "averaged" else []
            args = [
                "export-hf",
                str(checkpoint),
                str(out),
                "--config",
                str(tmp_path / "config"),
                "--dtype",
                "checkpoint",
            ]
            assert cli_main([*args, *options]) == 0
            written = load_file(out / "model.safetensors")
            assert set(written) <= set(weights)
            assert max_weight_diff(written, {k: weights[k] * expected for k in written}) == 0.0
    no_copy = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"model." + k: v for k, v in weights.items()}}, no_copy)
    args = [
        "export-hf",
        str(no_copy),
        str(tmp_path / "none"),
        "--config",
        str(tmp_path / "config"),
        "--weights",
        "averaged",
    ]
    assert cli_main(args) == 2


def test_generate_samples_from_either_weights(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning

    from examples.gpt.generate import load_gpt
    from examples.gpt.model import GPT

    model = GPT(n_layer=1, n_head=2, n_embd=16, vocab_size=256, block_size=16)
    model.configure_model()
    weights = model.state_dict()
    lightning_entries = {"hyper_parameters": dict(model.hparams), "pytorch-lightning_version": lightning.__version__}
    for checkpoint in _checkpoint_with_a_copy(tmp_path, weights, "", **lightning_entries):
        assert max_weight_diff(load_gpt(checkpoint).state_dict(), weights) == 0.0
        averaged = load_gpt(checkpoint, weights="averaged").state_dict()
        assert max_weight_diff(averaged, {name: tensor / 2 for name, tensor in weights.items()}) == 0.0
