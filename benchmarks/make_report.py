"""Write BENCHMARKS.md from the current results: one part per concern, one table per question, each with its command,
commit and machine.

    python benchmarks/make_report.py          # reads benchmarks/results/<concern>.json, writes BENCHMARKS.md

Every benchmark script writes its section of its concern's file (``benchmarks/results_files.py``): ``command``,
``machine`` (``benchmarks.common.machine()``) and ``report``: ``{"title", "question", "columns", "rows", "notes"}``,
and where a table was assembled by hand from the script's figures, ``provenance`` (said instead of the command line)
and ``tables`` (more tables: ``{"lead", "columns", "rows"}``). This script only lays those out; what a figure means
is decided where it is measured. A result that is expected but missing (the GPU check on a machine without a GPU) is
said to be missing; a section without a ``report`` holds figures only and is not laid out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO, RESULTS  # noqa: E402
from benchmarks.results_files import CONCERNS, read_results, result_path  # noqa: E402

# Results that must be in the report, and why one may be missing where the reason is known.
EXPECTED = [script for _, scripts in CONCERNS.values() for script in scripts if script != "gpu_check_cpu_smoke"]
MISSING_BECAUSE = {"gpu_check": "It needs a GPU, and none has been lent to this project yet."}
HEADER = """# Benchmarks

Current figures only: each table names the command that produced it, the commit it ran on and the machine.
Earlier figures live in git history; what was tried and why it was kept or dropped is in `benchmarks/NOTES.md`.
Regenerate this file with `python benchmarks/make_report.py` after running the scripts; the figures are in
`benchmarks/results/`, one file per concern, one section per script.
"""


def table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table's lines.

    Example:
        >>> table(["a", "b"], [[1, 2]])
        ['| a | b |', '|---|---|', '| 1 | 2 |']
    """
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(str(cell) for cell in row) + " |" for row in rows
    ]


def provenance(result: dict[str, Any]) -> str:
    """The line saying which command, commit and machine produced a table."""
    if "provenance" in result["report"]:
        return result["report"]["provenance"]
    machine = result.get("machine", {})
    dirty = " (with uncommitted changes)" if machine.get("git_dirty") else ""
    return (
        f"Command: `{result['command'].strip()}`; commit `{machine.get('git_commit', '?')}`{dirty}; machine: "
        f"{machine.get('cpu_count', '?')} x {machine.get('cpu_model', '?')}, {machine.get('memory_gib', '?')} GiB, "
        f"torch {machine.get('torch', '?')}, lightning {machine.get('lightning', '?')}; {machine.get('time', '?')}."
    )


def render_section(name: str, result: dict[str, Any] | None) -> str:
    """One ``###`` section: the question, provenance, the tables and notes (or a line saying it is missing).

    Example:
        >>> print(render_section("gpu_check", None).splitlines()[0])
        ### gpu_check: not measured
    """
    if result is None:
        because = f"{MISSING_BECAUSE[name]} " if name in MISSING_BECAUSE else ""
        where = result_path(name).relative_to(REPO)
        run = f"Run `python benchmarks/{name}.py` to produce its section of `{where}`."
        return f"### {name}: not measured\n\n{because}{run}\n"
    report = result["report"]
    lines = [f"### {report['title']}", "", report["question"], "", provenance(result), ""]
    lines += table(report["columns"], report["rows"])
    if report.get("notes"):
        lines += [""] + [f"- {note}" for note in report["notes"]]
    for more in report.get("tables", []):
        lines += ["", more["lead"], ""] + table(more["columns"], more["rows"])
    return "\n".join(lines) + "\n"


def render(results: dict[str, dict[str, dict[str, Any]]]) -> tuple[str, int, int]:
    """The whole report, the number of sections laid out and of expected ones missing."""
    parts, shown, missing = [HEADER], 0, 0
    for concern, (title, scripts) in CONCERNS.items():
        sections = results.get(concern, {})
        names = [s for s in scripts if s in EXPECTED or "report" in sections.get(s, {})]
        names += sorted(set(sections) - set(scripts))
        rendered = []
        for name in names:
            result = sections.get(name)
            if result is not None and "report" not in result:
                continue  # figures only
            rendered.append(render_section(name, result))
            shown, missing = shown + (result is not None), missing + (result is None)
        if rendered:
            parts += [f"## {title}\n", *rendered]
    return "\n".join(parts), shown, missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    args = parser.parse_args()
    text, shown, missing = render(read_results(args.results))
    args.output.write_text(text)
    print(f"wrote {args.output}: {shown} results, {missing} missing")


if __name__ == "__main__":
    main()
