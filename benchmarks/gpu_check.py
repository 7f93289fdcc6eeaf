"""The prepared one-GPU check of ``ShardedStrategy``: does the CUDA path work, and how fast is it?

Part 1, the tiny GPT (``configs/gpt_tiny.yaml``'s model section, the example's byte-level stdlib text): fits in
bf16-mixed, 16-mixed (grad scaler) and ``fully_sharded_offload``, each with validation metrics, gradient clipping and
``ShardedMemoryMonitor``'s CUDA figures; a sharded save at step 4 and a resume whose losses equal the uninterrupted
run's; a full (one-file) save whose loaded weights validate to the same loss.

Part 2, GPT-3 XL (1.3B, ``configs/gpt3_xl.yaml``'s model section, random tokens), bf16-mixed, eager and compiled
(``ShardedStrategy(compile=True)``), activation checkpointing off, full (``["Block"]``) and selective (per op):
tokens/s, MFU against the device's dense bf16 peak (looked up by its exact name, or ``--peak-tflops``), each step
timed between ``torch.cuda.synchronize()`` calls, peak allocated and reserved memory and their ratio to
``lightning_shard.estimate_memory``'s figure.

Part 3, on a machine with two or more GPUs (and in ``--cpu-smoke`` on 2 CPU ranks, the tiny GPT): the same model on
2 devices as FSDP alone and as tensor parallelism over both (``tensor_parallel_size=2``), the same global batch:
their losses agree, tokens/s and peak memory of each.

Every item runs in its own subprocess, so one failure does not hide the others; the ``gpu_check`` section of
``benchmarks/results/gpu.json`` (``gpu_check_cpu_smoke`` for ``--cpu-smoke``) records each item's figures, pass/fail
and error, and a table is printed. No LightningCLI (the GPU machine has no jsonargparse): the Trainer is built here
from the YAML's model section.

    python benchmarks/gpu_check.py                # one GPU, part 1 then part 2, about 5-6 minutes
    python benchmarks/gpu_check.py --cpu-smoke    # part 1 on 2 CPU ranks at the smallest sizes (CI runs this)

The items are in ``gpu_items.py`` (their fits in ``gpu_fits.py``), the FLOPs / MFU arithmetic in ``gpu_figures.py``;
this module runs each item in a subprocess, collects the rows and writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import REPO, write_json  # noqa: E402
from benchmarks.gpu_figures import peak_flops  # noqa: E402
from benchmarks.gpu_fits import Target, make_target  # noqa: E402
from benchmarks.gpu_items import GIB, items  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402

# Seconds an item may run before its processes are ended: part 1 takes about 30 s per item on a GPU, a compiled
# 1.3B configuration about 2 minutes (mostly inductor).
ITEM_TIMEOUT_S = {1: 180, 2: 300, 3: 300}
# Items that run on more devices than the target's one GPU: tensor parallelism needs two.
ITEM_DEVICES = {"tensor_parallel": 2}


def run_item(name: str, target: Target, peak: float | None, out: Path) -> None:
    """Run one item in this process (and, on CPU, in the rank Lightning's launcher starts). Rank 0 writes the rows
    to ``out``; every rank writes whether it finished to ``<out>.rank<r>``, so a failure on another rank counts."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        rows = items(target, peak)[name](out.parent / f"{name}_work")
    except BaseException:
        write_json(_rank_file(out, rank), {"error": traceback.format_exc(limit=-6)})
        raise
    if rank == 0:
        write_json(out, {"rows": rows})
    write_json(_rank_file(out, rank), {"error": None})


def _rank_file(out: Path, rank: int) -> Path:
    return out.with_suffix(f".rank{rank}")


# ---------------------------------------------------------------------------------------------- orchestration


def run_in_subprocess(name: str, args: argparse.Namespace, target: Target, work: Path) -> list[dict[str, Any]]:
    """Run item ``name`` as ``python gpu_check.py --item NAME``; a crash, hang or failed check stays its own."""
    out, log = work / f"{name}.json", work / f"{name}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--item", name, "--item-out", str(out)]
    command += ["--cpu-smoke"] if args.cpu_smoke else []
    command += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops is not None else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    part = 2 if name.startswith("xl") else 3 if name in ITEM_DEVICES else 1
    timeout = ITEM_TIMEOUT_S[part]
    devices = ITEM_DEVICES.get(name, target.devices)
    start = time.perf_counter()
    with log.open("w") as log_file:
        # A session of its own: on a timeout the whole group (rank 0 and the ranks it launched) is ended.
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
            problem = None if returncode == 0 else f"exit code {returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            problem = f"timed out after {timeout} s"
    seconds = time.perf_counter() - start
    problem = problem or _other_ranks_problem(out, devices)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    if problem or not rows:
        ranks = [_rank_file(out, r) for r in range(devices)]
        errors = [error for f in ranks if f.exists() and (error := json.loads(f.read_text())["error"])]
        details = "\n".join(errors) or "log tail:\n" + "".join(log.read_text().splitlines(True)[-25:])
        error = f"{problem or 'no result'}: {details}"
        failed = {"part": part, "check": name, "passed": False, "failed": ["ran"], "figures": {}, "error": error}
        rows = [{**row, "passed": False, "error": error} for row in rows] or [failed]
    return [{**row, "item": name, "seconds": seconds} for row in rows]


def _other_ranks_problem(out: Path, world: int, grace_s: float = 30.0) -> str | None:
    """Once rank 0 is done, every rank must have reported (it may take a moment to exit) without an error."""
    deadline = time.monotonic() + grace_s
    while not all(_rank_file(out, r).exists() for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.5)
    missing = [r for r in range(world) if not _rank_file(out, r).exists()]
    if missing:
        return f"rank(s) {missing} did not report"
    failed = [r for r in range(world) if json.loads(_rank_file(out, r).read_text())["error"]]
    return f"rank(s) {failed} failed" if failed else None


def report(rows: list[dict[str, Any]], target: Target, device_name: str) -> dict[str, Any]:
    """The ``report`` table the benchmarks' make_report.py renders."""

    def gib(value: Any) -> str:
        return "-" if value is None else f"{value / GIB:.2f}"

    table = []
    for row in rows:
        f = row["figures"]
        if row["part"] == 2 and "mfu" in f:
            speed = [f"{f['tokens_per_s']:,.0f}", f"{f['mfu']:.1%}"]
            memory = [gib(f["max_memory_allocated_bytes"]), gib(f["max_memory_reserved_bytes"])]
            memory += [gib(f["estimated_device_bytes"]), f"{f['allocated_over_estimate']:.2f}"]
            details = f"median step {f['median_step_seconds']:.3f} s"
        else:
            speed, memory = ["-", "-"], ["-", "-", "-", "-"]
            details = "; ".join(
                f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                for key, value in f.items()
                if not isinstance(value, (list, dict))
            )
        error = (row["error"] or "").strip().splitlines()[-1:] or [", ".join(row["failed"])]
        table.append([row["part"], row["check"], "pass" if row["passed"] else "FAIL", *speed, *memory, details, *error])
    notes = [
        f"Device: {device_name}; {target.devices} rank(s) on {target.accelerator}.",
        "Part 1: the tiny GPT (configs/gpt_tiny.yaml's model dims; --cpu-smoke: 2 layers, width 32, context 32) on "
        "the example's byte-level stdlib text, gradient clipping 1.0, validation every half run.",
        "Part 2: GPT-3 XL (configs/gpt3_xl.yaml's model dims), micro-batch 8 x 2048 random tokens, FULL_SHARD on "
        "one device, 3 warm-up + 10 timed steps, each between torch.cuda.synchronize() calls; MFU = FLOPs per token "
        "(PaLM appendix B) x tokens/s / the device's dense bf16 peak; peaks from torch.cuda.max_memory_allocated / "
        "reserved over the fit; estimate = lightning_shard.estimate_memory, same settings.",
        "Part 3 (two or more GPUs; --cpu-smoke: 2 CPU ranks, the tiny GPT): the model on 2 devices as FSDP alone "
        "and as tensor parallelism 1 x 2, the same global batch per step; losses compared, tokens/s of each.",
    ]
    columns = ["part", "check", "result", "tokens/s", "MFU", "peak allocated GiB", "peak reserved GiB"]
    columns += ["estimate GiB", "allocated / estimate", "details", "failed / error"]
    return {
        "title": "One-GPU check: the CUDA path, and GPT-3 XL throughput" if target.on_gpu else "GPU check, CPU smoke",
        "question": "Does the sharded strategy train, validate, checkpoint and resume on CUDA (fp16 scaler and CPU "
        "offload included), and what tokens/s, MFU and peak memory does the 1.3B model reach on one GPU?",
        "columns": columns,
        "rows": table,
        "notes": notes,
    }


def format_table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in columns], *[[str(c) for c in row] for row in rows]]
    widths = [min(60, max(len(row[i]) for row in cells)) for i in range(len(columns))]
    return "\n".join("  ".join(cell[:60].ljust(w) for cell, w in zip(row, widths, strict=True)) for row in cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="part 1 on 2 CPU ranks at the smallest sizes")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of a device not in the table")
    parser.add_argument("--output", type=Path, default=result_path("gpu_check"), help="the concern file (%(default)s)")
    parser.add_argument("--item", help=argparse.SUPPRESS)
    parser.add_argument("--item-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    target = make_target(args.cpu_smoke)
    if not target.on_gpu:
        device_name, peak = "cpu", None
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device here; run with --cpu-smoke for the CPU version")
        # Before anything runs: an unknown peak would waste the whole check.
        device_name = torch.cuda.get_device_name()
        peak = peak_flops(device_name, args.peak_tflops)
    if args.item:
        run_item(args.item, target, peak, args.item_out)
        return 0

    section = "gpu_check_cpu_smoke" if args.cpu_smoke else "gpu_check"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        rows = [row for name in items(target, peak) for row in run_in_subprocess(name, args, target, Path(tmp))]
    table = report(rows, target, device_name)
    result = {
        "benchmark": "gpu_check",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "device": device_name,
        "peak_flops": peak,
        "passed": all(row["passed"] for row in rows),
        "wall_seconds": time.perf_counter() - start,
        "items": rows,
        "report": table,
    }
    write_result(args.output, section, result)
    print(format_table(table["columns"], table["rows"]))
    print(f"{'all passed' if result['passed'] else 'FAILED'} in {result['wall_seconds']:.0f} s")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
