"""Sharded vs full checkpoint save/load of a ~100M-parameter GPT on 2 CPU ranks, against a raw
``torch.save`` / ``torch.load`` of the same checkpoint content on one process.

    python benchmarks/checkpoint_io.py                   # -> benchmarks/results/checkpoint_io.json

One launch (Lightning popen launcher, ``ShardedStrategy`` FULL_SHARD, 2 ranks): one training step so the AdamW
states exist, then in ``on_train_end``, alternating for ``--repeats`` rounds:
  sharded  ``trainer.save_checkpoint`` with ``state_dict_type="sharded"`` (every rank writes its shards; DCP dir),
           then ``strategy.load_checkpoint`` of it (what ``fit(ckpt_path=...)`` runs: into the sharded model/optim);
  full     the same with ``state_dict_type="full"`` (gathered to rank 0, one file; loaded by rank 0 and broadcast);
  raw      rank 0 alone: ``torch.load`` of the full file's content, ``torch.save`` of it to a new file and
           ``torch.load`` of that (the bytes a plain single-process save/load moves).
Every timing has a barrier on both ends. MB/s = bytes on disk / seconds (MB = 1e6 bytes). The files are written
to ``--dir`` (default a temporary directory) and removed; loads right after saves read from the page cache, so load
rates are cache rates, as they are for the raw baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, barrier, machine, median, peak_rss_bytes, random_token_dataset, write_json

MODEL = dict(n_layer=14, n_head=12, n_embd=768, vocab_size=256, block_size=256, dropout=0.0, warmup_steps=1)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    import lightning_shard
    from examples.gpt.model import GPT

    class CheckpointTimer(Callback):
        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []

        def _timed(self, fn) -> float:
            barrier()
            start = time.perf_counter()
            fn()
            barrier()
            return time.perf_counter() - start

        def on_train_end(self, trainer, pl_module) -> None:
            strategy = trainer.strategy
            root = Path(strategy.broadcast(args.dir))
            original = strategy.config
            for repeat in range(args.repeats):
                full_file = None
                for kind in ("sharded", "full"):
                    path = root / f"{kind}-{repeat}.ckpt"
                    strategy.config = dataclasses.replace(original, state_dict_type=kind)
                    save = self._timed(partial(trainer.save_checkpoint, path))
                    size = strategy.broadcast(_size(path) if trainer.is_global_zero else 0)
                    load = self._timed(partial(strategy.load_checkpoint, path))
                    record = dict(repeat=repeat, kind=kind, bytes=size, save_seconds=save, load_seconds=load)
                    self.records.append(record)
                    if kind == "full":
                        full_file = path
                    else:
                        barrier()
                        if trainer.is_global_zero:
                            shutil.rmtree(path)
                strategy.config = original
                # raw: one process, the same content
                raw: dict[str, float] = {}

                def raw_round(full_file: Path = full_file, repeat: int = repeat, raw: dict = raw) -> None:
                    if not trainer.is_global_zero:
                        return
                    start = time.perf_counter()
                    content = torch.load(full_file, weights_only=False)
                    raw["load_src_seconds"] = time.perf_counter() - start
                    target = root / f"raw-{repeat}.pt"
                    start = time.perf_counter()
                    torch.save(content, target)
                    raw["save_seconds"] = time.perf_counter() - start
                    del content
                    start = time.perf_counter()
                    torch.load(target, weights_only=False)
                    raw["load_seconds"] = time.perf_counter() - start
                    raw["bytes"] = target.stat().st_size
                    target.unlink()
                    full_file.unlink()

                self._timed(raw_round)
                raw = strategy.broadcast(raw)
                self.records.append(dict(repeat=repeat, kind="raw", **raw))

    L.seed_everything(1234, verbose=False)
    model = GPT(**{**MODEL, "n_layer": args.n_layer}, max_steps=1)
    data = random_token_dataset(2, 64, MODEL["vocab_size"])
    timer = CheckpointTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=lightning_shard.ShardedStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy=["Block"]),
        precision="32-true",
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=1))
    if trainer.is_global_zero:
        num_params = sum(p.numel() for p in trainer.strategy.model.parameters())
        Path(args.out).write_text(
            json.dumps({"records": timer.records, "num_params": num_params, "peak_rss_rank0": peak_rss_bytes()})
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=MODEL["n_layer"])
    parser.add_argument("--output", default=str(RESULTS / "checkpoint_io.json"))
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return

    import subprocess

    machine_start = machine()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=args.dir) as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out), "--dir", tmp]
        cmd += ["--devices", str(args.devices), "--repeats", str(args.repeats), "--n-layer", str(args.n_layer)]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        env["PYTHONWARNINGS"] = "ignore"
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"checkpoint benchmark failed with exit code {proc.returncode}")
        data = json.loads(out.read_text())
        wall = time.perf_counter() - start
    summary = {}
    for kind in ("sharded", "full", "raw"):
        sel = [r for r in data["records"] if r["kind"] == kind]
        save, load = median([r["save_seconds"] for r in sel]), median([r["load_seconds"] for r in sel])
        size = sel[0]["bytes"]
        summary[kind] = {
            "bytes": size,
            "save_seconds": save,
            "load_seconds": load,
            "save_MBps": size / save / 1e6,
            "load_MBps": size / load / 1e6,
        }
        print(
            f"{kind:8s} {size / 1e6:8.1f} MB  save {save:6.2f}s ({size / save / 1e6:6.0f} MB/s)  "
            f"load {load:6.2f}s ({size / load / 1e6:6.0f} MB/s)"
        )
    write_json(
        Path(args.output),
        {
            "benchmark": "checkpoint_io",
            "command": "python benchmarks/checkpoint_io.py " + " ".join(sys.argv[1:]),
            "model": {**MODEL, "n_layer": args.n_layer},
            "num_params": data["num_params"],
            "devices": args.devices,
            "machine_start": machine_start,
            "machine_end": machine(),
            "wall_seconds": wall,
            "records": data["records"],
            "peak_rss_rank0": data["peak_rss_rank0"],
            "median": summary,
        },
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
