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
        entry.setdefault("setup_rss", []).append([r.get("setup_peak_rss_bytes", 0) for r in ranks])
        entry.setdefault("step1_rss", []).append([r.get("first_step_peak_rss_bytes", 0) for r in ranks])
        warmup = settings["warmup"]
        if all(len(r.get("phase_seconds", [])) > warmup for r in ranks):
            n = min(len(r["phase_seconds"]) for r in ranks)
            for i in range(warmup, n):
                # Slowest rank per phase.
                entry.setdefault("phases", []).append([max(r["phase_seconds"][i][k] for r in ranks) for k in range(3)])
        entry["state"].append([sum(r["model_state"].values()) for r in ranks])
        entry["loads"].append(ranks[0]["loadavg_start"][0])
        entry["threads"].append([r["torch_threads"] for r in ranks])
        entry["losses"] = ranks[0]["losses"]
        entry["num_params"] = ranks[0]["num_params"]
    for entry in out.values():
        entry["median_step"] = statistics.median(entry["steps"])
        entry["tokens_per_s"] = tokens_per_step / entry["median_step"]
        entry["peak_rss_max_per_rank"] = [max(col) for col in zip(*entry["peak_rss"], strict=True)]
        entry["setup_rss_max"] = max(max(col) for col in entry["setup_rss"])
        entry["step1_rss_max"] = max(max(col) for col in entry["step1_rss"])
        entry["state_per_rank"] = [max(col) for col in zip(*entry["state"], strict=True)]
        entry["limit"] = 16 * entry["num_params"] / settings["devices"]
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def train_section(data: dict[str, Any], title: str) -> tuple[list[str], dict[str, Any]]:
    s = summarise_train(data)
    settings, model = data["settings"], data["model"]
    ddp, anchor = s.get("ddp"), s.get("anchor")
    n_params = next(iter(s.values()))["num_params"]
    lines = [
        f"## {title}",
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
            f"| {', '.join('/'.join(str(t) for t in rnd) for rnd in entry['threads'])} "
            f"| {' / '.join(f'{x:.1f}' for x in entry['loads'])} |"
        )
    if any(entry["setup_rss_max"] for entry in s.values()):
        lines += [
            "",
            "Where the peak RSS is reached (largest over ranks and rounds, MiB): high-water mark at the end of setup "
            "(model built, sharded, materialised; optimizer created), after the first step, and at the end.",
            "",
            "| configuration | after setup | after step 1 | end of fit |",
            "|---|---|---|---|",
            *(
                f"| `{name}` | {e['setup_rss_max'] / MiB:.0f} | {e['step1_rss_max'] / MiB:.0f} "
                f"| {max(e['peak_rss_max_per_rank']) / MiB:.0f} |"
                for name, e in s.items()
            ),
        ]
    if any(entry.get("phases") for entry in s.values()):
        lines += [
            "",
            "Phase split of a step (median over timed steps, slowest rank per phase; no barriers inside the step): "
            "forward = batch start to `on_before_backward`; backward = to `on_after_backward` (includes FSDP's "
            "all-gathers and reduce-scatters / DDP's all-reduce); rest = optimizer step, LR scheduler, logging "
            "(one `sync_dist` all-reduce of the loss in every configuration).",
            "",
            "| configuration | forward, s | backward, s | rest (optimizer ...), s |",
            "|---|---|---|---|",
            *(
                f"| `{name}` | "
                + " | ".join(f"{statistics.median(p[k] for p in e['phases']):.3f}" for k in range(3))
                + " |"
                for name, e in s.items()
                if e.get("phases")
            ),
        ]
    if "ddp" in s:
        rounds = len(s["ddp"]["round_medians"])
        lines += [
            "",
            "Per-round ratios (throughput vs the same round's `ddp` / `anchor` launch, which ran first in the round; "
            "load "
            "drifted within a round too, so later configurations of a round are compared across a few minutes):",
            "",
            "| configuration | " + " | ".join(f"round {i}: vs DDP, vs anchor" for i in range(rounds)) + " |",
            "|---|" + "---|" * rounds,
        ]
        for name, e in s.items():
            cells = []
            for i in range(rounds):
                if i >= len(e["round_medians"]):
                    cells.append("-")
                    continue
                vs_anchor = f"{s['anchor']['round_medians'][i] / e['round_medians'][i]:.2f}x" if "anchor" in s else "-"
                cells.append(f"{s['ddp']['round_medians'][i] / e['round_medians'][i]:.2f}x, {vs_anchor}")
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    losses = {name: entry["losses"][-1] for name, entry in s.items()}
    lines += [
        "",
        "Same data and seed everywhere; loss after the last step on rank 0: "
        + ", ".join(f"`{k}` {v:.4f}" for k, v in losses.items())
        + ". Peak RSS is the process high-water mark (`ru_maxrss`), the largest over the rounds.",
        "",
    ]
    return lines, s


def targets_section(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One row per target, one column per benchmark run (e.g. the full run and the focused rerun)."""

    def measures(s: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}

        def speed(name: str) -> float | None:
            return 1 / s[name]["median_step"] if name in s else None

        if speed("fs") and speed("anchor"):
            out["FULL_SHARD throughput / anchor"] = speed("fs") / speed("anchor")
        if speed("fs") and speed("ddp"):
            out["FULL_SHARD throughput / DDP"] = speed("fs") / speed("ddp")
        if speed("sgo") and speed("ddp"):
            out["SHARD_GRAD_OP throughput / DDP"] = speed("sgo") / speed("ddp")
        if "ddp" in s:
            ddp_rss = max(s["ddp"]["peak_rss_max_per_rank"])
            for name in (
                "fs",
                "fs_ac",
                "sgo",
                "sgo_ac",
                "ns",
                "ns_ac",
                "fs_gloocomms",
                "fs_fsdpcomms",
                "fs_notrim",
                "fs_nocomm",
                "fs_mmap",
            ):
                if name in s:
                    out[f"`{name}` max peak RSS per rank / DDP's"] = max(s[name]["peak_rss_max_per_rank"]) / ddp_rss
        for name in ("fs", "sgo"):
            if name in s:
                out[f"`{name}` model state per rank / (16 B x params / N)"] = (
                    max(s[name]["state_per_rank"]) / s[name]["limit"]
                )
        return out

    goals = {
        "FULL_SHARD throughput / anchor": (1.1, True, "{:.2f}x"),
        "FULL_SHARD throughput / DDP": (0.85, True, "{:.2f}x"),
        "SHARD_GRAD_OP throughput / DDP": (0.95, True, "{:.2f}x"),
    }
    measured = [(label, measures(s)) for label, s in runs]
    keys: list[str] = []
    for _, m in measured:
        keys += [k for k in m if k not in keys]
    rows = []
    for key in keys:
        target, higher, fmt = goals.get(key, (1.05 if "model state" in key else 1.0, False, "{:.3f}"))
        cells = []
        for _, m in measured:
            if key not in m:
                cells.append("-")
                continue
            met = m[key] >= target if higher else m[key] < target or ("model state" in key and m[key] <= target)
            cells.append(f"{fmt.format(m[key])} ({'**met**' if met else '**not met**'})")
        rows.append(f"| {key} | {'>=' if higher else '<='} {fmt.format(target)} | " + " | ".join(cells) + " |")
    return [
        "## Targets (from the issue)",
        "",
        "| target | goal | " + " | ".join(label for label, _ in measured) + " |",
        "|---|---|" + "---|" * len(measured),
        *rows,
        "",
        '("Peak RSS below DDP\'s" is read strictly: the ratio has to be under 1.000.)',
        "",
    ]


# Variants that take a change of the strategy out again: fs against them is what the change bought.
IN_STRATEGY = {
    "fs_gloobarrier": "the futex barrier",
    "fs_gloocomms": "the shared-memory collectives",
    "fs_fsdpcomms": "the gloo collectives + reused buffers",
    "fs_notrim": "the heap trim",
}


def changes_section(runs: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[str]:
    runs = [r for r in runs if "fs" in r[1]]
    if not runs:
        return []
    lines = [
        "## What each change bought",
        "",
        'Each idea applied to `ShardedStrategy("FULL_SHARD")` from the outside (a callback in '
        "`benchmarks/train_speed.py`), measured in the same alternating rounds as the baseline `fs`; `fs_gloocomms`, "
        "`fs_fsdpcomms` and `fs_notrim` take a change of the strategy out again, so their rows read the other way "
        "round. "
        "Gain = `fs` median step / variant median step - 1 (positive: faster); per round: the same "
        "from the two launches of that round.",
        "",
        "| run | change | median s/step (`fs`: baseline) | gain vs `fs` (`ddp_*`: vs `ddp`) | gain per round "
        "| vs DDP | vs anchor |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, s, data in runs:
        for name in (
            "fs",
            "fs_gloobarrier",
            "fs_gloocomms",
            "fs_fsdpcomms",
            "fs_notrim",
            "fs_threads",
            "fs_prefetch",
            "fs_last",
            "fs_both",
            "fs_all",
            "fs_foreach",
            "fs_mmap",
            "fs_nocomm",
            "fs_ac",
            "ddp_foreach",
            "ddp_mmap",
        ):
            if name not in s:
                continue
            # ddp_* variants are measured against ddp, everything else against fs; changes that are in the strategy
            # are measured the other way round: fs against the variant that takes them out.
            base, v = (s["ddp"] if name.startswith("ddp_") else s["fs"]), s[name]
            description = f"`{name}`: {data['descriptions'][name]}"
            if name in IN_STRATEGY:
                base, v = v, s["fs"]
                description = f"`fs` against `{name}`: {IN_STRATEGY[name]} (in the strategy)"
            per_round = [b / x - 1 for b, x in zip(base["round_medians"], v["round_medians"], strict=False)]
            lines.append(
                f"| {label} | {description} | {v['median_step']:.3f} "
                f"| {base['median_step'] / v['median_step'] - 1:+.1%} | {', '.join(f'{g:+.1%}' for g in per_round)} "
                f"| {_ratio(s['ddp']['median_step'] if 'ddp' in s else None, v['median_step'])} "
                f"| {_ratio(s['anchor']['median_step'] if 'anchor' in s else None, v['median_step'])} |"
            )
    lines.append("")

    def gain(name: str) -> str:
        parts = [
            f"{s['fs']['median_step'] / s[name]['median_step'] - 1:+.0%} ({label})" for label, s, _ in runs if name in s
        ]
        return " and ".join(parts) if parts else "not measured"

    def rss(name: str, run: str | None = None) -> str:
        parts = [
            f"{max(s[name]['peak_rss_max_per_rank']) / MiB:.0f} MiB ({label})"
            for label, s, _ in runs
            if name in s and run in (None, label)
        ]
        return " and ".join(parts) if parts else "not measured"

    def strategy_gain(name: str, run: str | None = None) -> str:
        """fs against the variant that takes a change of the strategy out again, pooled and per round."""
        parts = [
            f"{s[name]['median_step'] / s['fs']['median_step'] - 1:+.0%} ({label}; per round "
            + ", ".join(
                f"{b / x - 1:+.0%}" for b, x in zip(s[name]["round_medians"], s["fs"]["round_medians"], strict=False)
            )
            + ")"
            for label, s, _ in runs
            if name in s and run in (None, label)
        ]
        return " and ".join(parts) if parts else "not measured"

    lines += [
        "The changes, and where they stand:",
        "",
        "0. **Futex barrier - in the strategy** (`fs` vs `fs_gloobarrier`: "
        f"{strategy_gain('fs_gloobarrier')}). The shared-memory collectives still waited at one gloo barrier each, "
        "about 20 per FULL_SHARD step; timestamps around them in a plain FSDP2 loop showed 0.5 ms (median) from the "
        "last rank's arrival to the exit, about 22 ms per step, spent in gloo's worker thread and the loopback "
        "socket on both ranks. `lightning_shard/shm_barrier.py` synchronises on one futex word per rank in a shared "
        "page instead: 0.03 ms, 0.7 ms per step. A waiting rank sleeps in the kernel (spinning instead slowed the "
        "other rank on this 2-vCPU machine), and checks every 0.5 s that the ranks it waits for are alive (pidfds) "
        "and within the group's timeout. x86-64 Linux only, within one pid namespace; gloo's barrier elsewhere.",
        "1. **Shared-memory collectives - in the strategy** (`fs` vs `fs_gloocomms`: "
        f"{strategy_gain('fs_gloocomms')}; peak RSS `fs` {rss('fs', 'main run')} against `fs_gloocomms` "
        f"{rss('fs_gloocomms', 'main run')} and `ddp` {rss('ddp', 'main run')}). The diagnostic run had shown that "
        "FULL_SHARD without communication runs at DDP's speed, so the gap was the collectives: gloo sends every byte "
        "through the loopback TCP stack. `lightning_shard/shm_comms.py` keeps gloo for synchronisation only (one "
        "barrier per collective) and moves the data through two shared-memory segments per process group, taken in "
        "turn. Measured alone (*CPU collectives and buffers*) its all-gather and reduce-scatter are 4-7x and 3-4x "
        "faster than gloo's. Groups that span hosts, or that cannot reserve the segment in `/dev/shm`, fall back "
        "to `gloo_comms` on every rank. 2 ranks write the bytes of FSDP2's defaults and train bit-identically "
        "(`tests/test_shm_comms.py`).",
        "2. **gloo collectives and reused comm buffers - in the strategy** (`fs` vs `fs_fsdpcomms`: "
        f"{strategy_gain('fs_fsdpcomms')}; "
        f"peak RSS `fs` {rss('fs', 'gloo main run')} against `fs_fsdpcomms` {rss('fs_fsdpcomms', 'gloo main run')} "
        f"and `ddp` {rss('ddp', 'gloo main run')}). "
        "Found by profiling (torch.profiler, a plain FSDP2 loop on 2 gloo ranks) and by the microbenchmarks in "
        "*gloo collectives and buffers*: gloo's `reduce_scatter_single` is slower than an all-reduce plus a copy of "
        "this rank's chunk, its `all_gather_single` no faster than its list all-gather, and a copy into a fresh "
        "buffer slower than into a reused one. glibc's allocator statistics (`mallinfo2`, same loop) showed where "
        "the RSS excess was: FULL_SHARD held less live heap than DDP (239 vs 430 MiB after the optimizer step) but "
        "kept 411 MiB of freed blocks. "
        "`lightning_shard/gloo_comms.py` installs both collectives through FSDP2's `set_custom_all_gather` / "
        "`set_custom_reduce_scatter` on CPU meshes, with a pool that hands a comm buffer out again once nothing "
        "refers to its storage (at most 4 buffers per collective). Results are bit-identical to FSDP2's defaults "
        "(`tests/test_gloo_comms.py`). A fixed glibc mmap threshold (item 8) lowered RSS too, but slowed every step.",
        f"3. **Heap trim every 5 optimizer steps - in the strategy** (`fs` vs `fs_notrim`: "
        f"{strategy_gain('fs_notrim', 'trim check')}; peak RSS `fs` {rss('fs', 'trim check')} against `fs_notrim` "
        f"{rss('fs_notrim', 'trim check')} and `ddp` {rss('ddp', 'trim check')}). With the pool alone, peak RSS still "
        "crept up with the step count (the long run: 1.06x DDP over 22 steps), because FSDP2 also frees and "
        "re-allocates unsharded parameters and gradients every step, out of reach of its comm hooks. "
        "`lightning_shard/cpu_heap.py` calls glibc's `malloc_trim(0)` after every 5th optimizer step on a CPU device "
        "(`ShardedStrategy.optimizer_step`), so the free pages go back to the OS. Trimming after every step (the "
        f"trim run and the every-step check: {strategy_gain('fs_notrim', 'every-step trim')}) cost step time, "
        "because the next step faults the pages in again.",
        f"4. **Thread count on every rank - in the strategy since commit f2e3f93** (`fs_threads`: "
        f"{gain('fs_threads')}; run 2 round 0 alone is the clean pair). `ShardedStrategy._configure_launcher` used to "
        "return early on the ranks the popen launcher starts, so they never ran the launcher's "
        "`_set_num_threads_if_needed` and kept torch's default of all cores (rank 0 ran 1 thread, rank 1 ran 2 on 2 "
        "cores). It now builds the launcher on every rank, as `DDPStrategy` does.",
        f"5. **Keep the last Block gathered after forward - not adopted** (`fs_last`: {gain('fs_last')}): "
        "`units[-1].set_reshard_after_forward(False)` saves one all-gather per step at the cost of one block's "
        "unsharded parameters between forward and backward. No gain beyond noise here.",
        f"6. **Explicit prefetch - not adopted** (`fs_prefetch`: {gain('fs_prefetch')}): "
        "`units[i].set_modules_to_forward_prefetch([units[i + 1]])` and "
        "`units[i].set_modules_to_backward_prefetch([units[i - 1]])`. On CPU, FSDP2 has no copy/communication "
        "streams; an early all-gather can only overlap through gloo's worker thread, which competes with compute "
        "for the same two cores. Both are GPU-stream optimisations that this machine cannot judge.",
        f"7. **AdamW foreach - the user's choice** (`fs_foreach`: {gain('fs_foreach')}; `ddp_foreach` vs `ddp` is "
        "the same change for DDP). On CPU torch picks the per-parameter loop, and under FSDP2 every elementwise op of "
        "it dispatches through DTensor. It is set in the user's `configure_optimizers` (`foreach=True`).",
        f"8. **Fixed glibc mmap threshold - not adopted** (`fs_mmap`: peak RSS {rss('fs_mmap')} vs `fs` "
        f"{rss('fs')}; `ddp_mmap` {rss('ddp_mmap')} vs `ddp` {rss('ddp')}; step times in run 3's table). "
        "`MALLOC_MMAP_THRESHOLD_=131072` returns freed buffers to the OS, but every step then maps and zero-fills them "
        "again: +13% to +81% step time. Items 2 and 3 reach the memory target without that cost.",
        "",
    ]
    return lines


MAIN_NOTE = (
    "Every configuration with the shared-memory collectives (commit 0a04d29, where a group's segments still grew "
    "to its largest unit; every unit of this model fits in one 16 MiB piece, so commit 32eaad3 runs it the same "
    "way): on CPU ranks of one host FSDP2's collectives move their "
    "data through shared memory (`lightning_shard/shm_comms.py`), and the heap is trimmed every 5 optimizer steps. "
    "`fs_gloocomms` is the same FULL_SHARD run with `gloo_comms` put back (gloo carries the data, as before "
    "`shm_comms`), so `fs` against it is what the change bought. 20 timed steps per launch. Command: `python "
    "benchmarks/train_speed.py --configs ddp anchor fs fs_gloocomms fs_ac sgo sgo_ac ns ns_ac --rounds 2 --steps 20`."
)
LONG_SHM_NOTE = (
    "The targets' configurations and `fs_gloocomms` with 3 rounds of 20 timed steps, for tighter medians, on commit "
    "32eaad3 (segments reserved once, collectives in 16 MiB pieces). Command: `python benchmarks/train_speed.py "
    "--configs ddp anchor fs fs_gloocomms sgo --rounds 3 --steps 20 --output "
    "benchmarks/results/train_speed_long_shm.json`."
)
ROUNDS8_NOTE = (
    "The two DDP targets with more rounds, on a faster day than the futex runs: `ddp`, `fs` and `sgo`, 8 rounds of "
    "20 timed steps, from a clean worktree of commit c66a4eb (the futex barrier, plus the process group destroyed "
    "at exit; hence the absolute output path in the command). DDP took 0.74-0.90 s per step between rounds."
)
ALL4_NOTE = (
    "Right after the 8-round run, every speed target in one run: `ddp`, `anchor`, `fs` and `sgo`, 4 rounds of 20 "
    "timed steps, from the same worktree of commit c66a4eb."
)
CONFIRM_NOTE = (
    "A confirmation on the same day, later: `ddp`, `fs` and `sgo`, 4 rounds of 20 timed steps, from a clean worktree "
    "of commit 576f2f4 (the same strategy code as c66a4eb)."
)
FUTEX_NOTE = (
    "The futex barrier (`lightning_shard/shm_barrier.py`) in the shared-memory collectives: `ddp`, `fs`, `sgo` and "
    "`fs_gloobarrier` (the same FULL_SHARD run with gloo's barrier put back), 4 rounds of 20 timed steps, run from a "
    "clean worktree of commit c486292 (hence the absolute output path in the command). The machine ran slower on "
    "this day than in the runs below: DDP's forward and backward took 0.270 and 0.589 s against 0.205 and 0.452 s "
    "in the main run, and the same single-thread matmul loop took 400-770 ms on one vCPU or the other "
    "(`NOTES.md`)."
)
FUTEX2_NOTE = (
    "The same day, with the anchor: `ddp`, `anchor`, `fs`, `fs_gloobarrier` and `sgo`, 3 rounds of 20 timed steps, "
    "from the same worktree of commit c486292."
)
DDP_CHECK_NOTE = (
    "The two DDP targets once more after the runs above had put them within noise of their goals: only `ddp`, `fs` "
    "and `sgo`, 4 rounds of 20 timed steps, on commit e147fb5. Command: `python benchmarks/train_speed.py --configs "
    "ddp fs sgo --rounds 4 --steps 20 --output benchmarks/results/train_speed_ddp_shm.json`."
)
SHM_FIRST_NOTE = (
    "The first run with `shm_comms` (the working tree of commit 0a04d29), the targets' configurations and "
    "`fs_gloocomms`, 8 timed steps. Command: `python benchmarks/train_speed.py --configs ddp anchor fs fs_gloocomms "
    "sgo --rounds 2 --output benchmarks/results/train_speed_shm.json`."
)
GLOO_MAIN_NOTE = (
    "The main run of the previous round (its output moved to `benchmarks/results/train_speed_gloo.json`): all "
    "configurations with `gloo_comms`, before the heap trim and before `shm_comms`. On CPU meshes the strategy "
    "installed `lightning_shard.cpu.gloo_comms` (gloo list all-gather, all-reduce + copy in place of reduce-scatter, "
    "reused comm buffers). `fs_fsdpcomms` is the same FULL_SHARD run with FSDP2's default collectives put back, in "
    "the same rounds, so `fs` against it is what that change bought. Command: `python benchmarks/train_speed.py "
    "--configs ddp anchor fs fs_fsdpcomms fs_ac sgo sgo_ac ns ns_ac --rounds 2`."
)
TRIM_NOTE = (
    "The targets' configurations over 22 steps, where the long run had shown peak RSS creeping above DDP's, with a "
    "first version of `cpu_heap` that trimmed the heap after *every* optimizer step (run on the working tree "
    "before it was committed; the edits are listed under *Machine*). The strategy now trims every 5 steps (next "
    "two runs). Command: `python benchmarks/train_speed.py --configs ddp anchor fs sgo --rounds 2 --steps 20 "
    "--output benchmarks/results/train_speed_trim.json`."
)
EVERY_STEP_NOTE = (
    "What trimming after every step cost: `fs` (trim after every optimizer step, as in the trim run) against "
    "`fs_notrim`, 22 steps, on the same uncommitted tree as the trim run. Command: `python benchmarks/train_speed.py "
    "--configs ddp fs fs_notrim --rounds 2 --steps 20` (its output moved to "
    "`benchmarks/results/train_speed_trim_every_step.json`)."
)
NOTRIM_NOTE = (
    "The strategy as committed: the heap trimmed every 5 optimizer steps. `fs` against `fs_notrim` (the trim "
    "replaced by a no-op), 22 steps. Command: `python benchmarks/train_speed.py --configs ddp fs fs_notrim --rounds "
    "2 --steps 20 --output benchmarks/results/train_speed_notrim.json`."
)
LONG_NOTE = (
    "The targets' configurations only, with 20 timed steps per launch and 3 rounds, after the main run, for tighter "
    "medians. Command: `python benchmarks/train_speed.py --configs ddp anchor fs fs_fsdpcomms --rounds 3 --steps 20 "
    "--output benchmarks/results/train_speed_long.json`."
)
GLOO_FIRST_NOTE = (
    "The first run with `gloo_comms` (commit 9c30d1d), when `GlooReduceScatter` still pooled its outputs (the "
    "gradients) as well: they filled its pool, so its inputs were allocated afresh for most units. Same command as "
    "the main run."
)
CHECK_NOTE = (
    "A run of `gloo_comms` as in the first gloo run (commit 9c30d1d) with 3 rounds, for the spread of the speed "
    "ratios, and explicit forward "
    "prefetch (then applied from outside; now `ShardedStrategy(forward_prefetch=True)`). It ran from an exported "
    "copy of commit 9c30d1d so that edits to the working tree could not change it. Command: `python "
    "benchmarks/train_speed.py --configs ddp anchor fs fs_prefetch sgo --rounds 3 --output "
    "benchmarks/results/train_speed_check.json`."
)
NOCOMM_NOTE = (
    "Where FULL_SHARD's time goes: `fs_nocomm` is `fs` with the all-gathers skipped and the reduce-scatters "
    "replaced by a local copy (wrong numbers, same work otherwise), so the difference to `fs` is the "
    "communication. Command: `python benchmarks/train_speed.py --configs ddp fs fs_nocomm --rounds 2 --output "
    "benchmarks/results/train_speed_nocomm.json`."
)
BEFORE_GLOO_NOTE = (
    "The previous main run, before `gloo_comms` (FSDP2's default collectives, fresh comm buffers every step), on a "
    "quieter machine (load under 2.1). Command: `python benchmarks/train_speed.py --configs ddp anchor fs fs_ac sgo "
    "sgo_ac ns ns_ac --rounds 2`."
)
RUN1_NOTE = (
    "Run with the committed strategy of that time (rank 1 of `ShardedStrategy` and of the anchor ran 2 torch threads, "
    "rank 0 one) while other test suites kept the 2-core machine at load 4-8: absolute times are about twice those "
    "of the later runs and the per-round spread is large. Command: `python benchmarks/train_speed.py` (all defaults)."
)
FOCUS_NOTE = (
    "The speed ideas against `fs`, `ddp` and `anchor` at lower load. The launcher change (every rank 1 thread) "
    "appeared in the working tree between round 0 and round 1 (from `fs` in round 1 on, see *torch threads*), so "
    "round 0 compares `fs` (1/2 threads) with `fs_threads` (1/1) and round 1 does not. Command: "
    "`python benchmarks/train_speed.py --configs ddp anchor fs fs_threads fs_last fs_prefetch fs_all sgo "
    "--rounds 2 --output benchmarks/results/train_speed_focus.json`."
)

MALLOC_NOTE = (
    "`fs`/`ddp` with and without `MALLOC_MMAP_THRESHOLD_=131072` in the launch environment, alternating, after "
    "the run before gloo_comms, on the same tree. Command: `python benchmarks/train_speed.py --configs ddp fs "
    "ddp_mmap fs_mmap --rounds 2 --warmup 1 --steps 4 --output benchmarks/results/train_speed_malloc.json`."
)


# ---------------------------------------------------------------------------------------------------- the rest


def meta_section(data: dict[str, Any]) -> list[str]:
    m = data["median"]
    run = data["runs"][0]
    return [
        "## Building and wrapping the 13B model on the meta device",
        "",
        f'`{data["config"]}` model arguments ({run["num_params"]:,} parameters), built under `torch.device("meta")`, '
        f"then `fully_shard` per Block + root over a world of {data['world_size']} on a fake process group "
        f'(`FakeStore` + `init_process_group("fake")`), nothing materialised; {run["fsdp_units"]} FSDP units. '
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
        "sharded": (
            "sharded (DCP directory, every rank writes) - `trainer.save_checkpoint` / `strategy.load_checkpoint`"
        ),
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
        f'The training GPT ({rows[0]["num_params"]:,} parameters), `ShardedStrategy("FULL_SHARD")`, one step of '
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


def collectives_section(data: dict[str, Any]) -> list[str]:
    rows = data["rows"]
    seconds = {(r["size"], r["case"]): r["seconds"] for r in rows}

    def versus(row: dict[str, Any]) -> str:
        # Each replacement against the default it replaces, listed just before it.
        kind = row["case"].split(": ", 1)[0]
        first = next(r for r in rows if r["size"] == row["size"] and r["case"].startswith(kind))
        return "-" if first is row else f"{seconds[(row['size'], first['case'])] / row['seconds']:.2f}x"

    return [
        "## CPU collectives and buffers (what `gloo_comms` and `shm_comms` are built on)",
        "",
        "`python benchmarks/gloo_collectives.py`: 2 processes, 1 torch thread each; per case the median of "
        f"{data['repeats']} calls, the slower rank's time. One block = one GPT block of the training benchmark; "
        "whole model = all its parameters. Speed-up = the first row of the same kind / this row.",
        "",
        f"Machine: {_machine_line(data)}.",
        "",
        "| size | case | ms | speed-up |",
        "|---|---|---|---|",
        *(f"| {r['size']} ({r['numel']:,}) | {r['case']} | {r['seconds'] * 1e3:.2f} | {versus(r)} |" for r in rows),
        "",
    ]


def gpu_section(data: dict[str, Any]) -> list[str]:
    """The one-GPU throughput run of ``gpu_throughput.py``: tokens/s and MFU."""
    settings, model, machine = data["settings"], data["model"], data["machine"]

    def gib(key: str) -> str:
        return "-" if data[key] is None else f"{data[key] / 2**30:.1f}"

    return [
        "## One GPU: tokens/s and MFU",
        "",
        f"GPT n_layer {model['n_layer']}, n_embd {model['n_embd']}, n_head {model['n_head']}: "
        f"{data['num_params']:,} parameters, {settings['precision']}, {settings['sharding_strategy']}, activation "
        f"checkpointing {'on' if settings['activation_checkpointing'] else 'off'}; micro-batch "
        f"{settings['batch_size']} x {model['block_size']} random tokens; {settings['warmup']} warm-up + "
        f"{settings['steps']} timed steps, the device synchronised at both ends of each step. Model FLOPs per token "
        "= 6 x parameters (without the position table) + 12 x layers x width x context (PaLM, appendix B); "
        f"MFU against {data['peak_flops'] / 1e12:.1f} TFLOP/s.",
        "",
        f"Device: {data['device']}; torch {machine['torch']}, lightning {machine['lightning']}, commit "
        f"{machine['git_commit']}, {machine['time']}.",
        "",
        "| median s/step | tokens/s | model TFLOPs per step | MFU | max allocated, GiB | max reserved, GiB |",
        "|---|---|---|---|---|---|",
        f"| {data['median_step_seconds']:.3f} | {data['tokens_per_s']:,.0f} "
        f"| {data['flops_per_token'] * data['tokens_per_s'] * data['median_step_seconds'] / 1e12:.1f} "
        f"| {data['mfu']:.1%} | {gib('max_memory_allocated_bytes')} | {gib('max_memory_reserved_bytes')} |",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    args = parser.parse_args()
    results = Path(args.results)
    train, meta = _load(results, "train_speed"), _load(results, "meta_build")
    shm_first, gloo_main = _load(results, "train_speed_shm"), _load(results, "train_speed_gloo")
    long_shm, ddp_check = _load(results, "train_speed_long_shm"), _load(results, "train_speed_ddp_shm")
    futex, futex2 = _load(results, "train_speed_futex"), _load(results, "train_speed_futex2")
    rounds8, all4 = _load(results, "train_speed_rounds8"), _load(results, "train_speed_all4")
    confirm = _load(results, "train_speed_confirm")
    before_gloo = _load(results, "train_speed_before_gloo")
    check = _load(results, "train_speed_check")
    long_run, gloo_first = _load(results, "train_speed_long"), _load(results, "train_speed_gloo_first")
    trim, notrim = _load(results, "train_speed_trim"), _load(results, "train_speed_notrim")
    every_step = _load(results, "train_speed_trim_every_step")
    nocomm = _load(results, "train_speed_nocomm")
    focus = _load(results, "train_speed_focus")
    run1 = _load(results, "train_speed_run1")
    malloc = _load(results, "train_speed_malloc")
    ckpt, scaling = _load(results, "checkpoint_io"), _load(results, "model_state_scaling")
    collectives = _load(results, "gloo_collectives")
    gpu = _load(results, "gpu_throughput")

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
        *(
            d["command"].strip()
            for d in (
                rounds8,
                all4,
                confirm,
                futex,
                train,
                long_shm,
                shm_first,
                ddp_check,
                notrim,
                trim,
                nocomm,
                collectives,
                scaling,
                meta,
                ckpt,
                gpu,
            )
            if d
        ),
        "python benchmarks/make_report.py",
        "```",
        "",
    ]
    runs: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    body: list[str] = []
    sections = (
        (rounds8, "8-round run", "8-round run: FULL_SHARD and SHARD_GRAD_OP against DDP", ROUNDS8_NOTE),
        (all4, "targets run", "Targets run: DDP, the anchor, FULL_SHARD and SHARD_GRAD_OP, 4 rounds", ALL4_NOTE),
        (confirm, "confirmation run", "Confirmation run: FULL_SHARD and SHARD_GRAD_OP against DDP", CONFIRM_NOTE),
        (futex, "futex run", "Futex run: the shared-memory collectives' own barrier, 4 rounds", FUTEX_NOTE),
        (futex2, "futex run 2", "Futex run 2: with the anchor, 3 rounds", FUTEX2_NOTE),
        (train, "main run", "Main run: every configuration, shared-memory collectives", MAIN_NOTE),
        (long_shm, "long shm run", "Long run: shared-memory collectives, 3 rounds of 20 steps", LONG_SHM_NOTE),
        (shm_first, "first shm run", "First run with shm_comms", SHM_FIRST_NOTE),
        (ddp_check, "DDP check", "DDP check: FULL_SHARD and SHARD_GRAD_OP against DDP, 4 rounds", DDP_CHECK_NOTE),
        (notrim, "trim check", "Trim check: the committed strategy (trim every 5 steps) against no trim", NOTRIM_NOTE),
        (trim, "trim run", "Trim run: the targets' configurations over 22 steps, trim after every step", TRIM_NOTE),
        (every_step, "every-step trim", "Every-step trim against no trim", EVERY_STEP_NOTE),
        (
            gloo_main,
            "gloo main run",
            "Main run with gloo_comms: every configuration, before the heap trim",
            GLOO_MAIN_NOTE,
        ),
        (long_run, "long run", "Long run: before the heap trim, 3 rounds of 20 steps", LONG_NOTE),
        (gloo_first, "first gloo run", "First run with gloo_comms", GLOO_FIRST_NOTE),
        (check, "check run", "Check run: gloo_comms, 3 rounds", CHECK_NOTE),
        (nocomm, "diagnostic run", "Diagnostic run: FULL_SHARD without communication", NOCOMM_NOTE),
        (before_gloo, "before gloo_comms", "Previous main run: before the gloo collectives", BEFORE_GLOO_NOTE),
        (run1, "run 1", "Earlier run 1: heavily loaded machine, before the launcher change", RUN1_NOTE),
        (focus, "run 2", "Earlier run 2 (focused): the launcher change landed during it", FOCUS_NOTE),
        (malloc, "run 3", "Run 3: glibc mmap threshold (peak RSS)", MALLOC_NOTE),
    )
    for data, label, title, note in sections:
        if data:
            part, s = train_section(data, title)
            body += part[:2] + [note, ""] + part[2:]
            runs.append((label, s, data))
    if runs:
        lines += targets_section([(label, s) for label, s, _ in runs]) + body + changes_section(runs)
    if collectives:
        lines += collectives_section(collectives)
    if scaling:
        lines += scaling_section(scaling)
    if meta:
        lines += meta_section(meta)
    if ckpt:
        lines += checkpoint_section(ckpt)
    if gpu:
        lines += gpu_section(gpu)
    notes = HERE / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    Path(args.output).write_text("\n".join(lines))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
