"""The measurements behind ``lightning_shard/gloo_comms.py`` and ``lightning_shard/shm_comms.py``: gloo's collectives
as FSDP2 calls them against the replacements (gloo-only and shared-memory), a gloo barrier alone, and a copy into a
fresh buffer against a copy into a reused one, on 2 CPU ranks.

    python benchmarks/gloo_collectives.py        # -> benchmarks/results/gloo_collectives.json

Sizes: one block of the ``train_speed`` GPT (3,152,384 fp32 parameters; n_embd 512) and the whole model
(19,177,472; the shared-memory collectives move it in pieces of one 16 MiB segment). Per case the median of
``--repeats`` calls (a barrier before each, so each call starts together), the slower rank's time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, machine, median, write_json
from lightning_shard.cpu.gloo_comms import GlooAllGather, GlooReduceScatter
from lightning_shard.cpu.shm_comms import SharedMemoryAllGather, SharedMemoryReduceScatter, SharedMemoryTransport

SIZES = {"one block": 3_152_384, "whole model": 19_177_472}
CPU = torch.device("cpu")


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: connections, first-touch of the inputs
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(median(times))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _cases(numel: int, world: int, rank: int) -> dict:
    full, shard = torch.randn(numel), torch.empty(numel // world)
    output = torch.empty(numel)
    own_chunk = output.chunk(world)[rank]
    gloo_all_gather, gloo_reduce_scatter = GlooAllGather(), GlooReduceScatter()
    transport = SharedMemoryTransport()
    shm_all_gather, shm_reduce_scatter = SharedMemoryAllGather(transport), SharedMemoryReduceScatter(transport)
    source = torch.randn(numel)
    reused = torch.empty(numel)

    def fresh_copy() -> None:
        torch.empty(numel).copy_(source)

    return {
        "all_gather: FSDP2 default (all_gather_single)": lambda: dist.all_gather_single(output, own_chunk),
        "all_gather: GlooAllGather (list all-gather into views)": lambda: gloo_all_gather(
            output, own_chunk, dist.group.WORLD
        ),
        "all_gather: SharedMemoryAllGather (shared segment + barrier)": lambda: shm_all_gather(
            output, own_chunk, dist.group.WORLD
        ),
        "reduce_scatter: FSDP2 default (reduce_scatter_single)": lambda: dist.reduce_scatter_single(shard, full),
        "reduce_scatter: GlooReduceScatter (all-reduce + copy)": lambda: gloo_reduce_scatter(
            shard, full, dist.group.WORLD, dist.ReduceOp.SUM
        ),
        "reduce_scatter: SharedMemoryReduceScatter (shared segment + barrier)": lambda: shm_reduce_scatter(
            shard, full, dist.group.WORLD, dist.ReduceOp.SUM
        ),
        "barrier": lambda: dist.barrier(),
        "copy: into a fresh buffer": fresh_copy,
        "copy: into a reused buffer": lambda: reused.copy_(source),
    }


def _worker(rank: int, world: int, init_file: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = []
    for label, numel in SIZES.items():
        for case, fn in _cases(numel, world, rank).items():
            rows.append({"size": label, "numel": numel, "case": case, "seconds": _timed(fn, repeats)})
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=str(RESULTS / "gloo_collectives.json"))
    args = parser.parse_args()
    machine_start, start = machine(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), args.repeats, out), nprocs=2)
        rows = torch.load(out)
    for row in rows:
        print(f"{row['size']:12s} {row['case']:58s} {row['seconds'] * 1e3:8.2f} ms")
    write_json(
        Path(args.output),
        {
            "benchmark": "gloo_collectives",
            "command": "python benchmarks/gloo_collectives.py",
            "repeats": args.repeats,
            "rows": rows,
            "machine_start": machine_start,
            "machine_end": machine(),
            "wall_seconds": time.perf_counter() - start,
        },
    )


if __name__ == "__main__":
    main()
