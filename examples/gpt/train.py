"""Train the GPT example with LightningCLI.

Example::

    python examples/gpt/train.py fit --config configs/gpt_tiny.yaml
    python examples/gpt/train.py fit --config configs/gpt_tiny.yaml --ckpt_path out/gpt_tiny/last.ckpt  # resume

The model's ``block_size`` is passed on to the data module, so it is set once, under ``model:``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Running this file as a script puts examples/gpt/ on sys.path, not the repository root that `examples` lives in.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402

import lightning_shard  # noqa: E402, F401  (registers the "fully_sharded" strategies)
from examples.gpt.data import BYTE_VOCAB_SIZE, TokenDataModule, decode_bytes, encode_bytes  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402

SAMPLE_PROMPT = "def "


class GPTCLI(LightningCLI):
    """LightningCLI that gives the data module the model's context length."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.block_size", "data.block_size")


def sample_text(model: GPT, prompt: str = SAMPLE_PROMPT, max_new_tokens: int = 64, seed: int = 0) -> str:
    """Continue ``prompt`` with a byte-level model (top-k 10 sampling).

    Every rank of a sharded model must call this together, because each forward gathers parameters from all
    ranks; the shared seed keeps the ranks' sampled tokens identical.

    Example:
        >>> model = GPT(n_layer=1, n_head=1, n_embd=8, vocab_size=256, block_size=16)
        >>> model.configure_model()
        >>> sample_text(model, "ab", max_new_tokens=4).startswith("ab")
        True
    """
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    idx = torch.tensor([encode_bytes(prompt)], dtype=torch.long, device=device)
    out = model.generate(idx, max_new_tokens=max_new_tokens, top_k=10)
    model.train(was_training)
    return decode_bytes(out[0].tolist())


def main(args: list[str] | None = None) -> None:
    """Run the CLI; after ``fit`` of a byte-level model, print a short sample on rank 0."""
    cli = GPTCLI(
        GPT,
        TokenDataModule,
        # The data module shards by rank itself and keeps its sampler resumable (see TokenDataModule).
        trainer_defaults={"use_distributed_sampler": False},
        save_config_kwargs={"overwrite": True},
        args=args,
    )
    if cli.subcommand == "fit" and cli.model.hparams.vocab_size == BYTE_VOCAB_SIZE:
        text = sample_text(cli.model)
        if cli.trainer.is_global_zero:
            print(f"\n--- sample ---\n{text}\n--------------")


if __name__ == "__main__":
    main()
