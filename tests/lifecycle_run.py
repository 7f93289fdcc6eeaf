"""Lifecycle and buffers on 2 gloo ranks, in one torchrun launch: ``python -m torch.distributed.run --nproc_per_node=2
tests/lifecycle_run.py``. Prints ``RESULT <json>`` (rank 0).

Lifecycle: runs of every kind one after another in the same processes - fits, a fit that fails, a second fit on the
same Trainer, validate / test / predict in any order, a second Trainer and a second Fabric on a model sharded
already, ``preemptible()`` blocks, compile under an ``activation_memory_budget`` - each between two snapshots of
what outlives a run (:func:`snapshot`): what changed is reported per run, and must be nothing.

Buffers: a small ResNet-like CNN with BatchNorm trained 4 steps under Lightning's DDP and under the sharded strategy
from the same weights on the same batches: per-rank losses, validation losses, final weights and buffers, the
buffers across ranks, and the buffers a sharded checkpoint holds.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy import FULL, QUIET, ToyModel, outcome, rank_slice_loader  # noqa: E402

from lightning_shard import ShardedStrategy  # noqa: E402
from lightning_shard.core.buffers import broadcast_buffers  # noqa: E402
from lightning_shard.fabric import ShardedStrategy as FabricShardedStrategy  # noqa: E402

# Lightning itself gives every callback the module's `log` and `log_dict` in each run.
LIGHTNINGS_OWN = {"log", "log_dict"}
CATCHABLE = sorted(set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}, key=int)


def snapshot(*objects: Any) -> dict[str, str]:
    """What a run may change that outlives it: signal handlers, torch's process-wide settings, process groups,
    Python threads, and - on each of ``objects`` (Lightning's) - the class and the instance attributes that hold
    callables (patched methods) or flags."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch.distributed.distributed_c10d import _world

    state = {
        "signal handlers": repr({int(signum): signal.getsignal(signum) for signum in CATCHABLE}),
        "functorch config": repr(functorch_config.get_config_copy()),
        "dynamo config": repr(dynamo_config.get_config_copy()),
        "process groups": repr(len(_world.pg_map)),
        "threads": repr(sorted(thread.name for thread in threading.enumerate())),
        "torch modes": repr((torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())),
    }
    for index, obj in enumerate(objects):
        patched = {
            k: repr(v)
            for k, v in vars(obj).items()
            if callable(v) and not isinstance(v, (nn.Module, type)) and k not in LIGHTNINGS_OWN
        }
        flags = {k: v for k, v in vars(obj).items() if k == "inference_mode"}
        state[f"{index}:{type(obj).__name__}"] = repr((type(obj), patched, flags))
    return state


def lightning_objects(trainer: L.Trainer) -> list[Any]:
    loops = [trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop]
    return [trainer._signal_connector, *trainer.callbacks, *loops, trainer.predict_loop]


def changed(before: dict[str, str], after: dict[str, str]) -> dict[str, list[str]]:
    return {
        key: [before.get(key, ""), after.get(key, "")]
        for key in before.keys() | after.keys()
        if before.get(key) != after.get(key)
    }


class EvaluatedToy(ToyModel):
    test_step = ToyModel.validation_step


def trainer(strategy: Any = None, **kwargs: Any) -> L.Trainer:
    settings = {**QUIET, "enable_checkpointing": True, "accelerator": "cpu", "devices": 2, "max_steps": 2}
    return L.Trainer(strategy=strategy or ShardedStrategy(), **{**settings, **kwargs})


def attempt(run: Any) -> str | None:
    """Run ``run()``; its error as text, or None."""
    result = outcome(run)
    return None if result == "ok" else result


def lifecycle(tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    model = EvaluatedToy()
    saver = ModelCheckpoint(dirpath=tmp / "ckpts", every_n_train_steps=1, save_last="link")
    first = trainer(ShardedStrategy(async_save=True), callbacks=[saver], default_root_dir=tmp)
    objects = lightning_objects(first)

    def run(name: str, action: Any, *extra: Any) -> None:
        before = snapshot(*objects, *extra)
        error = attempt(action)
        results[name] = {"error": error, "changed": changed(before, snapshot(*objects, *extra))}

    loader = rank_slice_loader(8)
    run("fit", lambda: first.fit(model, loader))
    run("fit with a wrong ckpt_path", lambda: first.fit(model, loader, ckpt_path=str(tmp / "missing.ckpt")))
    first.fit_loop.epoch_loop.max_steps = 4
    run("fit again after the failed fit", lambda: first.fit(model, loader))
    results["steps after the second fit"] = first.global_step
    for stage in ("validate", "predict", "test", "validate"):
        run(f"{stage} after fit", lambda stage=stage: getattr(first, stage)(model, loader))

    evaluating = trainer(default_root_dir=tmp)  # evaluation first, then fit, on a fresh model
    fresh = EvaluatedToy()
    objects = lightning_objects(evaluating)
    for stage in ("predict", "test", "validate", "fit", "predict"):
        run(f"{stage} on a fresh model", lambda stage=stage: getattr(evaluating, stage)(fresh, loader))

    hybrid = trainer(ShardedStrategy(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=1))
    hybrid_model = EvaluatedToy()
    hybrid.fit(hybrid_model, loader)  # its 2-D mesh's process groups live as long as the sharded model
    objects = lightning_objects(hybrid)
    hybrid.fit_loop.epoch_loop.max_steps = 4
    run("fit again on a 2-D mesh", lambda: hybrid.fit(hybrid_model, loader))
    run("validate on a 2-D mesh", lambda: hybrid.validate(hybrid_model, loader))

    other = trainer(ShardedStrategy(activation_checkpointing=[nn.Linear]), precision="bf16-mixed")
    objects = lightning_objects(other)
    run("a second Trainer with other settings", lambda: other.fit(model, loader))
    same = trainer(ShardedStrategy())
    objects = lightning_objects(same)
    run("a second Trainer with the same settings", lambda: same.validate(model, loader))

    compiled = trainer(ShardedStrategy(compile={"backend": "eager"}, activation_memory_budget=0.5))
    objects = lightning_objects(compiled)
    budgets: list[float] = []

    class Budget(L.Callback):
        def on_validation_start(self, *args: Any) -> None:
            budgets.append(torch._functorch.config.activation_memory_budget)

    compiled.callbacks.append(Budget())
    run("validate compiled under a memory budget", lambda: compiled.validate(EvaluatedToy(), loader))
    results["memory budget during the run"] = budgets

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricShardedStrategy())
    fabric.launch()
    objects = []
    fabric_model = EvaluatedToy()
    optimizer = torch.optim.SGD(fabric_model.parameters(), lr=0.01)
    fabric_model, optimizer = fabric.setup(fabric_model, optimizer)

    def preemptible_blocks() -> None:
        for step in range(5):
            with fabric.strategy.preemptible() as preemption:
                x, y = next(iter(loader))
                fabric.backward(nn.functional.mse_loss(fabric_model(x), y))
                optimizer.step()
                preemption.step_end(tmp / "fabric.ckpt", {"model": fabric_model, "step": step})

    run("five preemptible() blocks", preemptible_blocks)
    other_fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricShardedStrategy(), precision="bf16-mixed")
    run("a second Fabric with other settings", lambda: (other_fabric.launch(), other_fabric.setup(fabric_model.module)))
    return results


class ResNetLike(L.LightningModule):
    """Stem, two residual blocks (conv-BN-ReLU-conv-BN plus the input), pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(8, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.Conv2d(8, 8, 3, padding=1),
                nn.BatchNorm2d(8),
            )
            for _ in range(2)
        )
        self.head = nn.Linear(8, 4)
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = torch.relu(h + block(h))
        return self.head(h.mean((2, 3)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_losses.append(nn.functional.cross_entropy(self(batch[0]), batch[1]).item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def images() -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    # Each rank's batches differ in scale, so that their BatchNorm statistics differ clearly.
    x = torch.randn(32, 3, 8, 8, generator=generator) * torch.arange(1, 33).view(32, 1, 1, 1) / 8
    return DataLoader(TensorDataset(x, torch.randint(0, 4, (32,), generator=generator)), batch_size=4)


# 4 steps, then a validation of 2 batches; each rank its own samples.
BATCHNORM_RUN = {"max_steps": 4, "val_check_interval": 4, "limit_val_batches": 2, "num_sanity_val_steps": 0,
                 "use_distributed_sampler": True, "enable_checkpointing": False}  # fmt: skip


def buffers_against_ddp(tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, strategy in (("ddp", "ddp"), ("sharded", ShardedStrategy())):
        L.seed_everything(0, verbose=False)
        model = ResNetLike()
        run = trainer(strategy, **BATCHNORM_RUN)
        run.fit(model, images(), images())
        module = run.lightning_module
        weights = get_model_state_dict(module, options=FULL) if name == "sharded" else module.state_dict()
        local_buffers = {key: value.clone() for key, value in module.named_buffers()}
        everyone: list[Any] = [None] * dist.get_world_size()
        layers = sorted({type(layer).__name__ for layer in module.modules() if "BatchNorm" in type(layer).__name__})
        ours = {"losses": model.losses, "val": model.val_losses, "buffers": local_buffers, "layers": layers}
        dist.all_gather_object(everyone, ours)
        results[name] = {"weights": {k: v.clone() for k, v in weights.items()}, "ranks": everyone}
        if name == "sharded":
            path = str(tmp / "bn.ckpt")
            run.save_checkpoint(path)
            if dist.get_rank() == 0:
                dcp_to_torch_save(path, tmp / "bn.pt")
                results["checkpoint"] = torch.load(tmp / "bn.pt", weights_only=False)["state_dict"]
    if dist.get_rank() != 0:
        return {}  # the full weights and the checkpoint are on rank 0
    ddp, sharded = results["ddp"], results["sharded"]
    rank0 = sharded["ranks"][0]["buffers"]
    return {
        "loss differences": [
            max(abs(a - b) for a, b in zip(d["losses"], s["losses"], strict=True))
            for d, s in zip(ddp["ranks"], sharded["ranks"], strict=True)
        ],
        "validation loss differences": [
            max(abs(a - b) for a, b in zip(d["val"], s["val"], strict=True))
            for d, s in zip(ddp["ranks"], sharded["ranks"], strict=True)
        ],
        "steps": len(sharded["ranks"][0]["losses"]),
        "weight and buffer difference": _max_difference(ddp["weights"], sharded["weights"]),
        "buffer names": sorted(rank0),
        "layers": [ddp["ranks"][0]["layers"], sharded["ranks"][0]["layers"]],
        "buffers across ranks": max(_max_difference(rank0, rank["buffers"]) for rank in sharded["ranks"]),
        "checkpoint buffers vs rank 0": _max_difference(rank0, {k: results["checkpoint"][k] for k in rank0}),
    }


def buffers_of_every_kind() -> dict[str, list]:
    """``broadcast_buffers`` on bool, complex, non-contiguous bf16 and non-persistent int64 buffers holding each rank's
    own values: every rank's afterwards (rank 0's values are 0 / True / 1+0j)."""
    rank, module = dist.get_rank(), nn.Module()
    module.register_buffer("flag", torch.tensor([rank == 0, True]))
    module.register_buffer("phase", torch.tensor([1 + 2j * rank], dtype=torch.complex64))
    module.register_buffer("bf16", torch.full((2, 3), float(rank), dtype=torch.bfloat16).t())
    module.register_buffer("count", torch.tensor([rank]), persistent=False)
    broadcast_buffers(module)
    mine = [
        module.flag.tolist(),
        str(module.phase.tolist()),
        module.bf16.float().abs().sum().item(),
        module.count.tolist(),
    ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def sync_batchnorm() -> dict[str, Any]:
    """``Trainer(sync_batchnorm=True)``: the BatchNorm layers become ``SyncBatchNorm`` before sharding (which torch
    runs on GPUs only: on these CPU ranks the first forward raises torch's error)."""
    model = ResNetLike()
    error = attempt(lambda: trainer(sync_batchnorm=True, num_sanity_val_steps=0).fit(model, images()))
    layers = sorted({type(layer).__name__ for layer in model.modules() if "BatchNorm" in type(layer).__name__})
    return {"error": error, "layers": layers}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        results = {"buffers": buffers_against_ddp(tmp / "b"), "sync_batchnorm": sync_batchnorm()}
        results["buffers of every kind"] = buffers_of_every_kind()
        results["lifecycle"] = lifecycle(tmp / "l")
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(results), flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()
