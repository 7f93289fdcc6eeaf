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
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from init_styles import AFTER_BUILD, ERRORS, SEED, STYLES, Body, StyleModule  # noqa: E402
from toy import QUIET  # noqa: E402

import lightning_shard  # noqa: E402, F401  (registers the strategy)
from lightning_shard.init import draw_counts, split_replay  # noqa: E402

SPLIT: list[bool] = []  # per materialisation: whether the replay was split between the ranks
CHUNKED: list[int] = []  # per split: how many tensors each rank filled in its own chunk


def _note_splits() -> None:
    run = split_replay.WorkSplit.run

    def noting(self: split_replay.WorkSplit, *args: Any) -> bool:
        done = run(self, *args)
        SPLIT.append(done)
        CHUNKED.append(len(self.chunked))
        return done

    split_replay.WorkSplit.run = noting  # type: ignore[method-assign]


FABRIC_STYLES = [
    "nanogpt",
    "rotary_inv_freq_from_arange",
    "timm_trunc_normal_imported_by_name",
    "cast_sequential_to_bf16",
]

# Built with Fabric, then (outside the build) the style's code, a real head and a draw after setup
AFTER_BUILD_STYLES = [
    *AFTER_BUILD,
    "nanogpt",
    "discarded_random_draws",
    "drawn_on_a_real_device",
    "fork_rng_and_set_rng_state",
    "timm_trunc_normal_imported_by_name",
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


def miscounted_style(name: str) -> dict[str, Any]:
    """A style built while every jumped draw is counted one output too many (as if torch's kernel took another count
    than the one checked): the split's stream check must catch it, warn, and replay whole."""
    counted, chunked = draw_counts.outputs_of, split_replay.chunk_filled
    draw_counts.outputs_of = lambda op: None if (outputs := counted(op)) is None else outputs + 1
    split_replay.chunk_filled = lambda *args, **kwargs: set()  # every tensor through an owner's replay
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = trainer_style(name)
    finally:
        draw_counts.outputs_of, split_replay.chunk_filled = counted, chunked
    return {"state": state, "warned": any("streams disagreed" in str(w.message) for w in caught)}


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


def fabric_after_build(name: str, seed: int = SEED) -> dict[str, Any]:
    """``init_module(empty_init=True)``, the style's code after the build, a real head assigned before setup, and a
    draw after setup (each rank's: ``seed`` may differ per rank)."""
    runner = fabric()
    torch.manual_seed(seed)
    with runner.init_module(empty_init=True):
        model = STYLES[name]()
    AFTER_BUILD.get(name, lambda model: None)(model)
    model.head = nn.Linear(4, 2)
    state = gathered(runner.setup(model))
    return {"state": state, "drawn": runner.all_gather(torch.rand(4))}


def litgpt_config() -> Any:
    from litgpt import Config

    return Config(
        block_size=16, vocab_size=32, padded_vocab_size=32, n_layer=2, n_head=2, n_embd=8, rotary_percentage=1.0,
        mlp_class_name="LLaMAMLP", intermediate_size=16, norm_class_name="RMSNorm", bias=True,
    )  # fmt: skip


def litgpt_pretrain() -> dict[str, Any]:
    """litgpt's pretraining script's init path (``litgpt/pretrain.py``): ``init_module(empty_init=True)``, its
    ``initialize_weights`` (GPT-NeoX init as ``reset_parameters`` overrides, called), ``fabric.setup``."""
    from litgpt import GPT
    from litgpt.pretrain import initialize_weights

    runner = fabric()
    runner.seed_everything(SEED, verbose=False)
    config = litgpt_config()
    with runner.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(runner, model, n_layer=config.n_layer, n_embd=config.n_embd)
    state = gathered(runner.setup(model))
    return {"state": state, "drawn": runner.all_gather(torch.rand(4))}


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
    _note_splits()
    results: dict[str, Any] = {"trainer": {}, "fabric": {}, "after_build": {}, "split": {}, "chunked": {}}
    for name in STYLES:
        if name not in ERRORS:
            SPLIT.clear()
            CHUNKED.clear()
            results["trainer"][name] = trainer_style(name)
            results["split"][name] = any(SPLIT)
            results["chunked"][name] = sum(CHUNKED)
    results["miscounted"] = miscounted_style("nanogpt")
    for name in [*FABRIC_STYLES, *ERRORS]:
        results["fabric"][name] = fabric_style(name)
    for name in AFTER_BUILD_STYLES:
        results["after_build"][name] = fabric_after_build(name)
    # ranks seeded apart before the build: rank 0's weights, each rank's own stream after setup
    results["seeded_apart"] = fabric_after_build("nanogpt", seed=100 + int(os.environ.get("LOCAL_RANK", "0")))
    results["fabric_per_rank_random_state"] = fabric_per_rank_random_state()
    results["litgpt"] = litgpt_pretrain()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(results, args.out / "corpus.pt")


if __name__ == "__main__":
    main()
