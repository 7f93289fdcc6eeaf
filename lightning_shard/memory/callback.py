"""``ShardedMemoryMonitor``: per-rank memory of a Lightning fit, logged for every rank and summarised at the end."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_shard.memory.accounting import gradient_bytes, optimizer_state_bytes, parameter_bytes
from lightning_shard.memory.process_memory import cuda_memory, host_memory
from lightning_shard.memory.report import Sample, format_rank_table, write_csv, write_json
from lightning_shard.memory.svg_plot import write_svg_plot


class ShardedMemoryMonitor(Callback):
    """Report the memory each rank holds every ``log_every_n_steps`` optimizer steps and at the end of training.

    Per rank it measures the bytes of its parameter shards, gradients and optimizer states (from local shards, see
    :mod:`lightning_shard.memory.accounting`), the process RSS and peak RSS, and on CUDA the allocator's peak
    allocated / reserved / active bytes. Lightning loggers write from rank 0 only, so the figures of all ranks are
    gathered to rank 0 and logged as ``memory/rank{r}/<metric>``. At the end of training rank 0 prints a table
    (rows = ranks, MiB) and, with ``output_dir``, writes ``memory.csv``, ``memory.json`` (per-rank history) and
    ``memory.svg`` (a plot drawn with the standard library).

    Gradients are sampled in ``on_before_optimizer_step`` because ``zero_grad(set_to_none=True)`` frees them before
    the batch ends; the last sample is reported. Per step the cost is one pass over the parameters; the collective
    and the host/CUDA queries only run on logging steps.

    Example:
        >>> monitor = ShardedMemoryMonitor(log_every_n_steps=10, output_dir="memory")
        >>> trainer = pl.Trainer(callbacks=[monitor])  # doctest: +SKIP
    """

    def __init__(self, log_every_n_steps: int = 50, output_dir: str | Path | None = None) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.history: list[Sample] = []  # filled on rank 0 only
        self._last_grads_bytes = 0
        self._last_logged_step = -1

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._last_grads_bytes = gradient_bytes(pl_module.parameters())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # With gradient accumulation several batches end on the same global step (the first ones on step 0, before
        # any optimizer step); log each step once.
        if step == 0 or step % self.log_every_n_steps or step == self._last_logged_step:
            return
        self._record(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_train_end rather than on_fit_end: the latter runs after strategy teardown (model moved, groups gone).
        if trainer.global_step != self._last_logged_step:
            self._record(trainer, pl_module)
        if trainer.is_global_zero and self.history:
            self._summarise()

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int]:
        # The strategy's device, not `pl_module.device`: a strategy that leaves the module's device property behind
        # must not hide the CUDA figures.
        device = trainer.strategy.root_device
        figures = {
            "params_bytes": parameter_bytes(pl_module.parameters()),
            "grads_bytes": self._last_grads_bytes,
            "optimizer_bytes": optimizer_state_bytes(trainer.optimizers),
            **host_memory(),
        }
        if device.type == "cuda":
            figures.update(cuda_memory(device))
        return figures

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_logged_step = trainer.global_step
        figures = self._measure(trainer, pl_module)
        names = list(figures)
        # float64 holds byte counts exactly up to 2**53 (8 PiB); one small collective per logging step.
        # On the strategy's device: nccl gathers device tensors only.
        local = torch.tensor([figures[n] for n in names], dtype=torch.float64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(local).reshape(-1, len(names)).cpu().tolist()
        if not trainer.is_global_zero:
            return
        ranks = [dict(zip(names, row, strict=True)) for row in gathered]
        self.history.append({"step": trainer.global_step, "ranks": ranks})
        metrics = {f"memory/rank{r}/{name}": value for r, values in enumerate(ranks) for name, value in values.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _summarise(self) -> None:
        last = self.history[-1]
        print(f"Per-rank memory at step {last['step']}:\n{format_rank_table(last['ranks'])}", flush=True)
        if self.output_dir is None:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_csv(self.history, self.output_dir / "memory.csv")
        write_json(self.history, self.output_dir / "memory.json")
        print(write_svg_plot(self.history, self.output_dir / "memory.svg"), flush=True)
