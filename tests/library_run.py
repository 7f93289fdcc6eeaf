"""Train the library models of ``library_models.py`` with the default ``auto_wrap_policy`` and save per-step global
losses, the weights (and optimizer states) when training starts and ends, the FSDP units and the replicated
parameters.

    python tests/library_run.py --devices 2 --out OUT --checkpoints DIR clip unet2d ... clip_meta ...
``--devices 1 --reference`` is the one-process reference: Lightning's single-device strategy on the whole global
batch, the models built eagerly; its ``*_resume_*`` scenarios load the 2-rank run's checkpoints into one rank of the
sharded strategy (resharding 2 -> 1).

Scenarios: ``NAME`` (a case of ``library_models.CASES``, built in ``__init__``), ``NAME_meta`` (built in
``configure_model()``, on the meta device under the strategy: one step, for its start weights; an error during setup
is recorded by its message), and for CLIP, whose ``logit_scale`` is kept whole on every rank:
``clip_accumulate`` (2 micro-batches per step with ``gradient_accumulation="unsharded"`` and norm clipping),
``clip_hybrid`` (HYBRID_SHARD, 2 replicas of 1 rank), ``clip_bf16`` (``"bf16-mixed"``: dtypes in forward) and
``clip_resume_sharded`` / ``clip_resume_full`` (resume from the checkpoints ``clip`` saved in both formats).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from library_models import CASES, case_inputs  # noqa: E402
from toy import (  # noqa: E402
    N_SAMPLES,
    QUIET,
    GlobalLossRecorder,
    RankSliceBatchSampler,
    StateRecorder,
    raise_if_peer_gone,
    scenario_parser,
)

import lightning_shard  # noqa: E402

GLOBAL_BATCH, MAX_STEPS = 8, 3
# name -> (case, ShardedStrategy kwargs, Trainer kwargs, build)
SCENARIOS: dict[str, tuple[str, dict[str, Any], dict[str, Any], str]] = {
    **{name: (name, {}, {}, "init") for name in CASES},
    **{f"{name}_meta": (name, {}, {"max_steps": 1}, "configure") for name in CASES},
    "clip_accumulate": (
        "clip",
        {"gradient_accumulation": "unsharded"},
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
        "init",
    ),
    "clip_hybrid": ("clip", {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 1}, {}, "init"),
    "clip_bf16": ("clip", {}, {"precision": "bf16-mixed"}, "init"),
    "clip_resume_sharded": ("clip", {}, {"max_steps": MAX_STEPS + 1}, "init"),
    "clip_resume_full": ("clip", {}, {"max_steps": MAX_STEPS + 1}, "init"),
}


class SampleDataset(Dataset):
    """Samples of a case's inputs: dicts of tensors (Lightning's default collate stacks them)."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {key: value[index] for key, value in self.tensors.items()}


class LibraryModule(L.LightningModule):
    """A library model under Lightning: built in ``__init__`` (``build="init"``) or ``configure_model()``."""

    def __init__(self, case: str, build: str) -> None:
        super().__init__()
        self.case = CASES[case]
        self.model = self.case.build() if build == "init" else None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.case.build()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.case.loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class ForwardDtypes(L.Callback):
    """The dtypes CLIP's similarity logits and its (replicated) ``logit_scale`` have inside the first step."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if index == 0:
            clip = pl_module.model

            def record(module: Any, args: Any, output: Any) -> None:
                self.seen = {"logits": str(output.logits_per_image.dtype), "logit_scale": str(clip.logit_scale.dtype)}
                handle.remove()

            handle = clip.register_forward_hook(record)


def run(name: str, devices: int, reference: bool, out: Path, checkpoints: Path) -> None:
    case, strategy_kwargs, trainer_kwargs, build = SCENARIOS[name]
    trainer_kwargs = dict(trainer_kwargs)
    resuming = "resume" in name
    if reference and not resuming:
        strategy: Any = "auto"
    else:
        strategy = lightning_shard.ShardedStrategy(**strategy_kwargs)
    L.seed_everything(0, verbose=False)
    module = LibraryModule(case, build)
    losses, states, dtypes = GlobalLossRecorder(), StateRecorder(), ForwardDtypes()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=trainer_kwargs.pop("max_steps", MAX_STEPS),
        callbacks=[losses, states, *([dtypes] if name == "clip_bf16" else [])],
        **QUIET,
        **trainer_kwargs,
    )
    loader = DataLoader(SampleDataset(case_inputs(case, N_SAMPLES)), batch_sampler=RankSliceBatchSampler(GLOBAL_BATCH))
    result: dict[str, Any] = {}
    ckpt_path = checkpoints / f"clip_{name.rsplit('_', 1)[-1]}.ckpt" if resuming else None
    try:
        trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    except Exception as error:  # a meta-device build the initialisation rule refuses: the named error is the result
        if build != "configure":
            raise
        raise_if_peer_gone(error)
        result["error"] = f"{type(error).__name__}: {error}"
    if name == "clip" and not reference:
        _save_both_formats(trainer, checkpoints)
    result.update(
        losses=losses.losses,
        start=states.states.get("start"),
        end=states.states.get("end"),
        dtypes=dtypes.seen,
        units=sorted(type(m).__name__.removeprefix("FSDP") for m in module.model.modules() if isinstance(m, FSDPModule))
        if module.model is not None
        else [],
        replicated=sorted(n for n, p in module.named_parameters() if not isinstance(p, DTensor))
        if not reference
        else [],
    )
    if trainer.is_global_zero:
        torch.save(result, out / f"{name}.pt")


def _save_both_formats(trainer: L.Trainer, checkpoints: Path) -> None:
    strategy = trainer.strategy
    trainer.save_checkpoint(checkpoints / "clip_sharded.ckpt")
    strategy.config = replace(strategy.config, state_dict_type="full")
    trainer.save_checkpoint(checkpoints / "clip_full.ckpt")


def main() -> None:
    parser = scenario_parser(SCENARIOS)
    parser.add_argument("--checkpoints", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.checkpoints.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        run(name, args.devices, args.reference, args.out, args.checkpoints)


if __name__ == "__main__":
    main()
