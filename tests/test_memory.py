"""Tests for lightning_shard.memory: the per-rank monitor on 2 CPU ranks, the estimator, and the estimate CLI.

Run as a script, this file is the 2-rank training job (Lightning's launcher re-runs it for rank 1).
"""

import csv
import importlib.util
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_shard.memory import estimate_main, estimate_memory, format_estimate_table
from lightning_shard.memory.accounting import gradient_bytes, optimizer_state_bytes, parameter_bytes
from lightning_shard.memory.transformer_sizes import gpt_parameter_count

MLP_WIDTH = 512
MLP_DEPTH = 4  # 4 x (512 x 512 + 512) = 1,050,624 parameters
TRAIN_STEPS = 4
GIB = 2**30
MEMORY_METRICS = ("params_bytes", "grads_bytes", "optimizer_bytes", "rss_bytes", "peak_rss_bytes")


def _mlp() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(MLP_WIDTH, MLP_WIDTH) for _ in range(MLP_DEPTH)))


def _train_two_ranks(out_dir: Path) -> None:
    """Fit the MLP with ShardedStrategy (every Linear and the root under fully_shard) on 2 gloo ranks."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard import ShardedStrategy
    from lightning_shard.memory import ShardedMemoryMonitor

    class ShardedMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    monitor = ShardedMemoryMonitor(log_every_n_steps=2, output_dir=out_dir / "memory")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardedStrategy(sharding_strategy="FULL_SHARD"),
        max_steps=TRAIN_STEPS,
        callbacks=[monitor],
        logger=[CSVLogger(out_dir, name="logs", version=0)]
        + ([TensorBoardLogger(out_dir, name="tensorboard", version=0)] if _has_tensorboard() else []),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(64, MLP_WIDTH)), batch_size=8)
    trainer.fit(ShardedMLP(), data)
    if trainer.is_global_zero:
        (out_dir / "history.json").write_text(json.dumps(monitor.history))


def _has_tensorboard() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def csv_memory_series(out_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The ``memory/rank{r}/{metric}`` series CSVLogger wrote to ``metrics.csv``: (step, value) pairs by tag."""
    with open(out_dir / "logs" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    tags = [tag for tag in rows[0] if tag.startswith("memory/")]
    return {tag: [(int(row["step"]), float(row[tag])) for row in rows if row[tag]] for tag in tags}


def tensorboard_memory_series(out_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The same series as TensorBoardLogger wrote them to its event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tensorboard" / "version_0"))
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag.startswith("memory/")]
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in tags}


def assert_every_rank_logged(series: dict[str, list[tuple[int, float]]], steps: list[int]) -> None:
    for rank in (0, 1):
        for metric in MEMORY_METRICS:
            logged = series[f"memory/rank{rank}/{metric}"]
            assert [step for step, _ in logged] == steps and all(value > 0 for _, value in logged), (rank, metric)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out_dir = tmp_path_factory.mktemp("two_ranks")
    result = subprocess.run(
        [sys.executable, __file__, str(out_dir)], capture_output=True, text=True, timeout=180, cwd=out_dir
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out_dir, result.stdout


def test_measured_model_states_match_formula_within_10_percent(two_rank_run: tuple[Path, str]) -> None:
    out_dir, _ = two_rank_run
    last = json.loads((out_dir / "history.json").read_text())[-1]
    assert last["step"] == TRAIN_STEPS
    estimate = estimate_memory(_mlp(), world_size=2, sharding_strategy="FULL_SHARD", precision="32-true")
    expected = estimate.per_rank
    assert len(last["ranks"]) == 2
    for measured in last["ranks"]:
        assert measured["params_bytes"] == pytest.approx(expected.params, rel=0.10)
        assert measured["grads_bytes"] == pytest.approx(expected.grads, rel=0.10)
        assert measured["optimizer_bytes"] == pytest.approx(expected.optimizer_states, rel=0.10)
        total = measured["params_bytes"] + measured["grads_bytes"] + measured["optimizer_bytes"]
        assert total == pytest.approx(expected.params + expected.grads + expected.optimizer_states, rel=0.10)
        assert measured["peak_rss_bytes"] >= measured["rss_bytes"] > 0


def test_every_rank_is_logged_and_reported(two_rank_run: tuple[Path, str]) -> None:
    out_dir, stdout = two_rank_run
    assert_every_rank_logged(csv_memory_series(out_dir), steps=[2, 4])

    table = stdout[stdout.index("Per-rank memory at step 4") :].splitlines()
    assert table[1].split()[:3] == ["rank", "params", "(MiB)"]
    assert [line.split()[0] for line in table[2:4]] == ["0", "1"]

    history = json.loads((out_dir / "memory" / "memory.json").read_text())
    assert history["world_size"] == 2
    assert [sample["step"] for sample in history["ranks"]["1"]] == [2, 4]
    assert (out_dir / "memory" / "memory.csv").read_text().startswith("step,rank,params_bytes")
    assert (out_dir / "memory" / "memory.svg").read_text().count("<polyline") == 2 * len(MEMORY_METRICS)
    assert f"memory plot written to {out_dir / 'memory' / 'memory.svg'}" in stdout


@pytest.mark.skipif(not _has_tensorboard(), reason="needs tensorboard (the test extra)")
def test_every_rank_reaches_tensorboard(two_rank_run: tuple[Path, str]) -> None:
    out_dir, _ = two_rank_run
    series = tensorboard_memory_series(out_dir)
    assert_every_rank_logged(series, steps=[2, 4])
    for tag, logged in csv_memory_series(out_dir).items():  # the same values as the CSV file's (float32 here)
        assert [step for step, _ in series[tag]] == [step for step, _ in logged]
        assert [value for _, value in series[tag]] == pytest.approx([value for _, value in logged], rel=1e-6)


def test_accounting_counts_local_storage_once_for_plain_tensors() -> None:
    layer = nn.Linear(8, 4)  # 36 fp32 parameters
    assert parameter_bytes(layer.parameters()) == 36 * 4
    assert gradient_bytes(layer.parameters()) == 0  # no backward yet
    layer(torch.randn(2, 8)).sum().backward()
    assert gradient_bytes(layer.parameters()) == 36 * 4
    flat = torch.zeros(10)
    assert parameter_bytes([flat[:5], flat[5:], flat]) == 40  # views share one storage
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()
    assert optimizer_state_bytes([optimizer]) == 36 * 4  # one momentum buffer per parameter


def test_13b_on_8_ranks_sits_between_published_figures() -> None:
    # GPT-3 13B (fairseq transformer_lm_gpt3_13: 40 layers, width 5140, 40 heads) with the GPT-2 vocabulary.
    n_params, largest_unit = gpt_parameter_count(n_layer=40, n_embd=5140, vocab_size=50257, block_size=2048)
    estimate = estimate_memory(n_params, world_size=8, precision="bf16-mixed", largest_unit_params=largest_unit)
    device = estimate.device
    model_states = device.params + device.grads + device.optimizer_states
    # ZeRO paper (Rajbhandari et al. 2019): 16 bytes/parameter for mixed-precision Adam, divided over N ranks.
    assert model_states == pytest.approx(16 * n_params / 8, rel=0.01)
    # DeepSpeed's ZeRO-3 estimator without offload: 18 bytes/parameter / N + 4 bytes x largest layer.
    deepspeed = 18 * n_params / 8 + 4 * largest_unit
    assert 16 * n_params / 8 < device.total_bytes < deepspeed
    assert 24 * GIB < device.total_bytes < 28.5 * GIB
    # The docstring's worked example: 16 B x 13.1e9 / 8 is about 24.4 GiB of model states.
    rounded = estimate_memory(13_100_000_000, world_size=8, precision="bf16-mixed", largest_unit_params=0)
    assert rounded.device.total_bytes / GIB == pytest.approx(24.4, abs=0.05)


def test_offload_checkpointing_and_strategies_move_memory_where_expected() -> None:
    dims = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 1000, "seq_len": 128, "micro_batch_size": 2}
    n_params = gpt_parameter_count(4, 256, 1000, 128)[0]
    full = estimate_memory(n_params, world_size=4, **dims)
    offloaded = estimate_memory(n_params, world_size=4, cpu_offload=True, **dims)
    checkpointed = estimate_memory(n_params, world_size=4, activation_checkpointing=True, **dims)
    unsharded = estimate_memory(n_params, world_size=4, sharding_strategy="NO_SHARD", **dims)
    hybrid = estimate_memory(n_params, world_size=4, num_nodes=2, sharding_strategy="HYBRID_SHARD", **dims)
    assert offloaded.cpu.optimizer_states == full.device.optimizer_states and offloaded.device.optimizer_states == 0
    assert checkpointed.device.activations < full.device.activations
    assert unsharded.device.params == 4 * full.device.params
    assert hybrid.device.params == 2 * full.device.params
    table = format_estimate_table(n_params, world_size=4, **dims).splitlines()
    assert len(table) == 2 + 4 * 2 * 2


def test_simulated_step_matches_formula_model_states() -> None:
    simulated = estimate_memory(_mlp, mode="simulate", world_size=4, input_fn=partial(torch.randn, 8, MLP_WIDTH))
    formula = estimate_memory(_mlp(), world_size=4)
    assert simulated.n_params == formula.n_params == MLP_DEPTH * (MLP_WIDTH**2 + MLP_WIDTH)
    assert simulated.device.params == formula.device.params
    assert simulated.device.optimizer_states == pytest.approx(formula.device.optimizer_states, rel=0.01)
    assert simulated.device.total_bytes > simulated.device.params + simulated.device.optimizer_states


def test_estimate_cli_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "trainer:\n  devices: 2\n  precision: bf16-mixed\n"
        "  strategy:\n    class_path: lightning_shard.ShardedStrategy\n"
        "    init_args: {sharding_strategy: FULL_SHARD, cpu_offload: false}\n"
        "model:\n  class_path: torch.nn.Linear\n  init_args: {in_features: 64, out_features: 32}\n"
    )
    assert estimate_main(["--config", str(config), "--devices", "4", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["n_params"] == 64 * 32 + 32
    per_rank = payload["per_rank"]
    assert set(per_rank) == {
        "total_bytes",
        "params",
        "grads",
        "accumulated_grads",
        "optimizer_states",
        "gathered_peak",
        "activations",
        "averaged_weights",
    }
    assert payload["device"]["total_bytes"] + payload["cpu"]["total_bytes"] == per_rank["total_bytes"]
    assert per_rank["total_bytes"] == sum(v for k, v in per_rank.items() if k != "total_bytes")
    assert per_rank["params"] == (64 * 32 + 32) * 4 // 4  # fp32 shards over 4 ranks


def test_whole_gradients_kept_between_micro_batches_are_counted_on_the_device() -> None:
    n = 1_000_000
    settings = {"world_size": 4, "precision": "bf16-mixed", "largest_unit_params": 0}
    sharded = estimate_memory(n, **settings, accumulate_grad_batches=8)
    unsharded = estimate_memory(n, **settings, accumulate_grad_batches=8, gradient_accumulation="unsharded")
    one_micro_batch = estimate_memory(n, **settings, accumulate_grad_batches=1, gradient_accumulation="unsharded")
    assert sharded.device == one_micro_batch.device == estimate_memory(n, **settings).device
    assert sharded.device.accumulated_grads == 0 and sharded.device.grads == n * 4 // 4
    # whole fp32 gradients on every rank; the sharded ones do not exist meanwhile
    assert unsharded.device.accumulated_grads == 4 * n and unsharded.device.grads == 0
    assert unsharded.device.total_bytes - sharded.device.total_bytes == 4 * n - n
    # with offload the whole gradients stay on the device (they belong to the gathered parameters), the sharded
    # ones are on the host
    offloaded = estimate_memory(
        n, **settings, cpu_offload=True, accumulate_grad_batches=8, gradient_accumulation="unsharded"
    )
    assert offloaded.device.accumulated_grads == 4 * n and offloaded.cpu.grads == n
    with pytest.raises(ValueError, match="gradient_accumulation.*'whole'"):
        estimate_memory(n, gradient_accumulation="whole")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="accumulate_grad_batches must be at least 1, got 0"):
        estimate_memory(n, accumulate_grad_batches=0)


def test_estimate_cli_reads_accumulation_from_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "accumulate.yaml"
    body = (
        "trainer:\n  devices: 2\n  accumulate_grad_batches: 4\n"
        "  strategy:\n    class_path: lightning_shard.ShardedStrategy\n    init_args: {GA}\n"
        "model:\n  class_path: torch.nn.Linear\n  init_args: {in_features: 64, out_features: 32}\n"
    )
    n_params = 64 * 32 + 32
    accumulated = {}
    for setting in ("{}", "{gradient_accumulation: unsharded}"):
        config.write_text(body.replace("{GA}", setting))
        assert estimate_main(["--config", str(config), "--json"]) == 0
        accumulated[setting] = json.loads(capsys.readouterr().out)["device"]["accumulated_grads"]
    assert accumulated == {"{}": 0, "{gradient_accumulation: unsharded}": 4 * n_params}
    # the command line overrides the strategy's setting
    assert estimate_main(["--config", str(config), "--json", "--gradient-accumulation", "sharded"]) == 0
    assert json.loads(capsys.readouterr().out)["device"]["accumulated_grads"] == 0


def test_shipped_13b_configs_fit_their_devices(capsys: pytest.CaptureFixture[str]) -> None:
    # 8 GPUs: accumulating 64 micro-batches sharded leaves the per-rank total of model states, gathered units and
    # activations (29.9 GiB) well within an 80 GiB GPU; whole gradients would add 48 GiB less the 6 sharded.
    assert estimate_main(["--config", "configs/gpt3_13b.yaml", "--devices", "8", "--json"]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert eight["device"]["accumulated_grads"] == 0
    assert 29 * GIB < eight["device"]["total_bytes"] < 31 * GIB
    # one GPU with offload: the host holds the 16 bytes per parameter, the device a few GiB
    assert estimate_main(["--config", "configs/gpt3_13b_1gpu_offload.yaml", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["cpu"]["total_bytes"] == 16 * one["n_params"]
    assert one["device"]["total_bytes"] < 6 * GIB and one["device"]["accumulated_grads"] == 0


def _gpt(**dims: int) -> nn.Module:
    from examples.gpt.model import GPT

    model = GPT(**dims)
    model.configure_model()
    return model


def test_simulate_cli_matches_the_formula_with_whole_gradients(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small GPT trained for two steps under fake tensors, 4 micro-batches accumulated whole, bf16-mixed (FSDP2
    # upcasts the whole gradients to fp32 between micro-batches).
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the model class is imported from examples/
    config = tmp_path / "gpt.yaml"
    config.write_text(
        "trainer:\n  devices: 4\n  precision: bf16-mixed\n  accumulate_grad_batches: 4\n"
        "  strategy:\n    class_path: lightning_shard.ShardedStrategy\n"
        "    init_args: {gradient_accumulation: unsharded, activation_checkpointing: [Block]}\n"
        "model:\n  class_path: examples.gpt.model.GPT\n"
        "  init_args: {n_layer: 2, n_head: 4, n_embd: 128, vocab_size: 512, block_size: 128}\n"
        "data:\n  batch_size: 8\n"
    )
    assert estimate_main(["--config", str(config), "--mode", "simulate", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    formula, simulated = payload["formula"]["device"], payload["simulated"]["device"]
    n_params = payload["n_params"]
    assert simulated["accumulated_grads"] == formula["accumulated_grads"] == 4 * n_params
    for category in ("params", "grads", "optimizer_states"):
        assert simulated[category] == pytest.approx(formula[category], rel=0.01), category
    model_states = sum(formula[c] for c in ("params", "grads", "accumulated_grads", "optimizer_states"))
    # the formula adds every activation and three gathered units at once: an upper bound of the simulated peak
    assert model_states < simulated["total_bytes"] <= formula["total_bytes"]


def test_simulating_a_model_too_big_for_this_machine_allocates_no_real_storage() -> None:
    # 2.0e9 parameters (8 GB in fp32 whole; 16 GB of parameters, gradients and AdamW states per rank on 2 ranks)
    dims = {"n_layer": 2, "n_head": 64, "n_embd": 8192, "vocab_size": 50272, "block_size": 64}
    simulated = estimate_memory(
        partial(_gpt, **dims), mode="simulate", world_size=2, input_fn=partial(torch.randint, 0, 50272, (1, 64))
    )
    assert simulated.n_params > 2e9
    assert simulated.device.total_bytes > 16e9
    assert simulated.simulation is not None
    # the simulating process's peak RSS: the interpreter, torch and fake tensors only
    assert simulated.simulation["peak_rss_bytes"] < 1.5 * GIB < simulated.n_params * 4 / 5


def test_estimate_cli_falls_back_to_gpt_formula(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "gpt.yaml"
    config.write_text(
        "trainer: {devices: 8, num_nodes: 2, precision: bf16-mixed}\n"
        "model: {n_layer: 2, n_head: 2, n_embd: 64, vocab_size: 256, block_size: 32}\n"
    )
    assert estimate_main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{gpt_parameter_count(2, 64, 256, 32)[0]:,} parameters on 16 ranks (2 node(s))")
    assert "HYBRID_SHARD" in out
    assert estimate_main(["--config", str(tmp_path / "missing.yaml")]) == 2


if __name__ == "__main__":
    _train_two_ranks(Path(sys.argv[1]))
