"""A 2-rank Fabric loop (the toy model, AdamW) that a test stops with real signals and resumes: the strategy's
``preemptible()`` context and ``step_end`` call, nothing else configured.

    python tests/fabric_preemption_run.py --out DIR --steps 10 [--act RANK:STEP:SIGNAL ...]

Fabric's launcher re-runs this script for rank 1. Resumes from ``DIR/ckpts/last.ckpt`` when it exists. Step ``s``
trains on the ``s``-th global batch (each rank its slice), so a resumed run sees the batches the uninterrupted one saw.
Rank 0 appends ``{"step", "loss"}`` (the mean loss over ranks) to ``DIR/losses.jsonl``. ``--act R:S:SIGNAL``: rank
``R`` sends itself ``SIGNAL`` after optimizer step ``S`` (before that step's ``step_end``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import ToyModel, rank_slice_loader  # noqa: E402

from lightning_shard.fabric import ShardedStrategy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--act", action="append", default=[], help="RANK:STEP:SIGNAL")
    args = parser.parse_args()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardedStrategy())
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    model = ToyModel()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    path = args.out / "ckpts" / "last.ckpt"
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if path.exists():
        fabric.load(path, state)
        fabric.print(f"resumed from step {state['step']}")
    acts = [act.split(":") for act in args.act]
    batches = list(rank_slice_loader(8))
    with fabric.strategy.preemptible() as preemption:
        for step in range(state["step"] + 1, args.steps + 1):
            x, y = batches[(step - 1) % len(batches)]
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            mean = float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
            if fabric.global_rank == 0:
                with open(args.out / "losses.jsonl", "a") as handle:
                    handle.write(json.dumps({"step": step, "loss": mean}) + "\n")
            for rank, when, name in acts:
                if int(rank) == fabric.global_rank and int(when) == step:
                    print(f"[rank {rank}] step {step}: {name}", flush=True)
                    os.kill(os.getpid(), signal.Signals[name])
            state["step"] = step
            preemption.step_end(path, state)
    fabric.print(f"finished at step {args.steps}")


if __name__ == "__main__":
    main()
