"""Sample text from a trained byte-level GPT checkpoint.

``CKPT`` is either a single ``.ckpt`` file or a sharded checkpoint directory written by
``torch.distributed.checkpoint`` (the strategy's ``state_dict_type="sharded"``), which is first converted into one
file. Either holds the weights under ``state_dict`` and the model's constructor arguments under ``hyper_parameters``;
a run with a weight-averaging callback (``EMAWeightAveraging``) also holds their averaged copy, which
``--weights averaged`` samples from.

Example::

    python examples/gpt/generate.py out/gpt_tiny/checkpoints/last.ckpt --prompt "def " --max-new-tokens 100
    python examples/gpt/generate.py out/gpt_tiny/checkpoints/last.ckpt --weights averaged
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# Running this file as a script puts examples/gpt/ on sys.path, not the repository root that `examples` lives in.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from examples.gpt.data import decode_bytes, encode_bytes  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_shard.checkpoint.averaged import averaged_state_dict  # noqa: E402


def load_gpt(checkpoint: str | Path, weights: str = "trained") -> GPT:
    """Rebuild a :class:`GPT` on the CPU from a ``.ckpt`` file or a sharded checkpoint directory, with its
    ``"trained"`` weights or their ``"averaged"`` copy.

    Example:
        >>> model = load_gpt("out/gpt_tiny/checkpoints/last.ckpt", weights="averaged")  # doctest: +SKIP
    """
    checkpoint = Path(checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        single_file = Path(tmp) / "checkpoint.pt" if checkpoint.is_dir() else checkpoint
        if checkpoint.is_dir():
            dcp_to_torch_save(checkpoint, single_file)
        model = GPT.load_from_checkpoint(single_file, map_location="cpu")
        if weights == "averaged":
            model.load_state_dict(averaged_state_dict(torch.load(single_file, map_location="cpu", weights_only=False)))
        return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Sample text from a byte-level GPT checkpoint.")
    parser.add_argument("checkpoint", help="a .ckpt file or a sharded checkpoint directory")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--weights", choices=("trained", "averaged"), default="trained", help="the trained weights or their EMA copy"
    )
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = load_gpt(args.checkpoint, args.weights).eval()
    idx = torch.tensor([encode_bytes(args.prompt)], dtype=torch.long)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k)
    print(decode_bytes(out[0].tolist()))


if __name__ == "__main__":
    main()
