"""Checkpoint loads against one process's ``torch.load`` of the same bytes, and rank 0's memory while loading a
full checkpoint.

    python benchmarks/checkpoint_io.py                   # -> benchmarks/results/checkpoints.json
    python benchmarks/checkpoint_io.py --skip-memory     # the speed rounds only

Speed (one launch: GPT, 100M parameters + AdamW, ``ShardedStrategy`` FULL_SHARD on 2 CPU ranks, Lightning's
launcher): one training step so the AdamW states exist; the checkpoint is saved once in each format (timed: a sharded
directory, a full file, and a raw ``torch.save`` of the full file's content by rank 0) and each is loaded once to warm
the page cache; then, for ``--repeats`` rounds, in this order:
  best      a fresh process ``torch.load``-s the raw file twice with glibc told to keep freed memory, and times the
            second load inside it: it reuses every page the first faulted in, the fastest a one-process
            ``torch.load`` gets (the page cache copied into memory that exists); reported alongside;
  raw       rank 0 alone ``torch.load``-s it, right after an untimed load of it was freed (as this benchmark's raw
            round always did): the reference of the ratios. Whether glibc hands the freed pages back to the timed
            load or faults in new ones varies from run to run, and so does this figure;
  sharded   ``strategy.load_checkpoint`` of the directory (what ``fit(ckpt_path=...)`` runs: into the sharded model
            and optimizer; every rank reads its own shards);
  full      ``strategy.load_checkpoint`` of the file (rank 0 maps it and broadcasts it FSDP unit by unit).
Every in-process timing has a barrier on both ends, and records the CPU seconds of the busiest rank (the wall time
on a machine where nothing else runs). Per round, "sharded vs raw" = raw seconds / sharded seconds (>= 1: the
sharded load is at least as fast as one process reading the same bytes). Each sharded load also records where rank
0's wall time went (integrity check, reading the shards, setting the model and optimizer state).

Memory (GPT-3 medium dims, 355M parameters + AdamW, 2 ranks): one launch trains one step and saves a full file; a
fresh launch resumes from it (``trainer.fit(ckpt_path=...)``) and records each rank's peak RSS during the load
(``VmHWM``, reset just before it), against the bound: the rank's own shard state (16 B per local parameter: fp32
weight, gradient, two AdamW moments) + the largest FSDP unit as stored in the file (12 B per parameter) + 20%.
The files go to ``--dir`` (default: a temporary directory) and are removed afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.checkpoint_io_report import summarise
from benchmarks.common import barrier, launch_worker, machine, random_token_dataset, sharded_trainer  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402

SPEED_MODEL = dict(n_layer=14, n_head=12, n_embd=768, vocab_size=256, block_size=256, dropout=0.0, warmup_steps=1)
MEMORY_MODEL = dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50272, block_size=2048, dropout=0.0, warmup_steps=1)
# The best-case raw load, in a fresh process: torch.load of the file twice, the second timed around the call
# ([seconds, CPU seconds]). A mapped load first (no tensor data read) imports what unpickling the checkpoint needs
# (lightning). Run with glibc told to keep freed memory (_RAW_ENV), the second load reuses every page the first
# faulted in: the fastest a one-process torch.load gets (the page cache copied into memory that exists).
_RAW_LOAD = (
    "import json, sys, time, torch; torch.load(sys.argv[1], weights_only=False, mmap=True)\n"
    "first = torch.load(sys.argv[1], weights_only=False); del first\n"
    "cpu, start = time.process_time(), time.perf_counter(); torch.load(sys.argv[1], weights_only=False)\n"
    "print(json.dumps([time.perf_counter() - start, time.process_time() - cpu]))"
)
_RAW_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**25), "MALLOC_TRIM_THRESHOLD_": str(2**40)}  # 32 MiB: glibc's maximum


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory figure (VmRSS, VmHWM) in bytes."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM restarts from the current RSS


@contextmanager
def _phases(seconds: dict[str, float]) -> Iterator[None]:
    """Accumulate the wall time of the sharded load's steps (as the checkpoint IO calls them) into ``seconds``."""
    import torch.distributed.checkpoint as dcp

    from lightning_shard.checkpoint import integrity, load
    from lightning_shard.checkpoint.reader import InPlaceFileSystemReader

    targets: list[tuple[Any, str, str]] = [
        (integrity, "agreed", "the two agreements across ranks (and what they wrap)"),
        (load, "_check_sharded", "integrity check (metadata, file sizes, names and shapes)"),
        (load, "_live_states", "get_state_dict (sharded: the live shards and optimizer states)"),
        (dcp, "load", "dcp.load (planning and reading)"),
        (InPlaceFileSystemReader, "read_data", "of which reading the shards into the live tensors"),
        (load, "_set_live_states", "set_state_dict"),
    ]
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in targets]

    def timed(function: Callable, label: str) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start

        return run

    for owner, name, label in targets:
        original = owner.__dict__[name]
        wrapped = timed(original.__func__ if isinstance(original, staticmethod) else original, label)
        setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _speed_worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from examples.gpt.model import GPT

    def timed(fn: Callable[[], Any]) -> float:
        barrier()
        start = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - start

    class LoadRounds(Callback):
        def __init__(self) -> None:
            self.saves: dict[str, dict[str, float]] = {}
            self.records: list[dict[str, Any]] = []
            self.raw_best: list[dict[str, Any]] = []
            self.phases: list[dict[str, float]] = []

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            strategy, root = trainer.strategy, Path(args.dir)
            rank0 = trainer.is_global_zero
            paths = {"sharded": root / "sharded.ckpt", "full": root / "full.ckpt", "raw": root / "raw.pt"}
            original = strategy.config
            for kind in ("sharded", "full"):
                strategy.config = dataclasses.replace(original, state_dict_type=kind)
                self.saves[kind] = {"save_seconds": timed(lambda kind=kind: trainer.save_checkpoint(paths[kind]))}
            strategy.config = original

            def raw_save() -> None:
                if rank0:
                    torch.save(torch.load(paths["full"], weights_only=False), paths["raw"])

            self.saves["raw"] = {"save_seconds": timed(raw_save)}  # includes reading the content it writes
            for kind, path in paths.items():
                self.saves[kind]["bytes"] = strategy.broadcast(_size(path) if rank0 else 0)

            def raw_load_best() -> tuple[float, float]:
                """A fresh process torch.load-s the file twice and times the second load, which reuses every page."""
                if not rank0:
                    return 0.0, 0.0
                command = [sys.executable, "-c", _RAW_LOAD, str(paths["raw"])]
                env = {**os.environ, **_RAW_ENV}
                return json.loads(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout)

            def raw_warm_up() -> None:
                # Loaded and freed just before the timed raw load, as the raw round always did (its allocations may
                # then reuse pages already faulted in; the best-case round shows what that is worth).
                if rank0:
                    torch.load(paths["raw"], weights_only=False)

            def raw_load() -> None:
                if rank0:
                    torch.load(paths["raw"], weights_only=False)

            loads = {
                "raw_best": raw_load_best,
                "raw": raw_load,
                "sharded": lambda: strategy.load_checkpoint(paths["sharded"]),
                "full": lambda: strategy.load_checkpoint(paths["full"]),
            }
            for load in loads.values():  # warm the page cache (and the code paths)
                timed(load)
            for repeat in range(args.repeats):
                for kind, load in loads.items():
                    if kind == "raw":
                        raw_warm_up()
                    seconds: dict[str, float] = defaultdict(float)
                    cpu = time.process_time()
                    inside: list[Any] = []
                    with _phases(seconds) if kind == "sharded" else _nothing():
                        elapsed = timed(lambda load=load, inside=inside: inside.append(load()))
                    # CPU seconds of the busiest rank: what the wall time would be on an otherwise idle machine
                    cpu = float(max(strategy.all_gather(torch.tensor(time.process_time() - cpu, dtype=torch.float64))))
                    record = {"repeat": repeat, "kind": kind, "bytes": self.saves["raw"]["bytes"]}
                    if kind == "raw_best":
                        elapsed, cpu = strategy.broadcast(inside[0])
                    record.update(self.saves.get(kind, {}), load_seconds=elapsed, load_cpu_seconds=cpu)
                    (self.raw_best if kind == "raw_best" else self.records).append(record)
                    if kind == "sharded":
                        self.phases.append(dict(seconds))
            barrier()
            if rank0:
                shutil.rmtree(paths["sharded"])
                paths["full"].unlink()
                paths["raw"].unlink()

    L.seed_everything(1234, verbose=False)
    model = GPT(**SPEED_MODEL, max_steps=1)
    rounds = LoadRounds()
    trainer = sharded_trainer(args.devices, [rounds], max_steps=1)
    trainer.fit(
        model, torch.utils.data.DataLoader(random_token_dataset(2, 64, SPEED_MODEL["vocab_size"]), batch_size=1)
    )
    if trainer.is_global_zero:
        num_params = sum(p.numel() for p in trainer.strategy.model.parameters())
        result = {
            "records": rounds.records,
            "raw_best": rounds.raw_best,
            "saves": rounds.saves,
            "phases": rounds.phases,
            "num_params": num_params,
        }
        Path(args.out).write_text(json.dumps(result))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _memory_worker(args: argparse.Namespace) -> None:
    """``--phase save``: one step, then a full checkpoint at ``--ckpt``. ``--phase load``: resume from it."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.tensor import DTensor

    from examples.gpt.model import GPT
    from lightning_shard.checkpoint.unit_load import unit_key_groups

    L.seed_everything(1234, verbose=False)
    model = GPT(**MEMORY_MODEL, max_steps=1)
    data = torch.utils.data.DataLoader(random_token_dataset(2, 32, MEMORY_MODEL["vocab_size"]), batch_size=1)
    trainer = sharded_trainer(args.devices, [], max_steps=1, state_dict_type="full")
    if args.phase == "save":

        class SaveFull(Callback):
            def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                trainer.save_checkpoint(args.ckpt)

        trainer.callbacks.append(SaveFull())
        trainer.fit(model, data)
        return

    strategy, measured = trainer.strategy, {}
    load_checkpoint = strategy.load_checkpoint

    def load_and_measure(path: Any, weights_only: bool | None = None) -> Any:
        measured["rss_before"] = _status_bytes("VmRSS")
        _reset_peak_rss()
        start = time.perf_counter()
        rest = load_checkpoint(path, weights_only=weights_only)
        measured["seconds"] = time.perf_counter() - start
        measured["peak_rss"] = _status_bytes("VmHWM")
        sharded = strategy.model
        local = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in sharded.parameters() if p.requires_grad
        )
        numel = {name: p.numel() for name, p in sharded.named_parameters()}
        units = unit_key_groups(sharded, numel)
        measured["local_params"] = local
        measured["own_shard_bytes"] = 16 * local
        measured["largest_unit_bytes"] = max(12 * sum(numel[key] for key in unit) for unit in units)
        measured["units"] = len(units)
        measured["num_params"] = sum(numel.values())
        return rest

    strategy.load_checkpoint = load_and_measure
    trainer.fit(model, data, ckpt_path=args.ckpt)  # the checkpoint is at max_steps: restore, nothing to train
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, measured)
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({"ranks": per_rank, "file_bytes": _size(Path(args.ckpt))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["speed", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=["save", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-memory", action="store_true", help="only the speed rounds")
    parser.add_argument("--output", default=str(result_path("checkpoint_io")))
    args = parser.parse_args()
    if args.worker == "speed":
        _speed_worker(args)
        return
    if args.worker == "memory":
        _memory_worker(args)
        return

    machine_start = machine()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=args.dir) as tmp:
        common = ["--dir", tmp, "--devices", str(args.devices)]
        speed = launch_worker(__file__, "--worker", "speed", *common, "--repeats", str(args.repeats))
        memory = None
        if not args.skip_memory:
            ckpt = str(Path(tmp) / "medium-full.ckpt")
            launch_worker(__file__, "--worker", "memory", "--phase", "save", "--ckpt", ckpt, *common)
            memory = launch_worker(__file__, "--worker", "memory", "--phase", "load", "--ckpt", ckpt, *common)
    wall = time.perf_counter() - start
    summary, report = summarise(speed, memory, args.devices)
    write_result(
        Path(args.output),
        "checkpoint_io",
        {
            "benchmark": "checkpoint_io",
            "machine_start": machine_start,
            "machine_end": machine(),
            "model": SPEED_MODEL,
            "num_params": speed["num_params"],
            "devices": args.devices,
            "wall_seconds": wall,
            "records": speed["records"],
            "raw_best": speed["raw_best"],
            "saves": speed["saves"],
            "phases": speed["phases"],
            "median": summary,
            "memory": memory,
            "report": report,
        },
    )


if __name__ == "__main__":
    main()
