"""Every construction style of ``init_styles`` built on the meta device under the strategy on 2 ranks; saves, per style,
the whole state after setup (rank 0's gathered tensors) or the error setup raised.

    python tests/init_corpus_run.py --out OUT

One launch: the Trainer builds every style that an eager build can be reproduced from (``configure_model()``, then
``fit`` with no step); Fabric builds a subset with ``init_module(empty_init=True)``, the styles that stop with a named
error (Fabric raises them to this loop, where the Trainer's launcher would end the job), a real head assigned after
``init_module``, and a per-rank random state that materialisation must leave as it found it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from init_styles import ERRORS, SEED, STYLES, Body, StyleModule  # noqa: E402
from toy import QUIET  # noqa: E402

import lightning_shard  # noqa: E402, F401  (registers the strategy)

FABRIC_STYLES = [
    "nanogpt",
    "rotary_inv_freq_from_arange",
    "timm_trunc_normal_imported_by_name",
    "cast_sequential_to_bf16",
]


def gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state on every rank (the DTensors' full tensors: a collective)."""
    return {
        key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for key, value in module.state_dict().items()
    }


def trainer_style(name: str) -> dict[str, torch.Tensor]:
    L.seed_everything(SEED, verbose=False)
    module = StyleModule(name)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fully_sharded", max_steps=0, **QUIET)
    trainer.fit(module, DataLoader(torch.zeros(4, 1)))
    return gathered(module)


def fabric() -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="fully_sharded")
    fabric.launch()
    return fabric


def fabric_style(name: str) -> dict[str, Any]:
    runner = fabric()
    runner.seed_everything(SEED, verbose=False)
    with runner.init_module(empty_init=True):
        model = STYLES[name]()
    try:
        return {"state": gathered(runner.setup(model))}
    except (TypeError, RuntimeError) as error:
        return {"error": str(error)}


def fabric_real_head() -> dict[str, Any]:
    """A real head assigned after ``init_module(empty_init=True)``: kept as it was (rank 0's), the body replayed."""
    runner = fabric()
    runner.seed_everything(SEED, verbose=False)
    with runner.init_module(empty_init=True):
        model = Body()
    model.head = nn.Linear(4, 2)
    head = {key: value.detach().clone() for key, value in model.head.state_dict().items()}
    return {"head_before": head, "state": gathered(runner.setup(model))}


def fabric_per_rank_random_state() -> dict[str, Any]:
    """Each rank seeded differently after building: its own stream, untouched by the materialisation."""
    runner = fabric()
    runner.seed_everything(SEED, verbose=False)
    with runner.init_module(empty_init=True):
        model = Body()
    torch.manual_seed(100 + runner.global_rank)
    runner.setup(model)
    drawn = torch.rand(4)
    return {"rank": runner.global_rank, "drawn": runner.all_gather(drawn)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results: dict[str, Any] = {"trainer": {}, "fabric": {}}
    for name in STYLES:
        if name not in ERRORS:
            results["trainer"][name] = trainer_style(name)
    for name in [*FABRIC_STYLES, *ERRORS]:
        results["fabric"][name] = fabric_style(name)
    results["fabric_real_head"] = fabric_real_head()
    results["fabric_per_rank_random_state"] = fabric_per_rank_random_state()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(results, args.out / "corpus.pt")


if __name__ == "__main__":
    main()
