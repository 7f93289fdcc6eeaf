"""What checksums cost a checkpoint's save and load, against the same code without them (one process, page cache).

    python benchmarks/checkpoint_checksums.py [--params 50_000_000] [--repeats 3]
        # -> benchmarks/results/checkpoints.json

A state of ``--params`` fp32 weights plus two AdamW moments of the same size (split into 64 tensors each) is saved and
loaded, each way ``--repeats`` times after one untimed round, the best reported (the machine is shared: the
fastest round is the one least slowed by others):

  sharded save   ``dcp.save`` with torch's ``FileSystemWriter`` vs lightning-shard's ``ChecksummedFileSystemWriter``
                 (which hashes every item it wrote, read back from the page cache, and seals ``.metadata``);
  sharded load   ``dcp.load`` into preallocated tensors with ``InPlaceFileSystemReader`` (the reader of every sharded
                 load), of the directory written without checksums (nothing to verify) vs with them (every item
                 hashed as it is read), both from the page cache: the fastest a load gets, so the largest share the
                 hashing can take (from a disk, the load is slower and the hashing the same);
  full save      ``torch.save`` to a path + fsync vs ``write_full_file`` (through a Python file that hashes what is
                 written, fsync, the hash into the zip comment);
  full load      ``torch.load`` of the file vs ``check_full_file`` (the whole file hashed through a memory map of
                 the page cache) + the same ``torch.load``;
  hash only      the checkpoint's tensors hashed in memory: the least a checked load adds, as a share of the
                 unchecked sharded load (the figure that holds on a quiet machine; the differences above carry the
                 noise of a shared one).

The hash is the one the installation has (``xxh3_64`` with the ``xxhash`` package, else zlib's ``crc32``); the
result names it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.utils._pytree import tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402
from lightning_shard.checkpoint import checksums, integrity  # noqa: E402
from lightning_shard.checkpoint.reader import InPlaceFileSystemReader  # noqa: E402
from lightning_shard.checkpoint.writer import ChecksummedFileSystemWriter, write_full_file  # noqa: E402

TENSORS = 64


def state(params: int) -> dict[str, Any]:
    size = params // TENSORS
    return {
        "model": {f"w{i}": torch.randn(size) for i in range(TENSORS)},
        "optimizer": {f"w{i}": {"exp_avg": torch.randn(size), "exp_avg_sq": torch.rand(size)} for i in range(TENSORS)},
    }


def timed(action: Callable[[], Any], repeats: int) -> float:
    action()  # warms the page cache and the allocator
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def torch_save_synced(payload: Any, path: Path) -> None:
    torch.save(payload, path)
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    root = Path(tempfile.mkdtemp(dir=args.dir))
    payload = state(args.params)
    plain, checked = root / "plain", root / "checked"
    plain_file, checked_file = root / "plain.pt", root / "checked.pt"
    target = tree_map(torch.empty_like, payload)

    def load(path: Path) -> None:
        metadata = integrity.read_metadata(path)
        dcp.load(target, storage_reader=InPlaceFileSystemReader(path, metadata), no_dist=True)

    def load_full(path: Path, check: bool) -> None:
        if check:
            integrity.check_full_file(path)
        torch.load(path, weights_only=True)

    figures = {
        "sharded_save": (
            timed(lambda: dcp.save(payload, storage_writer=dcp.FileSystemWriter(plain), no_dist=True), args.repeats),
            timed(
                lambda: dcp.save(payload, storage_writer=ChecksummedFileSystemWriter(checked), no_dist=True),
                args.repeats,
            ),
        ),  # fmt: skip
        "sharded_load": (timed(lambda: load(plain), args.repeats), timed(lambda: load(checked), args.repeats)),
        "full_save": (
            timed(lambda: torch_save_synced(payload, plain_file), args.repeats),
            timed(lambda: write_full_file(payload, checked_file), args.repeats),
        ),
        "full_load": (
            timed(lambda: load_full(plain_file, False), args.repeats),
            timed(lambda: load_full(checked_file, True), args.repeats),
        ),
    }
    tensors = [t for value in payload.values() for t in tree_map(lambda t: t, value).values() if torch.is_tensor(t)]
    tensors += [t for moments in payload["optimizer"].values() for t in moments.values()]
    # The hashing alone, of the same bytes in memory: what a checked load adds at the least, whatever the disk.
    hash_only = timed(lambda: [checksums.checksum_of([t.numpy().data.cast("B")]) for t in tensors], args.repeats)
    assert all(torch.equal(target["model"][k], payload["model"][k]) for k in payload["model"])
    gib = sum(p.stat().st_size for p in checked.iterdir()) / 2**30
    rows = [
        [name.replace("_", " "), f"{a:.3f} s", f"{b:.3f} s", f"{100 * (b - a) / a:+.1f}%"]
        for name, (a, b) in figures.items()
    ]
    sharded_load = figures["sharded_load"][0]
    share = f"{100 * hash_only / sharded_load:.1f}% of the load"
    rows.append(["hashing alone, in memory", "-", f"{hash_only:.3f} s", share])
    results = {
        "report": {
            "title": "Checkpoint checksums: their cost on save and load",
            "question": "What do the checksums written at save and verified at load cost, against the same save and "
            "load without them (one process, warm page cache)?",
            "columns": ["operation", "unchecked", "checked", "difference"],
            "rows": rows,
            "notes": [
                f"hash: {checksums.ALGORITHM}; {gib:.2f} GiB checkpoint ({args.params:,} fp32 weights + 2 AdamW "
                f"moments, {TENSORS} tensors each); best of {args.repeats} rounds after one untimed round.",
                f"The differences carry the noise of a shared machine (load average {machine()['loadavg']} on "
                f"{os.cpu_count()} cores); the hashing alone is the least a checked load adds, whatever the disk.",
            ],
        },
    }
    shutil.rmtree(root)
    print(results)
    write_result(result_path("checkpoint_checksums"), "checkpoint_checksums", results)


if __name__ == "__main__":
    main()
