"""What recognising pretrained files by content costs: ``PretrainedFile.of`` (the record a small checkpoint keeps of
each file its frozen weights come from, checked at resume and at export) against hashing the whole file.

    python benchmarks/pretrained_hash.py                 # -> benchmarks/results/checkpoints.json
    python benchmarks/pretrained_hash.py --dir /data/tmp

The model is ``benchmarks/hf_loading.py``'s (HF Llama, 134M parameters, float32, one 537 MB ``model.safetensors``),
written once to ``--dir`` with random weights (nothing is downloaded). One process; each figure is the median of
``--repeats`` runs, with the file's pages in the page cache (warm: what a rank that has just read the files pays) and
evicted from it first (cold: ``posix_fadvise(DONTNEED)`` on that file alone, so the reads go to the disk).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, median  # noqa: E402
from benchmarks.hf_loading import MODEL  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402
from lightning_shard.hf.frozen_weights import PretrainedFile, _sampled_ranges  # noqa: E402

MIB = 2**20


def evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (this file only)."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def whole_file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(16 * MIB):
            digest.update(block)
    return digest.hexdigest()


def timed(function: object, path: Path, cold: bool, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if cold:
            evict(path)
        start = time.perf_counter()
        function(path)  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/lightning_shard_hf_loading", help="where the model is (written once)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=str(result_path("pretrained_hash")))
    args = parser.parse_args()
    model_dir = Path(args.dir) / "llama-134m"
    machine_start = machine()
    if not (model_dir / "config.json").is_file():
        from examples.hf.model import write_random_model

        write_random_model(model_dir, MODEL)
    (path,) = sorted(model_dir.glob("*.safetensors"))
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    ranges = _sampled_ranges(header, data_start=8 + length)
    sampled = sum(end - start for start, end in ranges) + 8 + length
    size = path.stat().st_size
    rows, figures = [], {}
    for label, function, read in [("PretrainedFile.of (sampled content hash)", PretrainedFile.of, sampled),
                                  ("SHA-256 of the whole file (for comparison)", whole_file_sha256, size)]:  # fmt: skip
        warm = timed(function, path, cold=False, repeats=args.repeats)
        cold = timed(function, path, cold=True, repeats=args.repeats)
        figures[label] = {"warm_s": warm, "cold_s": cold, "bytes_read": read}
        read_text = f"{read / MIB:.2f} MiB ({read / size:.2%})"
        rows.append([label, read_text, f"{warm * 1e3:.1f} ms", f"{cold * 1e3:.1f} ms"])
    tensors = len([key for key in header if key != "__metadata__"])
    notes = [
        f"File: {path.name}, {size / MIB:.0f} MiB, {tensors} tensors (HF Llama {MODEL['num_hidden_layers']} layers x "
        f"{MODEL['hidden_size']}, float32). Sampled: the header, then the first and last 4 KiB of each tensor's "
        f"data, in {len(ranges)} reads.",
        "What is read grows with the number of tensors, not with the file size: a file of a 100 GB checkpoint holds "
        "a few hundred to a few thousand tensors, so the check reads a few MiB of it (e.g. 1000 tensors: at most "
        "8 MiB in at most 2000 reads), where a whole-file hash reads 100 GB.",
        "Warm: the file's pages in the page cache (a rank that has just loaded the weights). Cold: evicted first "
        "with posix_fadvise(DONTNEED) on this file; the figure then includes the disk's seeks.",
    ]
    write_result(
        Path(args.output),
        "pretrained_hash",
        {
            "benchmark": "pretrained_hash",
            "machine": machine_start,
            "machine_end": machine(),
            "figures": figures,
            "report": {
                "title": "Recognising pretrained files by content: the sampled hash against a whole-file hash",
                "question": "What does recording and checking the pretrained files of a small (LoRA) checkpoint by "
                "content cost, on the files of a 134M-parameter model?",
                "columns": ["what", "bytes read", f"median, warm ({args.repeats} runs)", "median, cold"],
                "rows": rows,
                "notes": notes,
            },
        },
    )
    print("\n".join(" | ".join(row) for row in rows))


if __name__ == "__main__":
    main()
