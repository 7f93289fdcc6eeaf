"""FSDP alone on 4 ranks against 2 x 2 tensor parallelism + FSDP on the same model: step time, per-rank memory and the
communication each costs, counted.

    python benchmarks/tensor_parallel.py          # -> benchmarks/results/tensor_parallel.json

One launch of 4 CPU ranks (Fabric's launcher, gloo) holds both set-ups of the GPT example (4 x 512, 8 heads, context
128, vocabulary 256, fp32, AdamW, global batch 8) - ``lightning_shard.fabric.ShardedStrategy()`` and
``ShardedStrategy(tensor_parallel_size=2)`` - and alternates their steps (the order swapped every step), so that the
load of a shared machine falls on both alike.

* communication: every collective one rank takes part in during one training step, counted at the dispatcher
  (FSDP2's all-gathers and reduce-scatters, tensor parallelism's all-reduces, the norm's): the payload bytes (an
  all-gather's output, a reduce-scatter's input, an all-reduce's tensor), per step and rank, and the number of calls.
* memory: the rank's model state (the local pieces of parameters, gradients and AdamW states after a step), and the
  estimator's per-rank device total (model states, gathered units and activations).
* time: the median step (forward, backward, optimizer step) over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402

MODEL = {"n_layer": 4, "n_head": 8, "n_embd": 512, "vocab_size": 256, "block_size": 128}
GLOBAL_BATCH, DEVICES = 8, 4
CONFIGS = {"fsdp": 1, "tp_fsdp": 2}  # name -> tensor_parallel_size
MIB = 2**20


def _collective_counter() -> Any:
    """A dispatch mode counting the collectives this rank runs: calls and payload bytes (the largest tensor each
    collective moves: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls, self.bytes = 0, 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            name = func.name()
            if func.namespace in ("c10d", "_c10d_functional") and "wait" not in name and "wrap" not in name:
                tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
                sizes = [t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)]
                self.calls += 1
                self.bytes += max(sizes, default=0)
            return func(*args, **(kwargs or {}))

    return CollectiveCounter()


def _worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F

    from examples.gpt.model import GPT
    from lightning_shard.fabric import ShardedStrategy

    runs = {}
    for name, size in CONFIGS.items():
        fabric = L.Fabric(accelerator="cpu", devices=DEVICES, strategy=ShardedStrategy(tensor_parallel_size=size))
        fabric.launch()
        fabric.seed_everything(0, verbose=False)
        model = GPT(**MODEL)
        with fabric.init_module(empty_init=True):
            model.configure_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = fabric.setup(model, optimizer)
        # every rank of a tensor-parallel group computes on the same rows of the global batch
        data_rank, data_ranks = fabric.global_rank // size, DEVICES // size
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, MODEL["block_size"]), generator=generator)
        rows = GLOBAL_BATCH // data_ranks
        runs[name] = (fabric, model, optimizer, tokens[data_rank * rows : (data_rank + 1) * rows])

    def step(name: str) -> float:
        fabric, model, optimizer, batch = runs[name]
        fabric.barrier()
        start = time.perf_counter()
        logits = model(batch)
        fabric.backward(F.cross_entropy(logits.flatten(0, 1), batch.flatten()))
        optimizer.step()
        optimizer.zero_grad()
        fabric.barrier()
        return time.perf_counter() - start

    result: dict[str, Any] = {}
    for name in CONFIGS:
        step(name)  # warm-up: the optimizer states exist from here on
        counter = _collective_counter()
        with counter:
            step(name)
        result[name] = {"collective_calls": counter.calls, "collective_bytes": counter.bytes}
        result[name]["model_state_bytes"] = _model_state_bytes(runs[name][1], runs[name][2])
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for index in range(args.steps):
        for name in list(CONFIGS) if index % 2 == 0 else list(CONFIGS)[::-1]:
            times[name].append(step(name))
    for name in CONFIGS:
        result[name]["step_seconds"] = times[name]
    fabric = runs["fsdp"][0]
    gathered = fabric.all_gather(torch.tensor([result[n]["model_state_bytes"] for n in CONFIGS]))
    if fabric.global_rank == 0:
        for index, name in enumerate(CONFIGS):
            result[name]["model_state_bytes_per_rank"] = gathered[:, index].tolist()
        Path(args.out).write_text(json.dumps(result))


def _model_state_bytes(model: Any, optimizer: Any) -> int:
    """This rank's pieces of the parameters, their gradients (kept after the step) and AdamW's states."""
    import torch

    def local(tensor: Any) -> int:
        piece = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return piece.numel() * piece.element_size() if piece.dim() else 0  # not the step counters

    params = [p for p in model.parameters()]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(local(p) for p in params) + sum(local(p) for p in params) + sum(local(v) for v in states)


def _estimates() -> dict[str, float]:
    """The estimator's per-rank device total for each set-up (micro-batch: the rows one data-parallel rank gets)."""
    from examples.gpt.model import GPT
    from lightning_shard import estimate_memory

    model = GPT(**MODEL)
    model.configure_model()
    dims = {key: MODEL[key] for key in ("n_layer", "n_embd", "n_head", "vocab_size")}
    totals = {}
    for name, size in CONFIGS.items():
        estimate = estimate_memory(
            model,
            world_size=DEVICES,
            tensor_parallel_size=size,
            seq_len=MODEL["block_size"],
            micro_batch_size=GLOBAL_BATCH // (DEVICES // size),
            **dims,
        )
        totals[name] = estimate.device.total_bytes / MIB
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output", type=Path, default=result_path("tensor_parallel"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--out", out.name]
        subprocess.run(command, check=True, env={**__import__("os").environ, "PYTHONWARNINGS": "ignore"})
        measured = json.loads(Path(out.name).read_text())
    estimates = _estimates()
    rows = []
    for name, size in CONFIGS.items():
        run = measured[name]
        rows.append(
            [
                "FSDP alone (4 ranks)" if size == 1 else "2 x 2 TP + FSDP",
                f"{median(run['step_seconds']):.3f}",
                f"{median(run['step_seconds']) / median(measured['fsdp']['step_seconds']):.2f}",
                f"{max(run['model_state_bytes_per_rank']) / MIB:.2f}",
                f"{estimates[name]:.1f}",
                f"{run['collective_bytes'] / MIB:.1f}",
                str(run["collective_calls"]),
            ]
        )
    report = {
        "title": "Tensor parallelism: 4-rank FSDP against 2 x 2 TP + FSDP (CPU, gloo)",
        "question": "What do step time, per-rank memory and communication look like when half the ranks split each "
        "layer instead of sharding it?",
        "columns": [
            "set-up",
            "step s",
            "x FSDP",
            "model state MiB/rank",
            "estimate MiB/rank",
            "comm MiB/step/rank",
            "collectives/step",
        ],  # fmt: skip
        "rows": rows,
        "notes": [
            f"GPT {MODEL['n_layer']} x {MODEL['n_embd']}, {MODEL['n_head']} heads, context {MODEL['block_size']}, "
            f"vocabulary {MODEL['vocab_size']}, fp32, AdamW, global batch {GLOBAL_BATCH} (FSDP: 2 rows per rank; "
            "TP: 4 rows per data-parallel rank, the same on both ranks of a tensor-parallel group).",
            f"Both set-ups in the same 4 processes, steps alternating; median of {args.steps} steps each.",
            "Communication: the collectives of one training step on rank 0, counted at the dispatcher; payload = an "
            "all-gather's output, a reduce-scatter's input, an all-reduce's tensor.",
            "Model state: the rank's local parameters, gradients and AdamW states (largest rank); estimate: "
            "estimate_memory's per-rank device total (model states, gathered units, activations).",
        ],
    }
    write_result(
        args.output,
        "tensor_parallel",
        {"report": report, "measured": measured},
    )
    for row in rows:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
