"""Where each benchmark's figures live: one JSON file per concern in ``benchmarks/results/``, one section per script.

Takes a script's name and its result (a dict holding ``command``, ``machine`` and, where the script lays out a table,
``report``); gives the concern file it belongs in (:func:`result_path`), writes it as that file's section without
touching the other scripts' sections (:func:`write_result`), and reads every section back in reading order
(:func:`read_results`), which is what ``make_report.py`` lays out. A file holds
``{"concern": title, "sections": {script: result}}``.

    >>> result_path("fabric_speed").name
    'training_speed.json'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO, RESULTS, machine, write_json  # noqa: E402

# concern (file stem) -> (title, its scripts in reading order); the concerns in reading order.
CONCERNS: dict[str, tuple[str, list[str]]] = {
    "training_speed": ("Training speed", ["train_speed", "fabric_speed"]),
    "memory": ("Memory", ["model_state_scaling", "lora_memory", "activation_checkpointing"]),
    "tensor_parallel": ("Tensor parallelism", ["tensor_parallel"]),
    "checkpoints": (
        "Checkpoints and pretrained weights",
        ["checkpoint_io", "checkpoint_checksums", "hf_loading", "pretrained_hash"],
    ),
    "startup": (
        "Start-up: building, initialising, the first step",
        ["startup", "meta_build", "init_rule", "optimizer_step"],
    ),
    "preemption": ("Preemption", ["preemption"]),
    "averaging": ("Weight averaging", ["weight_averaging"]),
    "gpu": ("GPU check", ["gpu_check", "gpu_check_cpu_smoke"]),
}


def concern_of(script: str) -> str:
    """The concern (file stem) whose file holds ``script``'s section."""
    for concern, (_, scripts) in CONCERNS.items():
        if script in scripts:
            return concern
    raise KeyError(f"{script!r} belongs to no concern in benchmarks/results_files.py's CONCERNS")


def result_path(script: str, results: Path = RESULTS) -> Path:
    """The file ``script`` writes its section into (the default of its ``--output``)."""
    return results / f"{concern_of(script)}.json"


def command_line() -> str:
    """How this script was run, as a person types it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return " ".join(["python", shown.as_posix(), *sys.argv[1:]])


def write_result(path: str | Path, script: str, result: dict[str, Any]) -> None:
    """Write ``result`` as ``script``'s section of the concern file ``path``, the other sections kept, with this run's
    ``command`` and ``machine`` unless ``result`` gives its own (a normalised command, the machine at the start)."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    sections = data.get("sections", {})
    sections[script] = {"command": command_line(), **result}
    sections[script].setdefault("machine", machine())
    title, order = CONCERNS[concern_of(script)]
    ordered = {name: sections[name] for name in order if name in sections}
    write_json(path, {"concern": title, "sections": {**ordered, **sections}})
    print(f"wrote {script}'s section of {path}")


def read_results(results: Path = RESULTS) -> dict[str, dict[str, dict[str, Any]]]:
    """Every concern file's sections, by concern and script, in reading order (absent concerns left out)."""
    loaded = {}
    for concern in CONCERNS:
        path = results / f"{concern}.json"
        if path.exists():
            loaded[concern] = json.loads(path.read_text())["sections"]
    return loaded
