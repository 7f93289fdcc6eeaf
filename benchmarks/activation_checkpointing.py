"""Activation checkpointing - none, full (whole blocks recomputed) and selective (per op) - on one GPT: the activations
held at the peak and the step time of each, on the CPU.

    python benchmarks/activation_checkpointing.py          # -> benchmarks/results/memory.json

One process (a one-rank gloo group), the strategy's own path: the GPT example (6 x 512, 8 heads, context 256,
vocabulary 256, micro-batch 4, fp32) built on the meta device and checkpointed, sharded and initialised by
``parallelize_module`` with ``activation_checkpointing=None`` / ``["Block"]`` / ``"selective"``.

* activations: the activations (and temporaries) ``FSDPMemTracker`` counts at the peak of a training step, on that
  path under fake tensors (``estimate_memory(mode="simulate")``: the bytes allocated, which do not depend on values),
  next to the estimator's formula for the same mode.
* step time: forward, backward and AdamW step of the three models in the same process, in rounds (one step of each
  mode in turn, the order rotating), so that the machine's load falls on all alike; median over the timed steps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402

MODEL = {"n_layer": 6, "n_head": 8, "n_embd": 512, "vocab_size": 256, "block_size": 256}
BATCH = 4
MODES = {"none": None, "full": ["Block"], "selective": "selective"}
MIB = 2**20


def build() -> Any:
    from examples.gpt.model import GPT

    model = GPT(**MODEL)
    model.configure_model()
    return model


def tokens() -> Any:
    import torch

    return torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["block_size"]))


def activation_figures() -> dict[str, dict[str, float]]:
    """Per mode: simulated activations (FSDPMemTracker's activations and temporaries at the peak) and the formula's."""
    from lightning_shard import estimate_memory

    dims = {key: MODEL[key] for key in ("n_layer", "n_embd", "n_head", "vocab_size")}
    figures = {}
    for mode in MODES:
        checkpointing = {"none": False, "full": "full", "selective": "selective"}[mode]
        simulated = estimate_memory(build, mode="simulate", input_fn=tokens, activation_checkpointing=checkpointing)
        formula = estimate_memory(
            build(), activation_checkpointing=checkpointing, seq_len=MODEL["block_size"], micro_batch_size=BATCH, **dims
        )
        figures[mode] = {
            "simulated_mib": simulated.device.activations / MIB,
            "formula_mib": formula.device.activations / MIB,
        }
    return figures


def step_times(rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Median-ready step seconds of the three modes, trained side by side in this process."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from lightning_shard import ShardingConfig
    from lightning_shard.init.materialize import meta_construction
    from lightning_shard.plan.parallelize import parallelize_module

    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", store=dist.FileStore(store.name, 1), rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
            runs = {}
            for mode, policy in MODES.items():
                torch.manual_seed(0)
                with meta_construction():
                    model = build()
                config = ShardingConfig(auto_wrap_policy=["Block"], activation_checkpointing=policy)
                parallelize_module(model, mesh, config, mp_policy=MixedPrecisionPolicy(),
                                   offload_policy=OffloadPolicy(), device=torch.device("cpu"))  # fmt: skip
                runs[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
            batch = tokens()
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            order = list(MODES)
            for step in range(rounds * (warmup + steps)):
                order = order[1:] + order[:1]
                for mode in order:
                    model, optimizer = runs[mode]
                    start = time.perf_counter()
                    logits = model(batch)
                    F.cross_entropy(logits.flatten(0, 1), batch.flatten()).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    if step % (warmup + steps) >= warmup:
                        times[mode].append(time.perf_counter() - start)
            return times
        finally:
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", type=Path, default=result_path("activation_checkpointing"))
    args = parser.parse_args()
    activations = activation_figures()
    times = step_times(args.rounds, args.steps, args.warmup)
    base_time, base_memory = median(times["none"]), activations["none"]["simulated_mib"]
    rows = [
        [
            mode,
            f"{activations[mode]['simulated_mib']:.1f}",
            f"{activations[mode]['simulated_mib'] / base_memory:.2f}",
            f"{activations[mode]['formula_mib']:.1f}",
            f"{median(times[mode]):.3f}",
            f"{median(times[mode]) / base_time:.2f}",
        ]
        for mode in MODES
    ]
    report = {
        "title": "Activation checkpointing: none, full and selective (CPU, one process)",
        "question": "How much activation memory does each form of activation checkpointing keep, and what does the "
        "recomputation cost in step time?",
        "columns": ["activation_checkpointing", "activations MiB", "x none", "formula MiB", "step s", "x none"],
        "rows": rows,
        "notes": [
            f"GPT {MODEL['n_layer']} x {MODEL['n_embd']}, {MODEL['n_head']} heads, context {MODEL['block_size']}, "
            f"micro-batch {BATCH}, fp32, AdamW; full = activation_checkpointing=['Block'], selective = 'selective'.",
            "Activations: FSDPMemTracker's activations and temporaries at the peak of the second training step, on "
            "the strategy's path under fake tensors (estimate_memory(mode='simulate')); formula: the estimator's.",
            f"Step time: median of {args.rounds} x {args.steps} steps per mode, the three models trained side by side "
            "in one process in rotating order.",
        ],
    }
    write_result(args.output, "activation_checkpointing", {"report": report,
                             "activations": activations, "step_seconds": times})  # fmt: skip
    for row in rows:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
