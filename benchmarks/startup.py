"""From ``trainer.fit`` to the first step, and its setup part, for the GPT-3 family (``examples/gpt``), fresh and
resumed, on 2 CPU ranks.

    python benchmarks/startup.py                                   # -> benchmarks/results/startup.json
    python benchmarks/startup.py --sizes small medium --paths default anchor

Paths:

* ``default``: ``Trainer(strategy="fully_sharded")``, the model built in ``configure_model()`` (the meta device, then
  the initialisation rule: every tensor equal to the eager build).
* ``anchor``: Lightning's ``ModelParallelStrategy`` with ``fully_shard`` by hand on each block and the root in
  ``configure_model()`` (built on the meta device); Lightning then materialises with ``to_empty`` + each module's
  ``reset_parameters()`` on the shards (each rank draws its shards from its own generator: not the eager values).
* ``eager``: the whole model built in one process (``configure_model()`` on the CPU), for scale.
* ``resume`` (``default`` only): a fresh run saves a sharded checkpoint after one step; a new Trainer resumes it.

Times on rank 0, in seconds: ``setup`` from the callbacks' ``setup`` to ``on_fit_start`` (configure_model, sharding,
materialisation, optimizer); ``to_first_step`` from ``fit`` to the first ``on_train_batch_start`` (process group,
setup, the checkpoint restore on resume). The step itself is one batch of 1 x 16 tokens (not measured). fp32, one
thread per rank; the machine is shared, so its load is recorded with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.results_files import result_path, write_result  # noqa: E402
from examples.gpt.model import GPT, GPT3_SIZES  # noqa: E402

NAMES = {"small": "125M", "medium": "350M", "large": "760M", "xl": "1.3B"}
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}


class Clock(Callback):
    """The moments the startup passes, on rank 0."""

    def __init__(self, start: float) -> None:
        self.times = {"fit": start}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.times.setdefault("setup", time.perf_counter())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.times["fit_start"] = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        self.times.setdefault("first_step", time.perf_counter())


class AnchorGPT(GPT):
    """The GPT as a user of Lightning's ModelParallelStrategy shards it by hand."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.transformer is not None:
            return
        with torch.device("meta"):
            super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.transformer["h"]:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def gpt(size: str, anchor: bool = False) -> GPT:
    n_layer, n_embd, n_head = GPT3_SIZES[size]
    return (AnchorGPT if anchor else GPT)(n_layer=n_layer, n_head=n_head, n_embd=n_embd, max_steps=10, warmup_steps=1)


def tokens() -> DataLoader:
    ids = torch.randint(0, 50272, (64, 17), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=1)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    start = time.perf_counter()
    clock = Clock(start)
    if args.path == "anchor":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        import lightning_shard  # noqa: F401

        strategy = "fully_sharded"
    steps = 2 if args.resume else 1
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, callbacks=[clock], **QUIET)
    model = gpt(args.size, anchor=args.path == "anchor")
    trainer.fit(model, tokens(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    if trainer.is_global_zero:
        t = clock.times
        params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global shape
        row = {
            "setup_s": round(t["fit_start"] - t["setup"], 2),
            "to_first_step_s": round(t["first_step"] - t["fit"], 2),
            "launch_s": round(t["setup"] - t["fit"], 2),  # the other rank's start, the process group
            "restore_s": round(t["first_step"] - t["fit_start"], 2),  # the checkpoint load on resume
            "params": params,
        }
        print("ROW " + json.dumps(row), flush=True)


def eager(size: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = gpt(size)
    start = time.perf_counter()
    model.configure_model()
    seconds = time.perf_counter() - start
    return {"setup_s": round(seconds, 2), "params": sum(p.numel() for p in model.parameters())}


def launch(*argv: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    out = subprocess.run(
        [sys.executable, __file__, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1800,
        check=False,
    ).stdout
    rows = [line[4:] for line in out.splitlines() if line.startswith("ROW ")]
    if not rows:
        raise RuntimeError(f"{argv} printed no result:\n{out[-3000:]}")
    return {**json.loads(rows[-1]), "loadavg": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["small", "medium", "large"])
    parser.add_argument("--paths", nargs="+", default=["default", "resume", "anchor", "eager"])
    parser.add_argument("--worker", dest="path")
    parser.add_argument("--size")
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--eager-only", action="store_true")
    parser.add_argument("--out", type=Path, default=result_path("startup"))
    args = parser.parse_args()
    if args.eager_only:
        print("ROW " + json.dumps(eager(args.size)), flush=True)
        return
    if args.path:
        worker(args)
        return
    results: list[dict[str, Any]] = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as scratch:
            checkpoint = str(Path(scratch) / "fresh.ckpt")
            for path in args.paths:
                if path == "eager":
                    row = launch("--eager-only", "--size", size)
                elif path == "resume":
                    row = launch("--worker", "default", "--size", size, "--resume", checkpoint)
                else:
                    save = ("--save", checkpoint) if path == "default" and "resume" in args.paths else ()
                    row = launch("--worker", path, "--size", size, *save)
                ranks = 1 if path == "eager" else 2
                per_billion = row["setup_s"] / (row["params"] / 1e9)
                results.append({"size": NAMES[size], "path": path, "ranks": ranks, **row, "setup_s_per_b": per_billion})
                print(results[-1], flush=True)
                write_result(args.out, "startup", {"rows": results})


if __name__ == "__main__":
    main()
