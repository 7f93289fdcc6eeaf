"""The optimizer step on one rank's shards: AdamW as users write it (torch's ``foreach`` default) against the fused
kernel the strategy now switches it to (``lightning_shard.core.fused_optimizer``), in parameters/s and GB/s against this
machine's memory bandwidth.

    python benchmarks/optimizer_step.py                  # -> benchmarks/results/startup.json
    python benchmarks/optimizer_step.py --millions 50 --steps 5

One process, one thread per rank's worth of cores (``--threads``), a world of 1 on gloo: the parameters are DTensor
shards of a 1-D mesh, laid out as a GPT's (``--millions`` parameters in matrices of 4 x 1024 x 1024 and their
biases); gradients are random. Per AdamW step in fp32 each parameter reads parameter, gradient and both moments and
writes parameter and both moments: 28 bytes, so GB/s = 28 x parameters/s / 1e9. The memory bandwidth is a
``torch.add(a, b, out=c)`` over 256 MiB arrays (3 x 4 bytes an element), the same threads. DeepSpeed's CPUAdam is
measured only if ``deepspeed.ops.adam.DeepSpeedCPUAdam`` imports (it is not built here).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

from benchmarks.common import median  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402
from lightning_shard.core.fused_optimizer import use_fused_kernels  # noqa: E402

BYTES_PER_PARAM = 28  # fp32 AdamW: read p, g, m, v; write p, m, v


def parameters(millions: int, dtensor: bool) -> list[torch.nn.Parameter]:
    """``millions`` x 1e6 parameters as 1024-wide matrices and biases; DTensor shards of a 1-D mesh or plain."""
    mesh = init_device_mesh("cpu", (1,)) if dtensor else None
    rows = 4 * 1024
    params = []
    total = 0
    generator = torch.Generator().manual_seed(0)
    while total < millions * 1_000_000:
        for shape in ((rows, 1024), (rows,)):
            tensor = torch.randn(shape, generator=generator) * 0.02
            if mesh is not None:
                tensor = distribute_tensor(tensor, mesh, [Shard(0)])
            param = torch.nn.Parameter(tensor)
            param.grad = torch.randn_like(param) * 1e-3
            params.append(param)
            total += tensor.numel()
    return params


def timed_steps(optimizer: torch.optim.Optimizer, steps: int) -> float:
    optimizer.step()  # creates the states
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return median(times)


def memory_bandwidth_gbs(repeats: int = 9) -> float:
    n = 64 * 2**20  # 256 MiB of fp32
    a, b, c = torch.randn(n), torch.randn(n), torch.zeros(n)  # all touched: no page faults in the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(a, b, out=c)
        times.append(time.perf_counter() - start)
    return 3 * 4 * n / median(times) / 1e9


def cases(millions: int) -> dict[str, Callable[[], torch.optim.Optimizer]]:
    def adamw(dtensor: bool, **kwargs: Any) -> Callable[[], torch.optim.Optimizer]:
        return lambda: torch.optim.AdamW(parameters(millions, dtensor), lr=1e-3, **kwargs)

    def switched() -> torch.optim.Optimizer:
        optimizer = adamw(True)()
        use_fused_kernels([optimizer])
        return optimizer

    found = {
        "AdamW as written (foreach), DTensor shards": adamw(True),
        "AdamW, the strategy's switch (fused), DTensor shards": switched,
        "AdamW fused=True, DTensor shards": adamw(True, fused=True),
        "AdamW foreach, plain tensors": adamw(False),
        "AdamW fused=True, plain tensors": adamw(False, fused=True),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        found["DeepSpeed CPUAdam, plain tensors"] = lambda: DeepSpeedCPUAdam(parameters(millions, False), lr=1e-3)
    except Exception:  # not installed or not built: not measured
        pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--millions", type=int, default=50, help="parameters per rank, in millions")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank (a rank's share of the cores)")
    parser.add_argument("--out", type=Path, default=result_path("optimizer_step"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    bandwidth = memory_bandwidth_gbs()
    rows = []
    for name, make in cases(args.millions).items():
        optimizer = make()
        n = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        seconds = timed_steps(optimizer, args.steps)
        rows.append(
            {
                "case": name,
                "params": n,
                "step_s": round(seconds, 4),
                "params_per_s": round(n / seconds),
                "gb_per_s": round(BYTES_PER_PARAM * n / seconds / 1e9, 2),
                "share_of_bandwidth": round(BYTES_PER_PARAM * n / seconds / 1e9 / bandwidth, 3),
            }
        )
        print(rows[-1], flush=True)
        del optimizer
    result = {"threads": args.threads, "memory_bandwidth_gbs": round(bandwidth, 2), "rows": rows}
    print(f"memory bandwidth (add, {args.threads} thread(s)): {bandwidth:.1f} GB/s; pid {os.getpid()}")
    write_result(args.out, "optimizer_step", result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
