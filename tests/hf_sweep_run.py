"""The architecture sweep's runs: every family of ``hf_sweep_models.FAMILIES`` in sequence in one launch.

    python tests/hf_sweep_run.py --devices 2 --out OUT llama bert ...
    python tests/hf_sweep_run.py --devices 1 --reference --out OUT llama bert ...

On 2 ranks (``Trainer(strategy=ShardedStrategy())``, default settings) each family is trained twice:
``build="configure"`` - built in ``configure_model()`` on the meta device, 3 steps, then a sharded checkpoint - and
``build="init"`` - built eagerly in ``__init__``, resumed from that checkpoint for 2 more steps. Saved per family:
the global loss of every step, the full weights and the buffers when each fit starts and ends, and how far the
ranks' unsharded parameters and buffers are apart after the 3 steps. A family whose fit raises is recorded with
the error (and the phase), and the sweep goes on with the next family.

The reference (``--reference``): one process, Lightning's single-device strategy, the model built eagerly, 5 steps
uninterrupted, each step accumulating the ranks' two micro-batches in rank order: the same losses and gradients as 2
ranks for every model, also those whose loss mixes a micro-batch's samples (contrastive losses, batch norm, MoE
load balancing).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_sweep_models import FAMILIES, build, inputs, loss, model_class  # noqa: E402
from library_run import SampleDataset  # noqa: E402
from toy import N_SAMPLES, QUIET, RankSliceBatchSampler, StateRecorder, raise_if_peer_gone, scenario_parser  # noqa: E402

import lightning_shard  # noqa: E402

GLOBAL_BATCH, STEPS, RESUMED_STEPS = 8, 3, 2


class SweepModule(L.LightningModule):
    """A family's model under Lightning, built in ``__init__`` (``build="init"``) or ``configure_model()``; keeps
    the loss of every micro-batch it trains on."""

    def __init__(self, family: str, build_in: str) -> None:
        super().__init__()
        self.family = FAMILIES[family]
        self.model = build(self.family) if build_in == "init" else None
        self.micro_losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.family)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        value = loss(self.model, batch)
        self.micro_losses.append(float(value.detach()))
        return value

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class BufferRecorder(StateRecorder):
    """:class:`StateRecorder`'s weights, and every buffer (persistent or not) of this rank, when training starts."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.states["start"]["buffers"] = {name: b.detach().clone() for name, b in pl_module.named_buffers()}


def fit(family: str, build_in: str, devices: int, reference: bool, max_steps: int, ckpt_path: Path | None = None):
    L.seed_everything(0, verbose=False)
    module = SweepModule(family, build_in)
    recorder = BufferRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="auto" if reference else lightning_shard.ShardedStrategy(),
        max_steps=max_steps,
        accumulate_grad_batches=2 if reference else 1,
        callbacks=[recorder],
        # every step trains on the same global batch: an epoch is one step (the reference's two micro-batches), so
        # where Lightning restarts a loader after a resume does not change the data
        limit_train_batches=2 if reference else 1,
        **QUIET,
    )
    samples = SampleDataset(inputs(FAMILIES[family], torch.Generator().manual_seed(1234), N_SAMPLES))
    # The reference's micro-batches are the ranks' slices in rank order: [rank 0's, rank 1's] of every global batch.
    sampler = (
        dict(batch_size=GLOBAL_BATCH // 2) if reference else dict(batch_sampler=RankSliceBatchSampler(GLOBAL_BATCH))
    )
    trainer.fit(module, train_dataloaders=DataLoader(samples, **sampler), ckpt_path=ckpt_path)
    return trainer, module, recorder.states


def step_losses(module: SweepModule, reference: bool) -> list[float]:
    """The global loss of each step: the mean of its micro-batches' (the reference's two; one per rank here)."""
    losses = torch.tensor(module.micro_losses, dtype=torch.float64)
    if reference:
        return losses.view(-1, 2).mean(1).tolist()
    dist.all_reduce(losses)
    return (losses / dist.get_world_size()).tolist()


def rank_spread(module: SweepModule) -> dict[str, Any]:
    """How far this rank's unsharded parameters and buffers are from every other rank's: the largest difference
    and the tensor that has it."""
    tensors = {f"param:{n}": p.full_tensor() if isinstance(p, DTensor) else p for n, p in module.named_parameters()}
    tensors.update({f"buffer:{n}": b for n, b in module.named_buffers()})
    local = {name: t.detach().to(torch.float64).cpu() for name, t in tensors.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    worst = max(((gathered[0][n] - other[n]).abs().max().item(), n) for other in gathered[1:] for n in local)
    return {"max": worst[0], "where": worst[1]}


def run_family(family: str, devices: int, reference: bool, out: Path, result: dict[str, Any]) -> None:
    """Fill ``result`` with the family's runs (``phase``: how far it got, for a failure's record; "build": the
    family cannot be built here - not in this transformers version, or it needs a package not installed)."""
    started = time.monotonic()
    result["phase"] = "build"
    task, cls = model_class(FAMILIES[family])
    result.update(task=task, params=sum(p.numel() for p in build(FAMILIES[family]).parameters()))
    result["class"] = cls.__name__
    if reference:
        result["phase"] = "reference, 5 steps"
        _, module, states = fit(family, "init", devices, reference, STEPS + RESUMED_STEPS)
        result.update(losses=step_losses(module, reference), start=states["start"], end=states["end"])
        result.update(phase="done", seconds=time.monotonic() - started)
        return
    checkpoint = out / f"{family}.ckpt"
    result["phase"] = "meta build, 3 steps"
    trainer, module, states = fit(family, "configure", devices, reference, STEPS)
    result.update(losses=step_losses(module, reference), start=states["start"], end=states["end"])
    result["spread"] = rank_spread(module)
    result["phase"] = "sharded save"
    trainer.save_checkpoint(checkpoint)
    result["phase"] = "eager build, resume"
    _, module, states = fit(family, "init", devices, reference, STEPS + RESUMED_STEPS, ckpt_path=checkpoint)
    result.update(resumed_losses=step_losses(module, reference), resumed_start=states["start"])
    result.update(phase="done", seconds=time.monotonic() - started)
    dist.barrier()  # both ranks have read it
    if dist.get_rank() == 0:
        shutil.rmtree(checkpoint, ignore_errors=True)  # 2 MB a family: not kept for 90


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    parser = scenario_parser(FAMILIES)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for family in args.scenarios:
        result: dict[str, Any] = {}
        try:
            run_family(family, args.devices, args.reference, args.out, result)
        except (Exception, CheckpointException) as error:  # the family's failure is its result; the sweep goes on
            raise_if_peer_gone(error)
            # the last line: what a CheckpointException (the ranks' tracebacks) says went wrong
            result["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1][:300]}"
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(result, args.out / f"{family}.pt")
            print(f"SWEEP {family}: {result.get('error', 'ran')}", flush=True)


if __name__ == "__main__":
    main()
