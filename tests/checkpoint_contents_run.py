"""What a checkpoint holds besides the model and optimizer round-trips on every rank (run with torchrun).

    torchrun --nproc_per_node=2 tests/checkpoint_contents_run.py save OUT   # save, load at 2 ranks, record
    torchrun --nproc_per_node=1 tests/checkpoint_contents_run.py load OUT   # load the 2-rank files at 1 rank

``save``: for each format (sharded, full), ``TREES`` random state trees (seeded: the same structure on every rank)
of nested dicts, lists, tuples, empty containers, Python objects, plain tensors the same on every rank or not,
DTensors of several placements and dtypes, saved with ``fabric.save`` beside a model and an optimizer, then loaded
by a fresh model and optimizer; plus the reported cases as Trainer and Fabric runs (a second model's state dict, a
hand-written EMA and per-rank RNG states from ``on_save_checkpoint``; Fabric's ``extra["w_copy"]``). Each rank
compares what it loaded with what it saved (DTensors: placements, local shard and whole tensor); rank 0 records its
own trees (DTensors whole) for ``load``, which compares them with what one rank reads. Prints ``RESULT <json>``.
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
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import QUIET, ToyModel, rank_slice_loader  # noqa: E402

import lightning_shard  # noqa: E402
from lightning_shard.fabric import ShardedStrategy  # noqa: E402

TREES = int(os.environ.get("TREES", 24))  # per format; 3 entries per checkpoint
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
                    failures.append(f"{state_dict_type} {key}")
                recorded[f"{state_dict_type}-{index}/{key}"] = canonical(tree, local=False)
    if rank() == 0:
        torch.save(recorded, out / "trees.pt")
    return {"trees": TREES * 2, "tree_failures": failures}


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
    return {
        "w_copy_is_dtensor": isinstance(w_copy, DTensor),
        "w_copy_local_equal": torch.equal(w_copy.to_local(), weight.to_local()),
        "w_copy_whole_equal": torch.equal(w_copy.full_tensor(), weight.full_tensor()),
    }


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
        results[state_dict_type] = same(canonical(resumed.loaded, local=True), canonical(module.saved, local=True))
        whole = canonical(module.saved, local=False)  # a collective: on every rank
        if rank() == 0:
            torch.save(whole, out / f"trainer-{state_dict_type}.pt")
    return {"trainer_extras_equal": results}


def save(out: Path) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardedStrategy())
    fabric.launch()
    result = {**trees(fabric, out), **reported_fabric_case(fabric, out)}
    return {**result, **reported_trainer_case(out)}


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
        fabric.load(out / name, state)
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
