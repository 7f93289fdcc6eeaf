"""Write BENCHMARKS.md from the current results: one table per question, each with its command, commit and machine.

    python benchmarks/make_report.py          # reads benchmarks/results/*.json, writes BENCHMARKS.md

Every benchmark script writes ``benchmarks/results/<name>.json`` holding ``command``, ``machine``
(``benchmarks.common.machine()``) and ``report``: ``{"title", "question", "columns", "rows", "notes"}``. This
script only lays those out; what a figure means is decided where it is measured. A result that is expected but
missing (the GPU check on a machine without a GPU) is said to be missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO, RESULTS

# The questions in reading order, and what to say when a result is absent.
EXPECTED = {
    "train_speed": "python benchmarks/train_speed.py",
    "fabric_speed": "python benchmarks/fabric_speed.py",
    "model_state_scaling": "python benchmarks/model_state_scaling.py",
    "lora_memory": "python benchmarks/lora_memory.py",
    "tensor_parallel": "python benchmarks/tensor_parallel.py",
    "activation_checkpointing": "python benchmarks/activation_checkpointing.py",
    "checkpoint_io": "python benchmarks/checkpoint_io.py",
    "checkpoint_checksums": "python benchmarks/checkpoint_checksums.py",
    "meta_build": "python benchmarks/meta_build.py",
    "init_rule": "python benchmarks/init_rule.py",
    "hf_loading": "python benchmarks/hf_loading.py",
    "pretrained_hash": "python benchmarks/pretrained_hash.py",
    "preemption": "python benchmarks/preemption.py",
    "weight_averaging": "python benchmarks/weight_averaging.py",
    "gpu_check": "python benchmarks/gpu_check.py",
}
# Why an expected result may be missing, where the reason is known.
MISSING_BECAUSE = {"gpu_check": "It needs a GPU, and none has been lent to this project yet."}
HEADER = """# Benchmarks

Current figures only: each table names the command that produced it, the commit it ran on and the machine.
Earlier figures live in git history; what was tried and why it was kept or dropped is in `benchmarks/NOTES.md`.
Regenerate this file with `python benchmarks/make_report.py` after running the scripts.
"""


def render_section(name: str, result: dict[str, Any] | None) -> str:
    """One ``##`` section: the question, provenance, the table and its notes (or a line saying it is missing).

    Example:
        >>> print(render_section("x", None).splitlines()[0])
        ## x: not measured
    """
    if result is None:
        because = f"{MISSING_BECAUSE[name]} " if name in MISSING_BECAUSE else ""
        command = EXPECTED.get(name, name)
        return f"## {name}: not measured\n\n{because}Run `{command}` to produce `benchmarks/results/{name}.json`.\n"
    report, machine = result["report"], result.get("machine", {})
    lines = [f"## {report['title']}", "", report["question"], ""]
    dirty = " (with uncommitted changes)" if machine.get("git_dirty") else ""
    lines.append(
        f"Command: `{result['command'].strip()}`; commit `{machine.get('git_commit', '?')}`{dirty}; machine: "
        f"{machine.get('cpu_count', '?')} x {machine.get('cpu_model', '?')}, {machine.get('memory_gib', '?')} GiB, "
        f"torch {machine.get('torch', '?')}, lightning {machine.get('lightning', '?')}; {machine.get('time', '?')}."
    )
    lines += ["", "| " + " | ".join(report["columns"]) + " |", "|" + "---|" * len(report["columns"])]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in report["rows"]]
    if report.get("notes"):
        lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def load_results(results: Path) -> dict[str, dict[str, Any]]:
    """Every ``results/*.json`` that carries a ``report``, by file stem."""
    loaded = {}
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if "report" in data:
            loaded[path.stem] = data
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    args = parser.parse_args()
    results = load_results(args.results)
    names = list(EXPECTED) + sorted(set(results) - set(EXPECTED))
    sections = [render_section(name, results.get(name)) for name in names]
    args.output.write_text("\n".join([HEADER, *sections]))
    print(f"wrote {args.output}: {len(results)} results, {sum(n not in results for n in names)} missing")


if __name__ == "__main__":
    main()
