"""A small model, a deterministic data split and result recording shared by the multi-process tests.

Parity needs each rank's micro-batch to be its part of the one-process batch: the sampler below gives rank r
the r-th slice of every global batch, so the mean of the ranks' losses is the one-process loss.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Sampler, TensorDataset

IN_FEATURES, WIDTH, N_SAMPLES = 8, 16, 64
# Trainer settings of every scripted run: our own sampler, nothing written unless a test asks for it.
QUIET = {
    "use_distributed_sampler": False,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
# What gloo says when another rank's process has gone (a crash): the process group is dead from then on.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


def raise_if_peer_gone(error: BaseException) -> None:
    """Raise ``error`` again if it says another rank's process is gone; a run script calls this before it records
    an error as a case's result. Such an error is no case's result: every later collective of the launch fails the
    same way, so recording it and going on would turn one crashed process into a failure of every later case (CI:
    one rank of the architecture sweep died and 13 families were reported failing). Raised, it ends the launch with
    a non-zero exit, which ``conftest.run_script`` reports (and reruns once when a crash in native code caused it).

    Example:
        >>> raise_if_peer_gone(ValueError("a recorded refusal"))  # returns: the error is the case's result
    """
    if any(mark in str(error) for mark in PEER_GONE):
        raise error


def outcome(action: Any, *args: Any, **kwargs: Any) -> str:
    """``"ok"`` or the error ``action(*args, **kwargs)`` raised, as ``Type: message`` (see :func:`raise_if_peer_gone`).

    Example:
        >>> outcome(int, "x")
        "ValueError: invalid literal for int() with base 10: 'x'"
    """
    try:
        action(*args, **kwargs)
    except Exception as error:
        raise_if_peer_gone(error)
        return f"{type(error).__name__}: {error}"
    return "ok"


class Block(nn.Module):
    """A residual MLP block: the repeated unit a wrap policy names."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Recorded for the precision tests: the dtypes compute really runs in, inside the FSDP unit.
        self.seen_dtypes = (str(x.dtype), str(self.fc1.weight.dtype))
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class ToyModel(L.LightningModule):
    """Embedding -> 3 blocks -> head, regression loss. ``build="init"`` creates layers in ``__init__`` (eager),
    ``build="configure"`` in ``configure_model`` (meta device under the sharded strategy). ``skip_batch``: the
    ``training_step`` of that batch index returns None (Lightning's way to skip a batch)."""

    def __init__(
        self,
        build: str = "init",
        lr: float = 0.01,
        optimizer: str = "adamw",
        n_blocks: int = 3,
        skip_batch: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed: nn.Module | None = None
        if build == "init":
            self._build()

    def _build(self) -> None:
        self.embed = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(self.hparams.n_blocks))
        self.head = nn.Linear(WIDTH, 1)

    def configure_model(self) -> None:
        if self.embed is None:
            self._build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).sum(-1)  # a reduction, not a view: FSDP warns about returned views

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        if batch_idx == self.hparams.skip_batch:
            return None
        x, y = batch
        # Under the mixed precisions FSDP casts the step's floating inputs, `y` too, to the compute dtype; the loss is
        # computed in fp32 (torch < 2.12 cannot backpropagate mse_loss over mixed dtypes: pytorch/pytorch#94086).
        return nn.functional.mse_loss(self(x).float(), y.float())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if self.hparams.optimizer == "adafactor":
            return torch.optim.Adafactor(self.parameters(), lr=self.hparams.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, IN_FEATURES, generator=generator)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(N_SAMPLES, generator=generator)
    return TensorDataset(x, y)


class RankSliceBatchSampler(Sampler[list[int]]):
    """Rank r of W gets samples [s*B + r*B/W, s*B + (r+1)*B/W) at step s: its slice of the one-process batch.
    ``drop``: a global batch index left out. Under tensor parallelism (``tensor_parallel_size`` consecutive ranks
    computing on the same batch) r and W count data-parallel ranks: ``rank // tensor_parallel_size``.

    The rank is read when iteration starts, not when the loader is built: scripts build their loaders before
    ``Trainer.fit`` has initialised the process group.
    """

    def __init__(self, global_batch: int, drop: int | None = None, tensor_parallel_size: int = 1) -> None:
        self.global_batch = global_batch
        self.drop = drop
        self.tensor_parallel_size = tensor_parallel_size

    def __len__(self) -> int:
        return N_SAMPLES // self.global_batch - (self.drop is not None)

    def __iter__(self) -> Iterator[list[int]]:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        rank, world = rank // self.tensor_parallel_size, max(world // self.tensor_parallel_size, 1)
        per_rank = self.global_batch // world
        for index, start in enumerate(range(0, N_SAMPLES, self.global_batch)):
            if index != self.drop:
                yield list(range(start + rank * per_rank, start + (rank + 1) * per_rank))


def rank_slice_loader(global_batch: int, drop: int | None = None, tensor_parallel_size: int = 1) -> DataLoader:
    """Each rank's slice of every global batch but ``drop`` (see :class:`RankSliceBatchSampler`)."""
    return DataLoader(dataset(), batch_sampler=RankSliceBatchSampler(global_batch, drop, tensor_parallel_size))


class GlobalLossRecorder(L.Callback):
    """Records the mean over ranks of each micro-batch's loss: the one-process loss of the global batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not outputs:  # a skipped batch
            return
        loss = outputs["loss"].detach().float().clone()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))


class StateRecorder(L.Callback):
    """Full weights and optimizer state when training starts (just after a resume loaded them) and ends."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}

    def _record(self, when: str, trainer: L.Trainer, model: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        state = {
            "weights": get_model_state_dict(model, options=FULL),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=FULL) if optimizer.state else {},
        }
        # On one rank the gathered tensors can be the live ones (AdamW's `step` counters, the weights): copy.
        self.states[when] = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record("start", trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record("end", trainer, pl_module)


def scenario_parser(scenarios: Iterable[str]) -> argparse.ArgumentParser:
    """The command line every run script shares: scenario names, ``--devices``, ``--reference`` (the one-process
    run) and ``--out`` (where the results go); a script adds its own options."""
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=sorted(scenarios))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    return parser
