"""Train the toy model under one or more scenarios and save per-step global losses and the final full weights.

Run as a script (Lightning's subprocess launcher re-runs it for the other ranks):
    python tests/parity_run.py --devices 2 --out OUT full grad_op ...
``--devices 1 --reference`` trains with Lightning's single-device strategy: the one-process reference.
``--record-exit`` writes ``exit_rank{R}.json`` at interpreter exit: whether the process group was still alive then.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import FULL, IN_FEATURES, QUIET, GlobalLossRecorder, ToyModel, rank_slice_loader, scenario_parser  # noqa: E402

import lightning_shard  # noqa: E402,F401
from lightning_shard.memory.accounting import gradient_bytes, held_bytes, unsharded_gradients  # noqa: E402

GLOBAL_BATCH = 8
MAX_STEPS = 8
ACCUMULATE = 4


class CallModelBeforeStep(L.Callback):
    """Calls the model between backward and the optimizer step, as a logging or evaluation callback would: the root's
    forward, and a direct child of it (the path of ``model.generate`` after fit)."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        probe = torch.ones(2, IN_FEATURES)
        with torch.no_grad():
            pl_module(probe)
            pl_module.embed(probe)


# name -> (ShardedStrategy kwargs, Trainer kwargs, ToyModel kwargs; "drop_batch" leaves that batch out of the loader)
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "full": ({"sharding_strategy": "FULL_SHARD"}, {}, {}),
    "grad_op": ({"sharding_strategy": "SHARD_GRAD_OP"}, {}, {}),
    "no_shard": ({"sharding_strategy": "NO_SHARD"}, {}, {}),
    "clip_norm": ({}, {"gradient_clip_val": 0.05}, {}),
    "clip_value": ({}, {"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value"}, {}),
    # gradients reduce-scattered every micro-batch (the default) / kept whole until the 4th
    "accumulate": ({}, {"accumulate_grad_batches": ACCUMULATE}, {}),
    "accumulate_unsharded": ({"gradient_accumulation": "unsharded"}, {"accumulate_grad_batches": ACCUMULATE}, {}),
    "meta_init": ({}, {}, {"build": "configure"}),
    # the model built inside `trainer.init_module(...)`: on the meta device (the reference builds it eagerly), or
    # eagerly on every rank
    "init_module_empty": ({}, {}, {"init_module": True}),
    "init_module": ({}, {}, {"init_module": False}),
    "checkpointing": ({"activation_checkpointing": ["Block"], "auto_wrap_policy": 500}, {}, {}),
    "selective_checkpointing": ({"activation_checkpointing": "selective"}, {}, {}),
    "forward_prefetch": ({"forward_prefetch": True}, {}, {}),
    # the opt-in CPU transport through the strategy (its own tests compare it with FSDP2's collectives byte by byte)
    "shared_memory": ({"cpu_collectives": "shared_memory"}, {}, {}),
    "sgd": ({"auto_wrap_policy": None}, {}, {"optimizer": "sgd"}),
    "auto_sharding": ({"sharding_strategy": "auto"}, {}, {}),
    # spawned workers: only the weights come back to this process (callbacks ran in the workers)
    "spawn": ({"start_method": "spawn"}, {}, {}),
    "evaluate": ({}, {}, {}),
    "bf16_mixed": ({}, {"precision": "bf16-mixed"}, {}),
    "fp16_mixed": ({}, {"plugins": "16-mixed"}, {}),
    "bf16_true": ({}, {"precision": "bf16-true"}, {}),
    "fp16_true": ({}, {"precision": "16-true"}, {"optimizer": "sgd"}),
    "call_before_step": ({}, {"callbacks": [CallModelBeforeStep()]}, {}),
    # one rank (Lightning refuses skipping on more): batch 2 skipped, against a loader without batch 2
    "fp16_skip": ({}, {"plugins": "16-mixed"}, {"skip_batch": 2}),
    "fp16_dropped": ({}, {"plugins": "16-mixed", "max_steps": MAX_STEPS - 1}, {"drop_batch": 2}),
}


def run(name: str, devices: int, reference: bool, out: Path) -> None:
    strategy_kwargs, trainer_kwargs, model_kwargs = SCENARIOS[name]
    trainer_kwargs, model_kwargs = dict(trainer_kwargs), dict(model_kwargs)
    if "plugins" in trainer_kwargs:
        # Lightning turns `precision="16-mixed"` into bf16 on a CPU accelerator; the plugin keeps fp16.
        trainer_kwargs["plugins"] = [lightning_shard.ShardedPrecision(trainer_kwargs["plugins"])]
    drop_batch = model_kwargs.pop("drop_batch", None)
    init_module = model_kwargs.pop("init_module", None)
    L.seed_everything(0, verbose=False)
    recorder, held = GlobalLossRecorder(), HeldGradientRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=_strategy(reference, **strategy_kwargs),
        max_steps=trainer_kwargs.pop("max_steps", MAX_STEPS),
        callbacks=[recorder, held, *trainer_kwargs.pop("callbacks", [])],
        **QUIET,
        **trainer_kwargs,
    )
    if init_module is None:
        model = ToyModel(**model_kwargs)
    else:  # Lightning's own single-device strategy would leave an `empty_init` model uninitialised
        with trainer.init_module(empty_init=init_module and not reference):
            model = ToyModel(**model_kwargs)
    trainer.fit(model, train_dataloaders=rank_slice_loader(GLOBAL_BATCH, drop=drop_batch))
    result: dict[str, Any] = {
        "losses": recorder.losses,
        "forward_dtypes": getattr(model.blocks[0], "seen_dtypes", None),  # None: the forward ran in workers
        "stored_dtype": str(next(model.parameters()).dtype),
        "sharding_strategy": getattr(trainer.strategy, "config", None) and trainer.strategy.config.sharding_strategy,
        "held_gradient_bytes": held.bytes,
    }
    if name == "evaluate":
        result.update(_evaluate(trainer, model, devices, reference))
    result["weights"] = get_model_state_dict(model, options=FULL)
    if trainer.is_global_zero:
        torch.save(result, out / f"{name}.pt")


class HeldGradientRecorder(L.Callback):
    """After each micro-batch's backward, the bytes of gradients FSDP2 holds on this rank: the whole ones it keeps
    between micro-batches whose reduce-scatter was skipped, and the (local shards of the) sharded ones."""

    def __init__(self) -> None:
        self.bytes: list[dict[str, int]] = []

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.bytes.append(
            {
                "unsharded": held_bytes(unsharded_gradients(pl_module)),
                "sharded": gradient_bytes(pl_module.parameters()),
            }
        )


def _evaluate(trainer: L.Trainer, model: ToyModel, devices: int, reference: bool) -> dict[str, Any]:
    """validate + predict after fit (same Trainer, default inference_mode), then validate a fresh model alone."""
    loader = rank_slice_loader(GLOBAL_BATCH)
    val_after_fit = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
    predictions = torch.cat(trainer.predict(model, loader))
    L.seed_everything(1, verbose=False)
    fresh = ToyModel()
    alone = L.Trainer(accelerator="cpu", devices=devices, strategy=_strategy(reference), **QUIET)
    val_alone = alone.validate(fresh, loader, verbose=False)[0]["val_loss"]
    return {"val_after_fit": val_after_fit, "predictions": predictions, "val_alone": val_alone}


def _strategy(reference: bool, **kwargs: Any) -> Any:
    return "auto" if reference else lightning_shard.ShardedStrategy(**kwargs)


def _record_exit(path: Path) -> None:
    path.write_text(json.dumps({"process_group_alive": dist.is_initialized()}))


def main() -> None:
    parser = scenario_parser(SCENARIOS)
    parser.add_argument("--record-exit", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.record_exit:
        # Registered before the strategy's handler, so it runs after it (atexit is last in, first out).
        atexit.register(_record_exit, args.out / f"exit_rank{os.environ.get('LOCAL_RANK', '0')}.json")
    for name in args.scenarios:
        run(name, args.devices, args.reference, args.out)


if __name__ == "__main__":
    main()
