"""HYBRID_SHARD runs of the toy model: simulated nodes under torchrun, the plain launcher, and the reference.

    # two simulated nodes of 2 ranks (start both concurrently; Lightning detects torchrun's environment)
    torchrun --nnodes 2 --nproc_per_node 2 --node_rank {0,1} --master_addr 127.0.0.1 --master_port PORT \
        tests/hybrid_run.py --devices 2 --num-nodes 2 --sharding HYBRID_SHARD --steps 4 --save --out DIR
    # Lightning's own launcher on one node, e.g. world 4 with shard groups of 2, resuming a checkpoint
    python tests/hybrid_run.py --devices 4 --sharding HYBRID_SHARD --hybrid-shard-size 2 --ckpt CKPT --steps 10 \
        --out DIR
    # one process, Lightning's single-device strategy (the reference): 4 steps, save; resume to 8 in DIR/resume_8,
    # save; resume that to 10 in DIR/resume_10
    python tests/hybrid_run.py --reference --steps 4 --resume-steps 8 10 --out DIR

Each run writes ``result.pt`` on rank 0: per-step global losses, the mesh and placements every parameter had,
and the full weights and optimizer state (gathered with torch.distributed.checkpoint's state-dict API) when
training started (just after a resume loaded them) and when it ended.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import QUIET, GlobalLossRecorder, StateRecorder, ToyModel, rank_slice_loader  # noqa: E402

import lightning_shard  # noqa: E402

GLOBAL_BATCH = 8


class Recorder(StateRecorder):
    """The layout of every parameter, and the full weights/optimizer state at train start and end."""

    def __init__(self) -> None:
        super().__init__()
        self.layout: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.layout = _layout(trainer, pl_module)
        super().on_train_start(trainer, pl_module)


def _layout(trainer: L.Trainer, model: L.LightningModule) -> dict[str, Any]:
    """What this run really sharded: world, node rank, strategy mesh, and each parameter's DTensor layout."""
    params: dict[str, Any] = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            params[name] = {
                "mesh_shape": tuple(mesh.shape),
                "mesh_dim_names": mesh.mesh_dim_names,
                "mesh": mesh.mesh.tolist(),
                "placements": tuple(repr(p) for p in param.placements),
                "local_shape": tuple(param.to_local().shape),
                "global_shape": tuple(param.shape),
            }
        else:
            params[name] = {"type": type(param).__name__}
    layout: dict[str, Any] = {"params": params, "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    strategy = trainer.strategy
    if isinstance(strategy, lightning_shard.ShardedStrategy):
        mesh = strategy.device_mesh
        layout.update(
            cluster_environment=type(strategy.cluster_environment).__name__,
            mesh_shape=tuple(mesh.shape),
            mesh_dim_names=mesh.mesh_dim_names,
            mesh=mesh.mesh.tolist(),
        )
        # Every rank's node and its shard/replicate groups, gathered so rank 0 can save them.
        mine = {
            "rank": dist.get_rank(),
            "node_rank": strategy.node_rank,
            "local_rank": strategy.local_rank,
            "shard_group": dist.get_process_group_ranks(mesh["shard"].get_group()),
            "replicate_group": dist.get_process_group_ranks(mesh["replicate"].get_group())
            if "replicate" in (mesh.mesh_dim_names or ())
            else None,
        }
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        layout["ranks"] = ranks
    return layout


def fit(args: argparse.Namespace, steps: int, ckpt: Path | None, out: Path, save: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    model = ToyModel()
    losses, recorder = GlobalLossRecorder(), Recorder()
    if args.reference:
        strategy: Any = "auto"
    else:
        kwargs: dict[str, Any] = {"sharding_strategy": args.sharding}
        if args.hybrid_shard_size is not None:
            kwargs["hybrid_shard_size"] = args.hybrid_shard_size
        strategy = lightning_shard.ShardedStrategy(**kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=steps,
        callbacks=[losses, recorder],
        gradient_clip_val=args.clip,
        **QUIET,
    )
    trainer.fit(model, train_dataloaders=rank_slice_loader(GLOBAL_BATCH), ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(out / "model.ckpt")
    if trainer.is_global_zero:
        torch.save({"losses": losses.losses, "layout": recorder.layout, **recorder.states}, out / "result.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--sharding", default="HYBRID_SHARD")
    parser.add_argument("--hybrid-shard-size", type=int)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--clip", type=float, help="gradient_clip_val (by norm)")
    parser.add_argument("--save", action="store_true", help="trainer.save_checkpoint(OUT/model.ckpt) after fit")
    parser.add_argument("--reference", action="store_true", help="Lightning's single-device strategy")
    parser.add_argument(
        "--resume-steps",
        type=int,
        nargs="*",
        default=[],
        help="reference only: then resume the last checkpoint to each of these steps in turn, into OUT/resume_N",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume_steps and not args.reference:
        parser.error("--resume-steps is for the one-process reference")
    fit(args, args.steps, args.ckpt, args.out, save=args.save or bool(args.resume_steps))
    last = args.out
    for steps in args.resume_steps:
        out = args.out / f"resume_{steps}"
        fit(args, steps, last / "model.ckpt", out, save=True)
        last = out


if __name__ == "__main__":
    main()
