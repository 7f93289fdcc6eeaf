"""Turn per-rank memory samples into a table and CSV and JSON files (the plot: :mod:`.svg_plot`).

A sample is ``{"step": int, "ranks": [{metric: bytes, ...} for each rank]}``; a history is a list of samples.

Example:
    >>> history = [{"step": 1, "ranks": [{"params_bytes": 2**20}, {"params_bytes": 2**20}]}]
    >>> print(format_rank_table(history[-1]["ranks"]))
    rank  params (MiB)
       0          1.00
       1          1.00
"""

import csv
import json
from pathlib import Path
from typing import Any

MIB = 2**20

Sample = dict[str, Any]


def _column_title(metric: str) -> str:
    return metric.removesuffix("_bytes").replace("_", " ") + " (MiB)"


def format_rank_table(ranks: list[dict[str, float]]) -> str:
    """One row per rank, one column per metric, in MiB."""
    metrics = list(ranks[0])
    titles = ["rank"] + [_column_title(m) for m in metrics]
    rows = [[str(r)] + [f"{values[m] / MIB:.2f}" for m in metrics] for r, values in enumerate(ranks)]
    widths = [max(len(title), *(len(row[i]) for row in rows)) for i, title in enumerate(titles)]
    lines = ["  ".join(t.rjust(w) if i else t.ljust(w) for i, (t, w) in enumerate(zip(titles, widths, strict=True)))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def write_csv(history: list[Sample], path: Path) -> None:
    """Long format: one row per (step, rank), one column per metric, in bytes."""
    metrics = list(history[0]["ranks"][0])
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["step", "rank", *metrics])
        for sample in history:
            for rank, values in enumerate(sample["ranks"]):
                writer.writerow([sample["step"], rank, *(int(values[m]) for m in metrics)])


def per_rank_history(history: list[Sample]) -> dict[str, list[dict[str, int]]]:
    """``{"0": [{"step": s, metric: bytes, ...}, ...], "1": [...]}``: each rank's samples over steps."""
    world_size = len(history[0]["ranks"])
    return {
        str(rank): [
            {"step": sample["step"], **{m: int(v) for m, v in sample["ranks"][rank].items()}} for sample in history
        ]
        for rank in range(world_size)
    }


def write_json(history: list[Sample], path: Path) -> None:
    """``{"world_size": N, "ranks": per_rank_history(history)}``."""
    payload = {"world_size": len(history[0]["ranks"]), "ranks": per_rank_history(history)}
    path.write_text(json.dumps(payload, indent=2))
