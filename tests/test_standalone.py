"""The standalone ``pytorch_lightning`` / ``lightning_fabric`` packages: ``lightning_shard.standalone`` holds the same
classes for them, loaded from the same source (``lightning_shard.standalone_packages``).

The 2-rank runs are the other tests' own scripts, run under ``pytorch_lightning`` by ``tests/standalone_run.py`` (their
imports renamed as Lightning renames its own): parity against the one-process reference (meta-device builds and
``trainer.init_module`` included), a sharded checkpoint round trip (resumed under both packages), and the memory
monitor's per-rank series in CSVLogger's and TensorBoard's files.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import lightning.pytorch
import lightning_fabric
import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_matches_reference, load, max_weight_diff, run_script
from pytorch_lightning.demos.boring_classes import BoringModel
from test_memory import assert_every_rank_logged, csv_memory_series, tensorboard_memory_series

import lightning_shard
from lightning_shard import standalone
from lightning_shard.standalone_packages.dependencies import framework_use

PARITY = ["full", "meta_init", "init_module_empty", "init_module"]
TOL = 1e-5


def run_standalone(script: str, *args: str) -> str:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STANDALONE_SCRIPT", script)
        return run_script("tests/standalone_run.py", *args, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("standalone")
    run_standalone("tests/parity_run.py", "--devices", "2", "--out", str(out / "two"), *PARITY)
    run_script("tests/parity_run.py", "--devices", "1", "--reference", "--out", str(out / "ref"), *PARITY)
    run_standalone("tests/checkpoint_run.py", "train", "--devices", "2", "--out", str(out / "train"))
    checkpoint = str(out / "train/model.ckpt")
    resume = ("resume", "--steps", "8", "--ckpt", checkpoint)
    run_standalone("tests/checkpoint_run.py", *resume, "--devices", "2", "--out", str(out / "resume_standalone"))
    run_script("tests/checkpoint_run.py", *resume, "--devices", "1", "--out", str(out / "resume_unified"))
    (out / "memory").mkdir()
    run_standalone("tests/test_memory.py", str(out / "memory"))
    return out


@pytest.mark.parametrize("scenario", PARITY)
def test_two_ranks_match_one_process_under_pytorch_lightning(runs: Path, scenario: str) -> None:
    results = {"two": runs / "two", "ref": runs / "ref"}
    assert_matches_reference(load(results, "two", scenario), load(results, "ref", scenario), TOL)


def test_checkpoint_round_trip_under_pytorch_lightning_and_across(runs: Path) -> None:
    saved = torch.load(runs / "train/result.pt", weights_only=False)["end"]
    # a pytorch_lightning checkpoint resumes under pytorch_lightning (2 ranks) and under lightning (1 rank)
    for resumed in ("resume_standalone", "resume_unified"):
        loaded = torch.load(runs / resumed / "result.pt", weights_only=False)
        assert max_weight_diff(loaded["start"]["weights"], saved["weights"]) == 0.0, resumed
        optimizer, saved_optimizer = loaded["start"]["optimizer"]["state"], saved["optimizer"]["state"]
        assert optimizer.keys() == saved_optimizer.keys(), resumed
        assert all(max_weight_diff(optimizer[name], saved_optimizer[name]) == 0.0 for name in optimizer), resumed
    resumed = {
        name: torch.load(runs / name / "result.pt", weights_only=False)
        for name in ("resume_standalone", "resume_unified")
    }
    assert resumed["resume_standalone"]["losses"] == pytest.approx(resumed["resume_unified"]["losses"], abs=TOL)


def test_memory_series_reach_the_loggers_under_pytorch_lightning(runs: Path) -> None:
    assert_every_rank_logged(csv_memory_series(runs / "memory"), steps=[2, 4])
    if (runs / "memory" / "tensorboard").exists():
        assert_every_rank_logged(tensorboard_memory_series(runs / "memory"), steps=[2, 4])


# ---------------------------------------------------------------------------------------------- no processes


def test_registry_names_and_classes_are_the_standalone_packages() -> None:
    for name in ("fully_sharded", "fully_sharded_grad_op", "fully_sharded_offload", "hybrid_sharded"):
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert type(trainer.strategy) is standalone.ShardedStrategy
        fabric = lightning_fabric.Fabric(strategy=name, accelerator="cpu", devices=2)
        assert type(fabric.strategy) is standalone.fabric.ShardedStrategy
    assert issubclass(standalone.ShardedStrategy, pl.strategies.ParallelStrategy)
    assert issubclass(standalone.ShardedCheckpointIO, lightning_fabric.plugins.CheckpointIO)
    for callback in (standalone.ShardedMemoryMonitor, standalone.PreemptionCheckpoint):
        assert issubclass(callback, pl.Callback)


def test_strategy_plugins_and_callbacks_are_accepted_by_a_pytorch_lightning_trainer() -> None:
    io = standalone.ShardedCheckpointIO()
    callbacks = [
        standalone.ShardedMemoryMonitor(),
        standalone.PreemptionCheckpoint(),
        pl.callbacks.EMAWeightAveraging(),
    ]
    trainer = pl.Trainer(
        strategy=standalone.ShardedStrategy(state_dict_type="full"),
        plugins=[io, standalone.ShardedPrecision("bf16-mixed")],
        callbacks=callbacks,
        accelerator="cpu",
        devices=2,
        logger=False,
    )
    assert trainer.strategy.checkpoint_io is io
    assert isinstance(trainer.strategy.precision_plugin, standalone.ShardedPrecision)
    assert all(callback in trainer.callbacks for callback in callbacks)
    # the strategy gives pytorch_lightning's EMA callback the sharded copy, as it gives lightning's
    averaging = importlib.import_module("lightning_shard.standalone.averaging.callbacks")
    averaging.shard_weight_averaging(callbacks)
    assert isinstance(callbacks[2], averaging.ShardedWeightAveraging)
    assert isinstance(callbacks[2], pl.callbacks.EMAWeightAveraging)


def test_lightning_cli_yaml_under_pytorch_lightning(tmp_path: Path) -> None:
    from pytorch_lightning.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n  devices: 2\n  logger: false\n"
        "  strategy:\n"
        "    class_path: lightning_shard.standalone.ShardedStrategy\n"
        "    init_args: {sharding_strategy: SHARD_GRAD_OP, auto_wrap_policy: [Block]}\n"
        "  callbacks:\n"
        "    - class_path: lightning_shard.standalone.ShardedMemoryMonitor\n"
        "      init_args: {log_every_n_steps: 3}\n"
    )
    cli = LightningCLI(pl.LightningModule, run=False, args=["--config", str(config)])
    assert type(cli.trainer.strategy) is standalone.ShardedStrategy
    assert cli.trainer.strategy.config.sharding_strategy == "SHARD_GRAD_OP"
    assert any(isinstance(callback, standalone.ShardedMemoryMonitor) for callback in cli.trainer.callbacks)


def test_mixing_the_packages_names_both_and_the_class_to_use(tmp_path: Path) -> None:
    unified_strategy = (
        r"for lightning\.pytorch \(with pytorch_lightning: lightning_shard\.standalone\.ShardedStrategy\)"
    )
    with pytest.raises(ValueError, match=unified_strategy):
        pl.Trainer(strategy=lightning_shard.ShardedStrategy(), accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"for pytorch_lightning \(with lightning\.pytorch: lightning_shard\.Sharded"):
        lightning.pytorch.Trainer(strategy=standalone.ShardedStrategy(), accelerator="cpu", devices=2)
    with pytest.raises(Exception, match=r"with lightning_fabric: lightning_shard\.standalone\.ShardedCheckpointIO"):
        pl.Trainer(plugins=[lightning_shard.ShardedCheckpointIO()], accelerator="cpu", devices=1)
    with pytest.raises(
        ValueError, match=r"with lightning_fabric: lightning_shard\.standalone\.fabric\.ShardedStrategy"
    ):
        lightning_fabric.Fabric(strategy=lightning_shard.fabric.ShardedStrategy(), accelerator="cpu", devices=1)
    # a callback for the other package reaches no Lightning check: the strategy refuses it before the run starts
    trainer = pl.Trainer(
        strategy="fully_sharded",
        callbacks=[lightning_shard.ShardedMemoryMonitor()],
        accelerator="cpu",
        devices=1,
        logger=False,
        default_root_dir=tmp_path,
    )
    expected = (
        r"lightning_shard\.ShardedMemoryMonitor is made for lightning\.pytorch, but this Trainer is pytorch_lightning's"
        r".* use lightning_shard\.standalone\.ShardedMemoryMonitor"
    )
    with pytest.raises(TypeError, match=expected):
        trainer.fit(BoringModel())


def torch_compat_modules() -> list[str]:
    return [
        f"lightning_shard.torch_compat.{p.stem}"
        for p in Path(lightning_shard.__file__).parent.glob("torch_compat/[!_]*.py")
    ]


def test_only_what_uses_lightning_exists_twice() -> None:
    analysis = framework_use()
    twice = analysis.modules_using_framework()
    # the sharding engine, the initialisation rule and their registries are shared
    shared = ("init.materialize", "plan.parallelize", "hf.init", "tensor_parallel.plan", "plan.wrap", "plan.config")
    for module in [*(f"lightning_shard.{name}" for name in shared), *torch_compat_modules()]:
        assert module in analysis.modules, f"{module} moved: name its new place here"
        assert module not in twice, module
    assert standalone.ShardingConfig is lightning_shard.ShardingConfig
    assert standalone.checkpoint.is_sharded_checkpoint is lightning_shard.is_sharded_checkpoint
    # one registry of the background saves in flight (it uses no Lightning): a load through either package waits for
    # the saves of both
    assert "lightning_shard.checkpoint.async_save" not in twice
    async_save = importlib.import_module("lightning_shard.standalone.checkpoint.async_save")
    assert async_save._SAVES_IN_FLIGHT is sys.modules["lightning_shard.checkpoint.async_save"]._SAVES_IN_FLIGHT
    # module state is mutated in place, never rebound, or the two namespaces' copies of a name would part
    for module in analysis.modules.values():
        nodes = [node for statement in module.statements for node in ast.walk(statement.node)]
        assert not any(isinstance(node, ast.Global) for node in nodes), module.name


def test_no_class_of_the_unified_package_in_the_standalone_namespace() -> None:
    """No class of the package reachable from ``lightning_shard.standalone`` derives from ``lightning``'s classes: the
    analysis missed no use of the framework (a shared class deriving from Lightning would be listed here)."""
    for name in framework_use().modules_using_framework():
        module = importlib.import_module(standalone.__name__ + name[len("lightning_shard") :])
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__.startswith("lightning_shard"):
                unified = [base for base in value.__mro__ if base.__module__.startswith("lightning.")]
                assert not unified, (module.__name__, value, unified)


def test_the_standalone_names_are_registered_whichever_is_imported_first() -> None:
    # A `lightning` program never loads the standalone packages; `lightning_fabric` imported after lightning_shard
    # gets the names (its import loads `lightning_shard.standalone`, through the hook `import lightning_shard` left).
    code = (
        "import sys, lightning_shard\n"
        "assert 'pytorch_lightning' not in sys.modules and 'lightning_shard.standalone' not in sys.modules\n"
        "import lightning_fabric\n"
        "fabric = lightning_fabric.Fabric(strategy='fully_sharded', accelerator='cpu', devices=2)\n"
        "strategy = type(fabric.strategy)\n"
        "print(strategy.__module__, issubclass(strategy, lightning_fabric.strategies.ParallelStrategy))\n"
    )
    assert run_script("-c", code).split()[-2:] == ["lightning_shard.standalone.fabric.strategy", "True"]


def test_the_supported_pytorch_lightning_range_is_pyprojects_lightning_range() -> None:
    from lightning_shard.standalone_packages.loader import SUPPORTED_LIGHTNING

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    low, high = SUPPORTED_LIGHTNING
    assert f'"lightning>={low},<{high}"' in pyproject
    assert f'"pytorch-lightning>={low},<{high}"' in pyproject
