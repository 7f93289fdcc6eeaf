"""Turn ``benchmarks/results/*.json`` into ``BENCHMARKS.md``.

    python benchmarks/make_report.py                     # reads benchmarks/results/, writes BENCHMARKS.md

Everything in the report is computed here from the JSON files; nothing is typed in by hand except the prose.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MiB = 2**20


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _machine_line(data: dict[str, Any]) -> str:
    s, e = data["machine_start"], data["machine_end"]
    return (
        f"{s['cpu_count']} cores ({s['cpu_model']}), {s['memory_gib']} GiB; load average (1/5/15 min) "
        f"{'/'.join(f'{x:.1f}' for x in s['loadavg'])} at start, {'/'.join(f'{x:.1f}' for x in e['loadavg'])} at end; "
        f"torch {s['torch']}, lightning {s['lightning']}, commit {s['git_commit']}"
        + (f" with uncommitted edits ({', '.join(e.get('git_dirty', []))})" if e.get("git_dirty") else "")
        + f", {s['time']}"
    )


# ---------------------------------------------------------------------------------------------------- train speed


def summarise_train(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per configuration: pooled median step time (slowest rank per step), per-round medians, memory."""
    settings = data["settings"]
    tokens_per_step = settings["batch_size"] * settings["devices"] * data["model"]["block_size"]
    out: dict[str, dict[str, Any]] = {}
    for run in data["runs"]:
        ranks = run["ranks"]
        steps = [max(r["timed_step_seconds"][i] for r in ranks) for i in range(len(ranks[0]["timed_step_seconds"]))]
        entry = out.setdefault(
            run["config"],
            {"steps": [], "round_medians": [], "peak_rss": [], "state": [], "loads": [], "losses": None, "threads": []},
        )
        entry["steps"] += steps
        entry["round_medians"].append(statistics.median(steps))
        entry["peak_rss"].append([r["peak_rss_bytes"] for r in ranks])
        entry["state"].append([sum(r["model_state"].values()) for r in ranks])
        entry["loads"].append(ranks[0]["loadavg_start"][0])
        entry["threads"].append([r["torch_threads"] for r in ranks])
        entry["losses"] = ranks[0]["losses"]
        entry["num_params"] = ranks[0]["num_params"]
    for entry in out.values():
        entry["median_step"] = statistics.median(entry["steps"])
        entry["tokens_per_s"] = tokens_per_step / entry["median_step"]
        entry["peak_rss_max_per_rank"] = [max(col) for col in zip(*entry["peak_rss"])]
        entry["state_per_rank"] = [max(col) for col in zip(*entry["state"])]
        entry["limit"] = 16 * entry["num_params"] / settings["devices"]
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def train_section(data: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    s = summarise_train(data)
    settings, model = data["settings"], data["model"]
    ddp, anchor = s.get("ddp"), s.get("anchor")
    n_params = next(iter(s.values()))["num_params"]
    lines = [
        "## Training speed and memory (2 CPU ranks)",
        "",
        f"GPT n_layer {model['n_layer']}, n_embd {model['n_embd']}, n_head {model['n_head']}, vocabulary "
        f"{model['vocab_size']}, context {model['block_size']}: {n_params:,} parameters, fp32, AdamW. Micro-batch "
        f"{settings['batch_size']} x {model['block_size']} tokens per rank, {settings['devices']} ranks (gloo), random "
        f"tokens. One launch per configuration, configurations alternating, {settings['rounds']} rounds; "
        f"{settings['warmup']} warm-up + {settings['steps']} timed steps per launch. A step's time is the slowest "
        "rank's `perf_counter` between `on_train_batch_start` and `on_train_batch_end` (barrier on both ends); "
        "the table gives the median over all timed steps of all rounds (and the per-round medians). Speed ratios are "
        "throughput ratios (higher is faster). Model state = parameters + gradients + AdamW states held by the rank "
        "(local shards, `lightning_shard.memory.accounting`) at the end of the last step; the limit is "
        f"16 B x params / N = {ddp['limit'] / MiB if ddp else 0:.1f} MiB.",
        "",
        f"Machine: {_machine_line(data)}. Benchmark wall time {data['wall_seconds'] / 60:.1f} min.",
        "",
        "| configuration | median s/step (per round) | tokens/s | vs DDP | vs anchor | peak RSS per rank, MiB "
        "| model state per rank, MiB | state / limit | torch threads per rank | load at launch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in s.items():
        lines.append(
            f"| `{name}`: {data['descriptions'][name]} | {entry['median_step']:.3f} "
            f"({' / '.join(f'{x:.2f}' for x in entry['round_medians'])}) | {entry['tokens_per_s']:.0f} "
            f"| {_ratio(ddp and ddp['median_step'], entry['median_step'])} "
            f"| {_ratio(anchor and anchor['median_step'], entry['median_step'])} "
            f"| {' / '.join(f'{b / MiB:.0f}' for b in entry['peak_rss_max_per_rank'])} "
            f"| {' / '.join(f'{b / MiB:.1f}' for b in entry['state_per_rank'])} "
            f"| {max(entry['state_per_rank']) / entry['limit']:.3f} "
            f"| {' / '.join(str(t) for t in entry['threads'][0])} "
            f"| {' / '.join(f'{x:.1f}' for x in entry['loads'])} |"
        )
    losses = {name: entry["losses"][-1] for name, entry in s.items()}
    lines += [
        "",
        "Same data and seed everywhere; loss after the last step on rank 0: "
        + ", ".join(f"`{k}` {v:.4f}" for k, v in losses.items())
        + ". Peak RSS is the process high-water mark (`ru_maxrss`), the largest over the rounds.",
        "",
    ]
    return lines, s


def targets_section(s: dict[str, Any]) -> list[str]:
    def speed(name: str) -> float | None:
        return 1 / s[name]["median_step"] if name in s else None

    rows = []

    def add(label: str, value: float | None, target: float, fmt: str, higher: bool = True) -> None:
        if value is None:
            rows.append(f"| {label} | not measured | | |")
            return
        met = value >= target if higher else value <= target
        rows.append(f"| {label} | {fmt.format(value)} | {'>=' if higher else '<='} {fmt.format(target)} | "
                    f"{'**met**' if met else '**not met**'} |")

    ddp, anchor = speed("ddp"), speed("anchor")
    add("FULL_SHARD throughput / anchor", speed("fs") / anchor if anchor and speed("fs") else None, 1.1, "{:.2f}x")
    add("FULL_SHARD throughput / DDP", speed("fs") / ddp if ddp and speed("fs") else None, 0.85, "{:.2f}x")
    add("SHARD_GRAD_OP throughput / DDP", speed("sgo") / ddp if ddp and speed("sgo") else None, 0.95, "{:.2f}x")
    if "ddp" in s:
        ddp_rss = max(s["ddp"]["peak_rss_max_per_rank"])
        for name in ("fs", "fs_ac", "sgo", "sgo_ac", "ns", "ns_ac"):
            if name in s:
                add(f"`{name}` max peak RSS per rank / DDP's", max(s[name]["peak_rss_max_per_rank"]) / ddp_rss,
                    1.0, "{:.3f}", higher=False)
    for name in ("fs", "sgo"):
        if name in s:
            add(f"`{name}` model state per rank / (16 B x params / N)",
                max(s[name]["state_per_rank"]) / s[name]["limit"], 1.05, "{:.4f}", higher=False)
    return [
        "## Targets (from the issue)",
        "",
        "| target | measured | goal | |",
        "|---|---|---|---|",
        *rows,
        "",
        "(\"below DDP's\" is read strictly: the ratio has to be under 1.000.)",
        "",
    ]


def changes_section(s: dict[str, Any], data: dict[str, Any]) -> list[str]:
    if "fs" not in s:
        return []
    base = s["fs"]
    lines = [
        "## What each change bought",
        "",
        "Each idea applied to `ShardedStrategy(\"FULL_SHARD\")` from the outside (a callback in "
        "`benchmarks/train_speed.py`; the strategy is unchanged), measured in the same alternating rounds as the "
        "baseline `fs`. Gain = `fs` median step / variant median step - 1 (positive: faster); per round: the same "
        "from the two launches of that round.",
        "",
        "| change | median s/step | gain vs `fs` | gain per round | vs DDP |",
        "|---|---|---|---|---|",
    ]
    for name in ("fs_threads", "fs_prefetch", "fs_last", "fs_both", "fs_all", "fs_ac"):
        if name not in s:
            continue
        v = s[name]
        per_round = [b / x - 1 for b, x in zip(base["round_medians"], v["round_medians"], strict=False)]
        lines.append(
            f"| `{name}`: {data['descriptions'][name]} | {v['median_step']:.3f} "
            f"| {base['median_step'] / v['median_step'] - 1:+.1%} | {', '.join(f'{g:+.1%}' for g in per_round)} "
            f"| {_ratio(s['ddp']['median_step'] if 'ddp' in s else None, v['median_step'])} |"
        )
    lines.append("")

    def gain(name: str) -> str:
        return f"{base['median_step'] / s[name]['median_step'] - 1:+.0%}" if name in s else "not measured"

    lines += [
        "The changes, as they would go into the strategy (none of them is applied to it by this benchmark):",
        "",
        f"1. **Thread count on every rank** (`fs_threads`, measured {gain('fs_threads')}). "
        "`ShardedStrategy._configure_launcher` returns early when `cluster_environment.creates_processes_externally`, "
        "which is true on the ranks the popen launcher starts (they see `LOCAL_RANK`), so they never run the "
        "launcher's `_set_num_threads_if_needed` and keep torch's default of all cores: here rank 0 ran 1 thread "
        "and rank 1 ran 2 on 2 cores (column *torch threads* above). Lightning's `DDPStrategy` always builds the "
        "`_SubprocessScriptLauncher` for popen (it spawns nothing on such ranks but still sets the threads), so "
        "under DDP every rank runs cores // ranks threads. Change: in `ShardedStrategy.setup_environment`, before "
        "`_init_dist_connection`, add "
        "`_set_num_threads_if_needed(num_processes=self.num_processes)` (from "
        "`lightning.fabric.utilities.distributed`; a no-op when `OMP_NUM_THREADS` is set, e.g. by torchrun), or "
        "build the launcher unconditionally for `start_method=\"popen\"` as `DDPStrategy._configure_launcher` does. "
        "(Lightning's own `ModelParallelStrategy`, the anchor, has the same gap.)",
        f"2. **Keep the last Block gathered after forward** (`fs_last`, measured {gain('fs_last')}): in "
        "`parallelize_module`, pass `reshard_after_forward=False` to the last unit's `fully_shard` call "
        "(torchtitan does the same: backward starts with that block, so resharding it only to gather it again "
        "costs one all-gather per step; the memory cost is one block's unsharded parameters during the "
        "forward-to-backward gap). Equivalent after setup: `units[-1].set_reshard_after_forward(False)`.",
        f"3. **Explicit prefetch** (`fs_prefetch`, measured {gain('fs_prefetch')}): "
        "`units[i].set_modules_to_forward_prefetch([units[i + 1]])` and "
        "`units[i].set_modules_to_backward_prefetch([units[i - 1]])` after sharding. On CPU, FSDP2 has no "
        "copy/communication streams; an issued-early all-gather can only overlap through gloo's own worker thread, "
        "which competes with compute for the same two cores.",
        "",
    ]
    return lines


# ---------------------------------------------------------------------------------------------------- the rest


def meta_section(data: dict[str, Any]) -> list[str]:
    m = data["median"]
    run = data["runs"][0]
    return [
        "## Building and wrapping the 13B model on the meta device",
        "",
        f"`{data['config']}` model arguments ({run['num_params']:,} parameters), built under `torch.device(\"meta\")`, "
        f"then `fully_shard` per Block + root over a world of {data['world_size']} on a fake process group "
        f"(`FakeStore` + `init_process_group(\"fake\")`), nothing materialised; {run['fsdp_units']} FSDP units. "
        f"Sharded parameters per rank: {run['param_bytes_per_rank'] / 2**30:.2f} GiB (fp32). Median of "
        f"{len(data['runs']) // 2} repeats.",
        "",
        f"Machine: {_machine_line(data)}.",
        "",
        f"| | build, s | activation-checkpoint wrap, s | fully_shard ({run['fsdp_units']} calls), s | total, s |",
        "|---|---|---|---|---|",
        *(
            f"| {label} | {m[key]['build_seconds']:.2f} | {m[key]['checkpoint_wrap_seconds']:.2f} "
            f"| {m[key]['fully_shard_seconds']:.2f} | {m[key]['total_seconds']:.2f} |"
            for key, label in (("plain", "no activation checkpointing"), ("ac", "activation_checkpointing=[Block]"))
        ),
        "",
    ]


def checkpoint_section(data: dict[str, Any]) -> list[str]:
    m = data["median"]
    labels = {
        "sharded": "sharded (DCP directory, every rank writes) - `trainer.save_checkpoint` / `strategy.load_checkpoint`",
        "full": "full (one file from rank 0; load: rank 0 reads + broadcast)",
        "raw": "raw `torch.save` / `torch.load` of the full checkpoint's content, one process",
    }
    return [
        "## Checkpoint save / load",
        "",
        f"GPT with {data['num_params']:,} parameters, FULL_SHARD on {data['devices']} CPU ranks, after one step "
        "(model + AdamW states + loops: the whole Lightning checkpoint). Median of "
        f"{len(data['records']) // 3} alternating repeats; barriers on both ends of every timing; MB = 1e6 bytes. "
        "Loads read files just written, so they come from the page cache (for all three rows alike).",
        "",
        f"Machine: {_machine_line(data)}.",
        "",
        "| format | size, MB | save, s | save, MB/s | load, s | load, MB/s | save vs raw | load vs raw |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {labels[k]} | {m[k]['bytes'] / 1e6:.0f} | {m[k]['save_seconds']:.2f} | {m[k]['save_MBps']:.0f} "
            f"| {m[k]['load_seconds']:.2f} | {m[k]['load_MBps']:.0f} "
            f"| {m[k]['save_seconds'] / m['raw']['save_seconds']:.2f}x time "
            f"| {m[k]['load_seconds'] / m['raw']['load_seconds']:.2f}x time |"
            for k in ("sharded", "full", "raw")
        ),
        "",
    ]


def scaling_section(data: dict[str, Any]) -> list[str]:
    rows = data["rows"]
    return [
        "## Model state per rank at 1, 2 and 4 ranks",
        "",
        f"The training GPT ({rows[0]['num_params']:,} parameters), `ShardedStrategy(\"FULL_SHARD\")`, one step of "
        "micro-batch 1 per launch; parameters + gradients + AdamW states from the local shards after the step.",
        "",
        f"Machine: {_machine_line(data)}.",
        "",
        "| configuration | ranks | limit 16 B x P / N, MiB | per rank, MiB | largest / limit |",
        "|---|---|---|---|---|",
        *(
            f"| `{r['config']}` | {r['world_size']} | {r['limit_bytes'] / MiB:.2f} "
            f"| {' / '.join(f'{b / MiB:.2f}' for b in r['model_state_bytes'])} | {r['max_over_limit']:.4f} |"
            for r in rows
        ),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    args = parser.parse_args()
    results = Path(args.results)
    train, meta = _load(results, "train_speed"), _load(results, "meta_build")
    ckpt, scaling = _load(results, "checkpoint_io"), _load(results, "model_state_scaling")

    lines = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/make_report.py` from `benchmarks/results/*.json`; do not edit by hand.",
        "All numbers are from CPU runs (gloo) on a small shared machine that other jobs were using at the same time:",
        "the load averages are given with each table, and configurations were interleaved so that load affects",
        "them alike, but absolute times are noisy and ratios within about 10% should be read as ties.",
        "",
        "Commands (in this order):",
        "",
        "```bash",
        *(d["command"] for d in (train, scaling, meta, ckpt) if d),
        "python benchmarks/make_report.py",
        "```",
        "",
    ]
    s = None
    if train:
        body, s = train_section(train)
        lines += targets_section(s) + body + changes_section(s, train)
    if scaling:
        lines += scaling_section(scaling)
    if meta:
        lines += meta_section(meta)
    if ckpt:
        lines += checkpoint_section(ckpt)
    notes = HERE / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    Path(args.output).write_text("\n".join(lines))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
