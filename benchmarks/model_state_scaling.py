"""Model state per rank (parameters + gradients + AdamW states, counted from the local shards) of the
``train_speed`` GPT under ``ShardedStrategy`` FULL_SHARD at 1, 2 and 4 CPU ranks, against 16 bytes x params / N.

    python benchmarks/model_state_scaling.py             # -> benchmarks/results/memory.json

Each world size is one launch of ``train_speed.py``'s worker (one optimizer step of micro-batch 1), measured at the
end of the step, when gradients and optimizer states exist.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS
from benchmarks.results_files import result_path, write_result  # noqa: E402
from benchmarks.train_speed import MODEL, launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--configs", nargs="+", default=["fs"])
    parser.add_argument("--output", default=str(result_path("model_state_scaling")))
    args = parser.parse_args()
    rows = []
    start = time.perf_counter()
    for config in args.configs:
        for world in args.world_sizes:
            launch_args = argparse.Namespace(batch_size=1, warmup=0, steps=1, devices=world)
            ranks = launch(config, launch_args, RESULTS / "tmp_scaling")
            num_params = ranks[0]["num_params"]
            limit = 16 * num_params / world
            per_rank = [sum(r["model_state"].values()) for r in ranks]
            row = {
                "config": config,
                "world_size": world,
                "num_params": num_params,
                "limit_bytes": limit,
                "model_state_bytes": per_rank,
                "detail": [r["model_state"] for r in ranks],
                "max_over_limit": max(per_rank) / limit,
                "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
            }
            rows.append(row)
            print(
                f"{config} N={world}: model state per rank {[round(b / 2**20, 2) for b in per_rank]} MiB, "
                f"limit {limit / 2**20:.2f} MiB, max/limit {row['max_over_limit']:.4f}",
                flush=True,
            )
    report = {
        "title": "Model state per rank at 1, 2 and 4 ranks",
        "question": "Does each rank hold 1/N of the parameters, gradients and AdamW states (16 bytes x params / N)?",
        "columns": [
            "config",
            "ranks",
            "parameters",
            "limit 16 B x params / N (MiB)",
            "max per rank (MiB)",
            "max / limit",
        ],
        "rows": [
            [
                row["config"],
                row["world_size"],
                f"{row['num_params']:,}",
                f"{row['limit_bytes'] / 2**20:.2f}",
                f"{max(row['model_state_bytes']) / 2**20:.2f}",
                f"{row['max_over_limit']:.4f}",
            ]
            for row in rows
        ],
        "notes": [
            "Counted from the local shards at the end of one optimizer step (lightning_shard.memory.accounting)."
        ],
    }
    write_result(
        Path(args.output),
        "model_state_scaling",
        {
            "model": MODEL,
            "wall_seconds": time.perf_counter() - start,
            "rows": rows,
            "report": report,
        },
    )


if __name__ == "__main__":
    main()
