"""Train the GPT example and a tiny transformers Llama with tensor parallelism (``ShardedStrategy(
tensor_parallel_size=...)``) under one or more scenarios; save per-step global losses, the final full weights and each
rank's parameter bytes.

    python tests/tensor_parallel_run.py --devices 4 --tp 2 --out OUT gpt llama ...
``--devices 1 --reference``: the one-process reference (Lightning's single-device strategy). ``--model-parallel``:
Lightning's own ``ModelParallelStrategy``, the same plan applied by hand in ``configure_model()`` with torch's
``parallelize_module`` and ``fully_shard``, as its users write it.
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
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_run import llama_config  # noqa: E402
from toy import FULL, N_SAMPLES, QUIET, GlobalLossRecorder, RankSliceBatchSampler  # noqa: E402

import lightning_shard  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, MAX_STEPS = 128, 16, 8, 6

# name -> (model family, ShardedStrategy arguments, Trainer arguments)
SCENARIOS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "gpt": ("gpt", {}, {}),
    "llama": ("llama", {}, {}),
}


class Llama(L.LightningModule):
    """A tiny transformers Llama (untied head) built in ``configure_model()``; ``by_hand``: split and sharded there
    with torch's tensor parallel API, as a user of Lightning's ModelParallelStrategy writes it."""

    def __init__(self, by_hand: bool = False) -> None:
        super().__init__()
        self.by_hand = by_hand
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(llama_config())
        if self.by_hand:
            tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            layer = {f"self_attn.{name}_proj": ColwiseParallel() for name in "qkv"}
            layer |= {f"mlp.{name}_proj": ColwiseParallel() for name in ("gate", "up")}
            layer |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
            body = self.model.model
            parallelize_module(body.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
            parallelize_module(self.model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
            for block in body.layers:
                parallelize_module(block, tp_mesh, layer)
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)  # the module `training_step` calls

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class HandSplitGPT(GPT):
    """The GPT example with its plan applied by hand in ``configure_model()`` (Lightning's ModelParallelStrategy)."""

    def configure_model(self) -> None:
        if self.transformer is not None:
            return
        super().configure_model()
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        parallelize_module(self.transformer.wte, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
        for block in self.transformer.h:
            plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()}
            plan |= {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
            parallelize_module(block, tp_mesh, plan)
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self, mesh=dp_mesh)


def make_model(family: str, by_hand: bool) -> L.LightningModule:
    if family == "llama":
        return Llama(by_hand)
    gpt = HandSplitGPT if by_hand else GPT
    return gpt(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ, learning_rate=1e-3,
               warmup_steps=1, max_steps=100)  # fmt: skip


def token_loader(tensor_parallel_size: int) -> DataLoader:
    """A learnable sequence (each token determines the next) from a random first token, as ``(x, y)`` windows."""
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(3, VOCAB, (N_SAMPLES, SEQ + 1), generator=generator)
    for position in range(1, SEQ + 1):
        tokens[:, position] = (tokens[:, position - 1] * 5 + 3) % VOCAB
    dataset = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return DataLoader(dataset, batch_sampler=RankSliceBatchSampler(GLOBAL_BATCH, None, tensor_parallel_size))


def run(name: str, devices: int, tp: int, mode: str, out: Path) -> None:
    family, strategy_kwargs, trainer_kwargs = SCENARIOS[name]
    L.seed_everything(0, verbose=False)
    model = make_model(family, by_hand=mode == "model_parallel")
    if mode == "reference":
        strategy: Any = "auto"
    elif mode == "model_parallel":
        strategy = ModelParallelStrategy(data_parallel_size=devices // tp, tensor_parallel_size=tp)
    else:
        strategy = lightning_shard.ShardedStrategy(tensor_parallel_size=tp, **strategy_kwargs)
    recorder = GlobalLossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=MAX_STEPS,
        callbacks=[recorder],
        **QUIET,
        **trainer_kwargs,
    )
    trainer.fit(model, train_dataloaders=token_loader(tp if mode != "reference" else 1))
    result: dict[str, Any] = {
        "losses": recorder.losses,
        "weights": get_model_state_dict(model, options=FULL),
        "parameter_bytes": _per_rank(_parameter_bytes(model)),
    }
    if trainer.is_global_zero:
        torch.save(result, out / f"{name}.pt")


def _parameter_bytes(model: nn.Module) -> int:
    """The bytes of this rank's parameter shards (every parameter, TP-split and FSDP-sharded, or whole)."""
    local = [getattr(param, "_local_tensor", param) for param in model.parameters()]
    return sum(tensor.numel() * tensor.element_size() for tensor in local)


def _per_rank(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--model-parallel", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "reference" if args.reference else "model_parallel" if args.model_parallel else "sharded"
    for name in args.scenarios:
        run(name, args.devices, args.tp, mode, args.out)


if __name__ == "__main__":
    main()
