"""What a checkpoint holds besides the model and optimizer round-trips on every rank (run with torchrun).

    torchrun --nproc_per_node=2 tests/checkpoint_contents_run.py save OUT   # save, load at 2 ranks, record
    torchrun --nproc_per_node=1 tests/checkpoint_contents_run.py load OUT   # load the 2-rank files at 1 rank

``save``: for each format (sharded, full), ``TREES`` random state trees (seeded: the same structure on every rank)
of nested dicts, lists, tuples, empty containers, Python objects, plain tensors the same on every rank or not,
DTensors of several placements and dtypes, saved with ``fabric.save`` beside a model and an optimizer, then loaded
by a fresh model and optimizer; the reported cases (Trainer and Fabric; weight averaging; parameters without optimizer
state). Each rank compares what it loaded with what it saved (DTensors: placements, local shard, whole tensor); rank
0 records its trees for ``load``, which compares them with what one rank reads. Prints ``RESULT <json>``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import FULL, QUIET, ToyModel, raise_if_peer_gone, rank_slice_loader  # noqa: E402

import lightning_shard  # noqa: E402
from lightning_shard.checkpoint.publish import STAGING_DIR  # noqa: E402
from lightning_shard.fabric import ShardedStrategy  # noqa: E402

TREES = 24  # per format; 3 entries per checkpoint
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float64]


@dataclass
class Thing:
    """A Python object holding tensors: pickled with them."""

    name: str
    value: Any


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def random_tensor(rng: random.Random, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = [rng.choice([2, 4, 6]) for _ in range(rng.randint(0, 3))]
    dtype = rng.choice(DTYPES)
    values = torch.randn(shape, generator=generator) * 10
    return values > 0 if dtype is torch.bool else values.to(dtype)


def random_tree(rng: random.Random, mesh: Any, depth: int = 0) -> Any:
    """A tree whose structure depends on ``rng`` only (the same on every rank) and whose per-rank leaves differ."""
    kind = rng.choice(["dict", "list", "tuple", "ordered", "leaf", "leaf", "leaf"] if depth < 3 else ["leaf"])
    size = rng.randint(0, 3)
    if kind == "dict":
        return {f"k{i}": random_tree(rng, mesh, depth + 1) for i in range(size)}
    if kind == "list":
        return [random_tree(rng, mesh, depth + 1) for _ in range(size)]
    if kind == "tuple":
        return tuple(random_tree(rng, mesh, depth + 1) for _ in range(size))
    if kind == "ordered":
        return OrderedDict((f"o{i}", random_tree(rng, mesh, depth + 1)) for i in range(size))
    leaf = rng.choice(["int", "str", "none", "float", "thing", "tensor", "rank_tensor", "rank_int", "dtensor"])
    seed = rng.randrange(2**31)
    if leaf == "int":
        return seed
    if leaf == "str":
        return f"s{seed}"
    if leaf == "none":
        return None
    if leaf == "float":
        return seed / 7
    if leaf == "thing":
        return Thing(f"t{seed}", [random_tensor(rng, seed), {}])
    if leaf == "tensor":
        return random_tensor(rng, seed)
    if leaf == "rank_tensor":  # differs between ranks (an RNG state, a rank's statistics)
        return random_tensor(rng, seed + rank())
    if leaf == "rank_int":
        return seed + rank()
    whole = random_tensor(random.Random(seed), seed)
    whole = whole.reshape(4, -1) if whole.numel() % 4 == 0 and whole.numel() else torch.ones(4, 3)
    placement = rng.choice([Shard(0), Shard(1), Replicate()])
    if isinstance(placement, Shard) and whole.shape[placement.dim] % 2:
        placement = Shard(0)
    return distribute_tensor(whole, mesh, [placement])


def canonical(tree: Any, local: bool) -> Any:
    """The tree with DTensors as (placements, whole[, local]) and tuples kept apart from lists: what must round-trip."""
    if isinstance(tree, DTensor):
        described = ("DTensor", tuple(tree.placements), tree.full_tensor())
        return (*described, tree.to_local()) if local else described
    if isinstance(tree, torch.Tensor):
        return ("Tensor", tree)
    if isinstance(tree, Thing):
        return ("Thing", tree.name, canonical(tree.value, local))
    if isinstance(tree, (dict, list, tuple)):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        return (type(tree).__name__, [(key, canonical(value, local)) for key, value in items])
    return tree


def every_rank(value: Any) -> list[Any]:
    """``value`` of every rank (what rank 0 reports must include the other ranks' findings)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def fabric_model(fabric: L.Fabric) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return fabric.setup(model, optimizer)


def trees(fabric: L.Fabric, out: Path) -> dict[str, Any]:
    """Random trees through ``fabric.save`` / ``fabric.load`` in both formats; rank 0 records its trees whole."""
    failures, recorded = [], {}
    for state_dict_type in ("sharded", "full"):
        fabric.strategy.config = dataclasses.replace(fabric.strategy.config, state_dict_type=state_dict_type)
        model, optimizer = fabric_model(fabric)
        mesh = model.module[0].weight.device_mesh
        for index in range(0, TREES, 3):
            entries = {f"tree{i}": random_tree(random.Random(i), mesh) for i in range(index, index + 3)}
            path = out / f"{state_dict_type}-{index}.ckpt"
            fabric.save(path, {"model": model, "optimizer": optimizer, **entries})
            loaded_model, loaded_optimizer = fabric_model(fabric)
            state = {"model": loaded_model, "optimizer": loaded_optimizer, **dict.fromkeys(entries)}
            fabric.load(path, state)
            for key, tree in entries.items():
                if not same(canonical(state[key], local=True), canonical(tree, local=True)):
                    failures.append(f"{state_dict_type} {key} (rank {rank()})")
                recorded[f"{state_dict_type}-{index}/{key}"] = canonical(tree, local=False)
    if rank() == 0:
        torch.save(recorded, out / "trees.pt")
    return {"trees": TREES * 2, "tree_failures": sum(every_rank(failures), [])}


def reported_fabric_case(fabric: L.Fabric, out: Path) -> dict[str, Any]:
    """The issue's example: a copy of a sharded weight in an "extra" entry."""
    model, optimizer = fabric_model(fabric)
    weight = model.module[0].weight
    extra = {"w_copy": weight.detach().clone()}
    fabric.save(out / "w_copy.ckpt", {"model": model, "optimizer": optimizer, "extra": extra})
    loaded_model, loaded_optimizer = fabric_model(fabric)
    state = {"model": loaded_model, "optimizer": loaded_optimizer, "extra": None}
    fabric.load(out / "w_copy.ckpt", state)
    w_copy = state["extra"]["w_copy"]
    checks = {
        "w_copy_is_dtensor": isinstance(w_copy, DTensor),
        "w_copy_local_equal": torch.equal(w_copy.to_local(), weight.to_local()),
        "w_copy_whole_equal": torch.equal(w_copy.full_tensor(), weight.full_tensor()),
    }
    return {name: all(every_rank(value)) for name, value in checks.items()}


class ExtrasModule(ToyModel):
    """Adds what users add in ``on_save_checkpoint``: a second (sharded) model's state dict, a hand-written EMA of
    the weights (DTensors), per-rank RNG states; records what ``on_load_checkpoint`` receives."""

    def __init__(self) -> None:
        super().__init__(build="configure")
        torch.manual_seed(1)
        object.__setattr__(self, "teacher", nn.Linear(8, 6))  # not a submodule: saved by the hook only

    def configure_model(self) -> None:
        super().configure_model()
        if not isinstance(self.teacher.weight, DTensor):
            fully_shard(self.teacher, mesh=self.device_mesh)

    def extras(self) -> dict[str, Any]:
        torch.manual_seed(100 + self.global_rank)
        return {
            "teacher": self.teacher.state_dict(),
            "ema": {name: p.detach().clone() * 0.5 for name, p in self.named_parameters()},
            "rng": {"torch": torch.get_rng_state(), "python": random.Random(self.global_rank).getstate()},
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.saved = self.extras()
        checkpoint["extras"] = self.saved

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded = checkpoint["extras"]


def reported_trainer_case(out: Path) -> dict[str, Any]:
    results = {}
    for state_dict_type in ("sharded", "full"):
        path = out / f"trainer-{state_dict_type}.ckpt"

        def trainer(steps: int, state_dict_type: str = state_dict_type) -> L.Trainer:
            strategy = lightning_shard.ShardedStrategy(state_dict_type=state_dict_type)
            return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=steps,
                             **QUIET)  # fmt: skip

        module = ExtrasModule()
        first = trainer(2)
        first.fit(module, rank_slice_loader(16))
        first.save_checkpoint(path)
        resumed = ExtrasModule()
        trainer(2).fit(resumed, rank_slice_loader(16), ckpt_path=path)
        equal = same(canonical(resumed.loaded, local=True), canonical(module.saved, local=True))
        results[state_dict_type] = all(every_rank(equal))
        whole = canonical(module.saved, local=False)  # a collective: on every rank
        if rank() == 0:
            torch.save(whole, out / f"trainer-{state_dict_type}.pt")
    return {"trainer_extras_equal": results}


def fit(model: L.LightningModule, steps: int, callbacks: list[L.Callback] = (), **kwargs: Any) -> L.Trainer:
    """A 2-rank fit of 4 batches an epoch; ``state_dict_type`` and ``ckpt_path`` among ``kwargs``."""
    strategy = lightning_shard.ShardedStrategy(state_dict_type=kwargs.pop("state_dict_type", "sharded"))
    quiet = {**QUIET, "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks)}
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=steps,
                        limit_val_batches=2, num_sanity_val_steps=0, callbacks=list(callbacks), **quiet)  # fmt: skip
    trainer.fit(model, rank_slice_loader(16), rank_slice_loader(16), ckpt_path=kwargs.pop("ckpt_path", None))
    return trainer


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in get_model_state_dict(model, options=FULL).items()}


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two gathered state dicts (read on rank 0, where they are gathered)."""
    if rank() != 0:
        return 0.0
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


def validation_loss(ckpt_path: Path | None = None, model: L.LightningModule | None = None) -> float:
    """The validation loss of ``model`` (default: a fresh one), or of the checkpoint's weights, without a callback."""
    strategy = lightning_shard.ShardedStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, limit_val_batches=2,
                        **QUIET)  # fmt: skip
    (metrics,) = trainer.validate(model or ToyModel(), rank_slice_loader(16), ckpt_path=ckpt_path, verbose=False)
    return metrics["val_loss"]


class StopAtEpochEnd(L.Callback):
    """Raises at the end of the first epoch (after the 4th step): what a rescue save follows."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        raise RuntimeError("stop")


def averaging(out: Path) -> dict[str, Any]:
    """Weight averaging checkpoints: after fit (``trainer.save_checkpoint``) and after an exception they hold the
    model's weights under ``state_dict`` and the copy under ``averaged_model``, as during fit; evaluating one
    evaluates the averaged weights, also when its publish was interrupted (moved aside)."""
    io = lightning_shard.ShardedCheckpointIO()
    ema = EMAWeightAveraging(decay=0.8)
    every = ModelCheckpoint(dirpath=out / "ema", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    torch.manual_seed(0)
    model = ToyModel()
    fit(model, 8, [ema, every])
    after_fit = out / "ema" / "final.ckpt"
    model.trainer.save_checkpoint(after_fit)
    saved = io.load_checkpoint(after_fit)
    averaged = {name[len("module.") :]: v for name, v in saved["averaged_model"].items() if name != "n_averaged"}
    result = {
        "after_fit_keys_lightning": sorted({"current_model_state", "averaging_state"} & set(saved)),
        "after_fit_state_dict_is_model": difference(saved["state_dict"], weights(model)),
        "after_fit_averaged_is_copy": difference(averaged, weights(ema._average_model.module)),
        "validate_after_fit": validation_loss(model=model),
        "validate_after_fit_checkpoint": validation_loss(after_fit),
    }
    # A checkpoint written during fit, then found moved aside by an interrupted publish: the averaged weights.
    during = out / "ema" / "step=4.ckpt"
    result["validate_step4"] = validation_loss(during)
    if rank() == 0:
        (during.parent / STAGING_DIR).mkdir(exist_ok=True)
        during.rename(during.parent / STAGING_DIR / f"{during.name}.old-3f2a9b1c")
    dist.barrier()
    result["validate_step4_moved_aside"] = validation_loss(during)
    # Rescue: an exception ends fit after step 4; the save after it holds what the step-4 checkpoint holds.
    torch.manual_seed(0)
    rescued, rescue_ema = ToyModel(), EMAWeightAveraging(decay=0.8)
    try:
        fit(rescued, 8, [rescue_ema, StopAtEpochEnd()])
    except RuntimeError:
        pass
    rescue = out / "ema" / "rescue.ckpt"
    rescued.trainer.save_checkpoint(rescue)
    saved = io.load_checkpoint(rescue)
    result["rescue_keys_lightning"] = sorted({"current_model_state", "averaging_state"} & set(saved))
    result["rescue_state_dict_is_model"] = difference(saved["state_dict"], weights(rescued))
    # The same trajectory as the uninterrupted run's step-4 checkpoint (written inside fit, in this layout).
    step4 = io.load_checkpoint(during)
    result["rescue_vs_step4_checkpoint"] = max(
        difference(saved[key], step4[key]) for key in ("state_dict", "averaged_model")
    )
    return result


class LateParameters(ToyModel):
    """Parameters without a gradient at the step-4 save: one never used, one used from step 4 on (a mask token, a
    layer unfrozen later)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.mask_token = nn.Parameter(torch.randn(8) * 0.1)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.mask_token if self.trainer.global_step >= 4 else x)


def parameters_without_state(out: Path) -> dict[str, Any]:
    """Resumed at step 4 against an uninterrupted 6-step run, in both formats."""
    torch.manual_seed(0)
    uninterrupted = LateParameters()
    fit(uninterrupted, 6)
    result = {}
    for state_dict_type in ("sharded", "full"):
        torch.manual_seed(0)
        first = LateParameters()
        path = out / f"late-{state_dict_type}.ckpt"
        fit(first, 4, state_dict_type=state_dict_type).save_checkpoint(path)
        torch.manual_seed(0)
        resumed = LateParameters()
        try:
            fit(resumed, 6, state_dict_type=state_dict_type, ckpt_path=path)
            result[state_dict_type] = difference(weights(resumed), weights(uninterrupted))
        except Exception as error:
            raise_if_peer_gone(error)
            result[state_dict_type] = f"{type(error).__name__}: {str(error)[:150]}"
    return {"late_parameters_resumed_vs_uninterrupted": result}


def save(out: Path) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardedStrategy())
    fabric.launch()
    result = {**trees(fabric, out), **reported_fabric_case(fabric, out), **reported_trainer_case(out)}
    return {**result, **averaging(out), **parameters_without_state(out)}


def load(out: Path) -> dict[str, Any]:
    """One rank reads the 2-rank checkpoints: rank 0's trees and the whole DTensors come back."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ShardedStrategy())
    fabric.launch()
    recorded = torch.load(out / "trees.pt", weights_only=False)
    failures = []
    for name in sorted({name.split("/")[0] for name in recorded}):
        keys = [name_key.split("/")[1] for name_key in recorded if name_key.startswith(name + "/")]
        model, optimizer = fabric_model(fabric)
        state = {"model": model, "optimizer": optimizer, **dict.fromkeys(keys)}
        fabric.load(out / f"{name}.ckpt", state)
        wrong = [key for key in keys if not same(canonical(state[key], False), recorded[f"{name}/{key}"])]
        failures += [f"{name}/{key}" for key in wrong]
    trainer = {}
    for state_dict_type in ("sharded", "full"):
        resumed = ExtrasModule()
        strategy = lightning_shard.ShardedStrategy(state_dict_type=state_dict_type)
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, **QUIET).fit(
            resumed, rank_slice_loader(16), ckpt_path=out / f"trainer-{state_dict_type}.ckpt"
        )
        expected = torch.load(out / f"trainer-{state_dict_type}.pt", weights_only=False)
        trainer[state_dict_type] = same(canonical(resumed.loaded, local=False), expected)
    return {"loaded": len(recorded), "tree_failures": failures, "trainer_extras_equal": trainer}


if __name__ == "__main__":
    action, out = sys.argv[1], Path(sys.argv[2])
    result = save(out) if action == "save" else load(out)
    if rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
