"""A tiny Hugging Face causal LM trained 2 steps on 2 ranks, saved as a sharded and a full checkpoint.

    python tests/hf_export_run.py llama --out DIR
    python tests/hf_export_run.py gpt2 --out DIR      # tied embeddings (lm_head.weight = transformer.wte.weight)

The HF model is built eagerly in the LightningModule's ``__init__`` (broadcast from rank 0 and sharded as it is),
under the attribute ``model`` (llama) or ``lm`` (gpt2), so the checkpoints' weights are named ``model.*`` / ``lm.*``.
Writes ``DIR/config/config.json`` (the HF config), ``DIR/sharded.ckpt`` (a torch.distributed.checkpoint
directory), ``DIR/full.ckpt`` (one file) and ``DIR/weights.pt``: the trained HF model's full state dict, gathered
to rank 0, the reference the exports are compared against.

The llama run trains a second model in the same steps (one launch serves both): a LoRA Llama under the attribute
``lora``, ``get_peft_model`` of another Llama with the adapters of :data:`LORA` (saved in the checkpoint's
hyper-parameters as ``lora``), the optimizer over its trainable parameters only. Its base, before the adapters, is
written to ``DIR/lora_base`` with ``save_pretrained`` (the "pretrained model" of a LoRA fine-tune), its trained
state (peft's names) to ``DIR/lora_weights.pt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hf_run import VOCAB, gpt2_config, llama_config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

import lightning_shard

SEQ, BATCH = 16, 4
ATTRIBUTE = {"llama": "model", "gpt2": "lm"}
# Adapters on the attention's q and v projections (scaling alpha / r = 2) and a trained copy of the output head.
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}
LORA_BASE_SEED = 1  # the LoRA model's base is drawn from its own seed, so the launcher's process can write it alike


def tiny_config(kind: str):
    """The HF config of the tiny test models (``tests/hf_run.py``'s, float32)."""
    return llama_config() if kind == "llama" else gpt2_config()


def lora_base() -> torch.nn.Module:
    """The LoRA model's base Llama, the same in every process."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(LORA_BASE_SEED)
        return AutoModelForCausalLM.from_config(tiny_config("llama"))


class HFModule(L.LightningModule):
    """Next-token loss of an HF causal LM kept under the attribute ``attribute`` (plus, with ``lora``, that of a
    LoRA model under ``lora``)."""

    def __init__(self, kind: str, lora: dict[str, Any] | None = None) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.save_hyperparameters()
        self.attribute = ATTRIBUTE[kind]
        setattr(self, self.attribute, AutoModelForCausalLM.from_config(tiny_config(kind)))
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            self.lora = get_peft_model(lora_base(), LoraConfig(**lora))

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        models = [getattr(self, self.attribute)] + ([self.lora] if self.hparams.lora else [])
        return sum(_loss(model, tokens) for model in models)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=sorted(ATTRIBUTE))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    lora = LORA if args.kind == "llama" else None
    if lora is not None and "LOCAL_RANK" not in os.environ:  # the launching process, before it starts the others
        lora_base().save_pretrained(args.out / "lora_base")
    L.seed_everything(0, verbose=False)
    module = HFModule(args.kind, lora)
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
    gathered = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(hf_model, options=gathered)
    lora_weights = get_model_state_dict(module.lora, options=gathered) if lora is not None else None
    if trainer.is_global_zero:
        hf_model.config.save_pretrained(args.out / "config")
        torch.save(weights, args.out / "weights.pt")
        if lora_weights is not None:
            torch.save(lora_weights, args.out / "lora_weights.pt")


if __name__ == "__main__":
    main()
