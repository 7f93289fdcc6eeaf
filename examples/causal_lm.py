"""What the example language models share: next-token loss, the step methods, validation loss and perplexity
averaged over the ranks, and AdamW with a linear warm-up and cosine decay (GPT-3's recipe)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``.

    Example:
        >>> [round(warmup_cosine(s, 10, 110, 0.1), 3) for s in (0, 9, 60, 110, 200)]
        [0.1, 1.0, 0.55, 0.1, 0.1]
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalLM(LightningModule):
    """Steps of a causal language model on ``(x, y)`` token windows, ``y`` being ``x`` shifted by one.

    Subclasses define ``forward(x) -> logits``, a ``self.val_loss`` ``torchmetrics.MeanMetric`` and hyper-parameters
    ``learning_rate``, ``weight_decay``, ``warmup_steps``, ``max_steps`` and ``min_lr_ratio``.

    Example:
        >>> from examples.gpt.model import GPT
        >>> isinstance(GPT(n_layer=1, n_head=1, n_embd=8, vocab_size=256, block_size=8), CausalLM)
        True
    """

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch))

    def on_validation_epoch_end(self) -> None:
        # compute() already averages over all ranks; sync_dist=True only tells Lightning the values are global.
        mean_loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val_loss", mean_loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", torch.exp(mean_loss), sync_dist=True)

    def adamw_warmup_cosine(
        self, decay: list[torch.nn.Parameter], no_decay: list[torch.nn.Parameter], **adamw: Any
    ) -> dict[str, Any]:
        """AdamW (weight decay on ``decay`` only) stepped per optimizer step along :func:`warmup_cosine`."""
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate,
            **adamw,
        )
        max_steps = hp.max_steps if hp.max_steps is not None else int(self.trainer.estimated_stepping_batches)

        # A plain function (not a functools.partial): LambdaLR then checkpoints `lr_lambdas` as [None] instead of
        # [{}], and torch.distributed.checkpoint drops empty containers, which would break resuming.
        def schedule(step: int) -> float:
            return warmup_cosine(step, hp.warmup_steps, max_steps, hp.min_lr_ratio)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
