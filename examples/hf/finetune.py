"""Fine-tune a Hugging Face causal LM with LightningCLI and the sharded strategy.

Example::

    python examples/hf/finetune.py fit --config configs/hf_llama_tiny.yaml
    lightning-shard export-hf out/hf_llama_tiny/checkpoints/last.ckpt out/hf_llama_tiny/finetuned \\
        --config out/hf_llama_tiny/pretrained

    # LoRA adapters on the frozen base, small checkpoints (configs/hf_llama_tiny_lora.yaml)
    python examples/hf/finetune.py fit --config configs/hf_llama_tiny_lora.yaml
    lightning-shard export-hf out/hf_llama_tiny_lora/checkpoints/last.ckpt out/hf_llama_tiny_lora/merged \\
        --config out/hf_llama_tiny/pretrained --merge-lora

The first run writes a tiny random Llama to ``out/hf_llama_tiny/pretrained`` (``model.random_init``); every run
loads it shard by shard (``lightning_shard.hf.from_pretrained``), trains, and saves a sharded checkpoint that
``lightning-shard export-hf`` turns back into a directory ``AutoModelForCausalLM.from_pretrained`` loads.
A real model: ``--model.pretrained_path DIR --model.random_init null --data.tokenizer_path DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Running this file as a script puts examples/hf/ on sys.path, not the repository root that `examples` lives in.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_shard  # noqa: E402, F401  (registers the "fully_sharded" strategies)
from examples.hf.data import TextDataModule  # noqa: E402
from examples.hf.model import HFCausalLM  # noqa: E402


def main(args: list[str] | None = None) -> None:
    """Run the CLI; after ``fit``, print on rank 0 the command that exports the last checkpoint to HF."""
    cli = LightningCLI(
        HFCausalLM,
        TextDataModule,
        # The data module shards by rank itself and keeps its sampler resumable (see TokenDataModule).
        trainer_defaults={"use_distributed_sampler": False},
        save_config_kwargs={"overwrite": True},
        args=args,
    )
    saver = cli.trainer.checkpoint_callback
    if cli.subcommand == "fit" and cli.trainer.is_global_zero and saver is not None and saver.last_model_path:
        last, pretrained = Path(saver.last_model_path), cli.model.hparams.pretrained_path

        def export(name: str) -> str:
            return f"lightning-shard export-hf {last} {last.parent.parent / name} --config {pretrained}"

        if cli.model.hparams.lora is None:
            print(f"\nExport to Hugging Face:\n  {export('finetuned')}")
        else:
            print(
                "\nExport to Hugging Face, the base with the adapters merged into it, or the adapters alone (peft):\n"
                f"  {export('merged')} --merge-lora\n  {export('adapter')} --adapter-only"
            )


if __name__ == "__main__":
    main()
