"""Train the GPT example with Lightning Fabric on the sharded strategy: a training loop of your own.

The same model (``examples/gpt/model.py``) and data (``examples/gpt/data.py``, by default the Python standard
library's own source: nothing is downloaded) as the Trainer example, in a loop shaped like litgpt's: the model built
on the meta device and sharded by ``fabric.setup``, gradient accumulation under ``fabric.no_backward_sync``,
clipping, a periodic checkpoint holding the model, optimizer, scheduler and the data order, and a sample at the end.

    python examples/fabric/train.py                                    # tiny GPT, 2 CPU ranks, 75 s
    python examples/fabric/train.py --max-steps 300 --resume out/fabric_gpt/last.ckpt   # train on from a checkpoint
    python examples/fabric/train.py --accelerator cuda --devices 8 --precision bf16-mixed --n-layer 24 --n-embd 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

# Running this file as a script puts examples/fabric/ on sys.path, not the repository root that `examples` lives in.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.gpt.data import TokenDataModule  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from examples.gpt.train import sample_text  # noqa: E402
from lightning_shard.fabric import ShardedStrategy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--state-dict-type", choices=["sharded", "full"], default="sharded")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch and rank")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="text read from the data source")
    parser.add_argument("--data-path", default=None, help="train.bin/val.bin directory or text; default: stdlib")
    parser.add_argument("--out", type=Path, default=Path("out/fabric_gpt"))
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint written by this script")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    strategy = ShardedStrategy(
        auto_wrap_policy=["Block"], state_dict_type=args.state_dict_type, gradient_accumulation="unsharded"
    )
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(1234)

    data = TokenDataModule(
        data_path=args.data_path, block_size=args.block_size, batch_size=args.batch_size, max_bytes=args.max_bytes
    )
    data.setup("fit")
    train_loader = data.train_dataloader()  # splits the windows by rank itself, and resumes mid-epoch

    model = GPT(
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        vocab_size=data.vocab_size or 50272,
        block_size=args.block_size,
        learning_rate=args.learning_rate,
        warmup_steps=min(20, args.max_steps // 10 + 1),
        max_steps=args.max_steps,
    )
    with fabric.init_module(empty_init=True):  # the meta device; `setup` shards, then initialises each module
        model.configure_model()
    model = fabric.setup(model)
    configured = model.configure_optimizers()  # AdamW and its warm-up + cosine schedule, as under the Trainer
    optimizer = fabric.setup_optimizers(configured["optimizer"])
    scheduler = configured["lr_scheduler"]["scheduler"]

    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": train_loader}
    state["step"] = 0
    if args.resume is not None:
        fabric.load(args.resume, state)
        fabric.print(f"resumed from {args.resume} at step {state['step']}")

    batches = _batches(train_loader)
    while state["step"] < args.max_steps:
        for micro in range(args.accumulate):
            x, y = fabric.to_device(next(batches))
            # Only under gradient_accumulation="unsharded" does this skip the reduce-scatter of the first micro-batches
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        if state["step"] % args.log_every == 0 or state["step"] == 1:
            fabric.print(f"step {state['step']} loss {float(fabric.all_reduce(loss.detach())):.4f}")
        if state["step"] % args.save_every == 0 or state["step"] == args.max_steps:
            fabric.save(args.out / "last.ckpt", state)

    text = sample_text(model)  # every rank calls it: each forward gathers parameters from all of them
    fabric.print(f"\n--- sample ---\n{text}\n--------------")


def _batches(loader: torch.utils.data.DataLoader) -> Any:
    """The loader's batches across epochs, telling its sampler what training used (for a mid-epoch resume)."""
    while True:
        for batch in loader:
            loader.sampler.consume(len(batch[0]))
            yield batch
        loader.sampler.set_epoch(loader.sampler.epoch + 1)


if __name__ == "__main__":
    main()
