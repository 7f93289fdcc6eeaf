"""A tiny Hugging Face causal LM trained 2 steps on 2 ranks, saved as a sharded and a full checkpoint.

    python tests/hf_export_run.py llama --out DIR
    python tests/hf_export_run.py gpt2 --out DIR      # tied embeddings (lm_head.weight = transformer.wte.weight)

The HF model is built eagerly in the LightningModule's ``__init__`` (broadcast from rank 0 and sharded as it is),
under the attribute ``model`` (llama) or ``lm`` (gpt2), so the checkpoints' weights are named ``model.*`` / ``lm.*``.
Writes ``DIR/config/config.json`` (the HF config), ``DIR/sharded.ckpt`` (a torch.distributed.checkpoint
directory), ``DIR/full.ckpt`` (one file) and ``DIR/weights.pt``: the trained HF model's full state dict, gathered
to rank 0, the reference the exports are compared against.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import lightning as L
import torch
from hf_run import VOCAB, gpt2_config, llama_config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

import lightning_shard

SEQ, BATCH = 16, 4
ATTRIBUTE = {"llama": "model", "gpt2": "lm"}


def tiny_config(kind: str):
    """The HF config of the tiny test models (``tests/hf_run.py``'s, float32)."""
    return llama_config() if kind == "llama" else gpt2_config()


class HFModule(L.LightningModule):
    """Next-token loss of an HF causal LM kept under the attribute ``attribute``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.attribute = ATTRIBUTE[kind]
        setattr(self, self.attribute, AutoModelForCausalLM.from_config(tiny_config(kind)))

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = getattr(self, self.attribute)(input_ids=tokens[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=sorted(ATTRIBUTE))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    L.seed_everything(0, verbose=False)
    module = HFModule(args.kind)
    tokens = torch.randint(0, VOCAB, (2 * BATCH * 2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_shard.ShardedStrategy(),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=BATCH))
    trainer.save_checkpoint(args.out / "sharded.ckpt")
    strategy = trainer.strategy
    strategy.config = dataclasses.replace(strategy.config, state_dict_type="full")
    trainer.save_checkpoint(args.out / "full.ckpt")
    hf_model = getattr(module, module.attribute)
    weights = get_model_state_dict(hf_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.is_global_zero:
        hf_model.config.save_pretrained(args.out / "config")
        torch.save(weights, args.out / "weights.pt")


if __name__ == "__main__":
    main()
