"""The report of ``checkpoint_io.py``: from the rounds its workers measured to medians and a table.

Takes the speed worker's records (each load's seconds per kind and round, the saves, the sharded load's phases) and
the memory worker's per-rank peaks; gives the medians per kind and the ``report`` that ``make_report.py`` lays out:
one row per round (sharded load against the raw ``torch.load``), the median loads and saves against raw, and each
rank's peak RSS against its bound (own shard state + the largest unit as stored + 20%).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median  # noqa: E402

MARGIN = 1.2  # the memory bound's 20%


def summarise(speed: dict[str, Any], memory: dict[str, Any] | None, devices: int) -> tuple[dict, dict]:
    """The medians per kind (sharded, full, raw) and the report table of one run of ``checkpoint_io.py``."""
    records = speed["records"]
    by_kind = {kind: [r for r in records if r["kind"] == kind] for kind in ("sharded", "full", "raw")}
    summary = {}
    for kind, sel in by_kind.items():
        size, save, load = sel[0]["bytes"], sel[0]["save_seconds"], median([r["load_seconds"] for r in sel])
        summary[kind] = {
            "bytes": size,
            "save_seconds": save,
            "load_seconds": load,
            "save_MBps": size / save / 1e6,
            "load_MBps": size / load / 1e6,
        }
    rows: list[list[str]] = []
    ratios, full_ratios = [], []
    for raw, sharded, full in zip(by_kind["raw"], by_kind["sharded"], by_kind["full"], strict=True):
        ratio, full_ratio = raw["load_seconds"] / sharded["load_seconds"], raw["load_seconds"] / full["load_seconds"]
        ratios.append(ratio)
        full_ratios.append(full_ratio)
        line = f"round {raw['repeat'] + 1}: sharded load"
        rows.append([line, f"{sharded['load_seconds']:.3f} s", f"raw {raw['load_seconds']:.3f} s", f"{ratio:.2f}x"])
        print(
            f"{line} {sharded['load_seconds']:.3f} s, raw torch.load {raw['load_seconds']:.3f} s: {ratio:.2f}x "
            f"(CPU s: sharded busiest rank {sharded['load_cpu_seconds']:.3f}, raw {raw['load_cpu_seconds']:.3f})"
        )
    raw = summary["raw"]
    for kind, label in (("sharded", "sharded"), ("full", "full-file")):
        for what in ("load", "save"):
            seconds, reference = summary[kind][f"{what}_seconds"], raw[f"{what}_seconds"]
            rows.append(
                [
                    f"{'median ' if what == 'load' else ''}{label} {what}",
                    f"{seconds:.3f} s",
                    f"raw torch.{what} {reference:.3f} s",
                    f"{reference / seconds:.2f}x",
                ]
            )
    phases: dict[str, list[float]] = defaultdict(list)
    for entry in speed["phases"]:
        for label, seconds in entry.items():
            phases[label].append(seconds)
    notes = [
        f"GPT with {speed['num_params']:,} parameters + AdamW, FULL_SHARD on {devices} CPU ranks: sharded "
        f"directory {summary['sharded']['bytes'] / 1e6:.0f} MB, full file {summary['full']['bytes'] / 1e6:.0f} MB. "
        "Raw load: rank 0 alone torch.load-s the full file's content, right after an untimed load of it was freed "
        "(whether glibc hands those pages to the timed load varies from run to run, so the raw time does); raw "
        "save: rank 0 torch.save-s it. Ratios are raw seconds / seconds (>= 1.00x: as fast as one process moving the "
        "same bytes). Page cache warm: every file read once first.",
        f"Sharded load vs raw, per round: {', '.join(f'{r:.2f}x' for r in ratios)} (min {min(ratios):.2f}x, "
        f"max {max(ratios):.2f}x); >= 1.00x in {sum(r >= 1.0 for r in ratios)} of {len(ratios)} rounds. "
        f"Full-file load vs raw, per round: {', '.join(f'{r:.2f}x' for r in full_ratios)}.",
        "Best-case raw torch.load (a fresh process's second load, glibc keeping every freed page: the page cache "
        "copied into memory that exists), per round: "
        + ", ".join(
            f"{best['load_seconds']:.3f} s (sharded {best['load_seconds'] / sharded['load_seconds']:.2f}x)"
            for best, sharded in zip(speed["raw_best"], by_kind["sharded"], strict=True)
        )
        + ".",
        "CPU seconds per load (median over rounds; the busiest rank): sharded "
        f"{median([r['load_cpu_seconds'] for r in by_kind['sharded']]):.3f}, full-file "
        f"{median([r['load_cpu_seconds'] for r in by_kind['full']]):.3f}, raw "
        f"{median([r['load_cpu_seconds'] for r in by_kind['raw']]):.3f} (best case "
        f"{median([r['load_cpu_seconds'] for r in speed['raw_best']]):.3f}): on a machine where each rank has "
        "its own core, loads take about their CPU time; a shared machine adds waiting to the wall times above.",
        "Where rank 0's time went in the sharded loads (median s over rounds): "
        + "; ".join(f"{label} {median(values):.3f}" for label, values in phases.items())
        + ".",
        "Raw save: the timing includes reading the content it writes.",
    ]
    if memory:
        gib = 2**30
        verdicts = []
        for index, measured in enumerate(memory["ranks"]):
            bound = MARGIN * (measured["own_shard_bytes"] + measured["largest_unit_bytes"])
            verdict = "met" if measured["peak_rss"] <= bound else "NOT met"
            verdicts.append(verdict)
            line = f"full-file load, rank {index}: peak RSS"
            rows.append(
                [
                    line,
                    f"{measured['peak_rss'] / gib:.2f} GiB ({measured['rss_before'] / gib:.2f} before the load)",
                    f"bound {bound / gib:.2f} GiB",
                    f"{measured['peak_rss'] / bound:.2f} of the bound: {verdict}",
                ]
            )
            print(f"{line} {measured['peak_rss'] / gib:.2f} GiB, bound {bound / gib:.2f} GiB: {verdict}")
        rank0 = memory["ranks"][0]
        notes.append(
            f"Memory: GPT-3 medium dims ({rank0['num_params']:,} parameters, {rank0['units']} FSDP units) + AdamW on "
            f"{devices} ranks, full file {memory['file_bytes'] / 1e9:.2f} GB, resumed by a fresh launch with "
            f"fit(ckpt_path=...) in {rank0['seconds']:.1f} s. Peak RSS: VmHWM reset just before the load (it "
            "includes the process itself, the model, and the gradients and AdamW states the load creates). Bound: "
            f"own shard state ({rank0['own_shard_bytes'] / gib:.2f} GiB = 16 B x {rank0['local_params']:,} local "
            f"parameters) + the largest unit as stored ({rank0['largest_unit_bytes'] / gib:.2f} GiB = 12 B per "
            f"parameter) + 20%: {verdicts[0]} on rank 0."
        )
    report = {
        "title": "Checkpoint loads vs one process's torch.load, and rank 0's memory loading a full file",
        "question": "Does a sharded load run at least as fast as one process torch.load-ing the same bytes, round "
        "after round; does rank 0 stay within its own shard + the largest unit + 20% while loading a full file?",
        "columns": ["measure", "value", "against", "ratio"],
        "rows": rows,
        "notes": notes,
    }
    return summary, report
