"""Train a tiny GPT eagerly and with ``ShardedStrategy(compile=...)``, with and without activation checkpointing,
in one launch (Lightning's launcher re-runs this script for rank 1), and write per-step global losses to JSON.

    python tests/compile_run.py --devices 2 --out OUT.json

Compiled scenarios pass ``fullgraph=True``: each block must compile to one graph, FSDP2's hooks and the
checkpoint wrapper included, or the run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy import QUIET, GlobalLossRecorder  # noqa: E402

from benchmarks.common import random_token_dataset  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_shard import ShardedStrategy  # noqa: E402

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64, "block_size": 16, "warmup_steps": 1}
STEPS, PER_RANK_BATCH = 3, 2
FULLGRAPH = {"fullgraph": True}

SCENARIOS: dict[str, dict[str, Any]] = {
    "eager": {},
    "compiled": {"compile": FULLGRAPH},
    "eager_checkpointing": {"activation_checkpointing": ["Block"]},
    "compiled_checkpointing": {"activation_checkpointing": ["Block"], "compile": FULLGRAPH},
    "compiled_selective": {"activation_checkpointing": "selective", "compile": FULLGRAPH},
    # last: the budget is process-wide (torch._functorch.config), read by every later compilation
    "compiled_memory_budget": {"activation_memory_budget": 0.5, "compile": FULLGRAPH},
}


def run(name: str, devices: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    # Each scenario compiles its own graphs: a block compiled by an earlier scenario (the same code) would otherwise
    # be reused from dynamo's cache, with the settings it was compiled under (the memory budget is read at compile).
    torch._dynamo.reset()
    counters.clear()
    L.seed_everything(0, verbose=False)
    model = GPT(**TINY, max_steps=STEPS)
    recorder = GlobalLossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ShardedStrategy(auto_wrap_policy=["Block"], **SCENARIOS[name]),
        max_steps=STEPS,
        callbacks=[recorder],
        **{**QUIET, "use_distributed_sampler": True},
    )
    data = random_token_dataset(STEPS * PER_RANK_BATCH * devices, TINY["block_size"], TINY["vocab_size"])
    trainer.fit(model, DataLoader(data, batch_size=PER_RANK_BATCH))
    blocks = list(model.transformer["h"])
    return {
        "losses": recorder.losses,
        "compiled_blocks": sum(block._compiled_call_impl is not None for block in blocks),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    args = parser.parse_args()
    results = {name: run(name, args.devices) for name in args.scenarios}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        args.out.write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
