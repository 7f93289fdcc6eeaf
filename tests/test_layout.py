"""The package's layout shows its architecture, and stays that way.

- The public imports users write keep working wherever the modules behind them live.
- Folders are layers: a module imports only from its own folder or from a lower layer, so no import cycle can form
  between folders, and the Trainer and Fabric adapters never import each other (both sit on ``core``).
- No module-level import cycle inside a folder either.
- No file over 400 lines in ``lightning_shard/`` or ``benchmarks/``: one job per module.
"""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_shard"
MAX_LINES = 400

# Lowest first. A folder (or top-level module) may import its own folder and any folder of an earlier layer; folders
# in one layer do not import each other.
LAYERS: list[set[str]] = [
    {"torch_compat", "devices"},
    {"standalone_packages", "cpu", "tensor_parallel"},
    {"checkpoint"},
    {"init"},
    {"hf"},
    {"plan"},
    {"memory"},
    {"averaging"},
    {"core"},
    {"trainer", "fabric", "cli"},
    {"__init__"},
]

PUBLIC_IMPORTS = [
    ("lightning_shard", "ShardedStrategy"),
    ("lightning_shard", "ShardedCheckpointIO"),
    ("lightning_shard", "ShardingConfig"),
    ("lightning_shard", "ShardedPrecision"),
    ("lightning_shard", "ShardedMemoryMonitor"),
    ("lightning_shard", "PreemptionCheckpoint"),
    ("lightning_shard", "PREEMPTED_EXIT_CODE"),
    ("lightning_shard", "ShardedAveragedModel"),
    ("lightning_shard", "CheckpointIntegrityError"),
    ("lightning_shard", "is_sharded_checkpoint"),
    ("lightning_shard", "estimate_memory"),
    ("lightning_shard", "format_estimate_table"),
    ("lightning_shard", "MemoryEstimate"),
    ("lightning_shard", "MemoryBreakdown"),
    ("lightning_shard.fabric", "ShardedStrategy"),
    ("lightning_shard.fabric", "ShardedPrecision"),
    ("lightning_shard.fabric", "ShardedAveragedModel"),
    ("lightning_shard.hf", "from_pretrained"),
    ("lightning_shard.hf", "export_hf"),
    ("lightning_shard.cli", "main"),
    ("lightning_shard.standalone", "ShardedStrategy"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_level_imports() -> dict[str, set[str]]:
    """Each package module -> the package modules it imports when it is imported (imports inside functions are not
    followed: they run later, and are how a lower layer may call a higher one's registry)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            statements = node.body if isinstance(node, ast.If) else [node]  # `if TYPE_CHECKING:` imports count too
            for statement in statements:
                if isinstance(statement, ast.ImportFrom) and (statement.module or "").startswith("lightning_shard"):
                    for alias in statement.names:
                        target = f"{statement.module}.{alias.name}"
                        edges[name].add(target if target in modules else statement.module)
                elif isinstance(statement, ast.Import):
                    edges[name].update(a.name for a in statement.names if a.name in modules)
    return edges


def test_public_imports_keep_working() -> None:
    missing = [f"{m}.{n}" for m, n in PUBLIC_IMPORTS if not hasattr(importlib.import_module(m), n)]
    assert not missing


def test_folders_import_only_lower_layers() -> None:
    layer = {folder: depth for depth, folders in enumerate(LAYERS) for folder in folders}
    folders = {folder_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert folders <= set(layer), f"place the new folders {sorted(folders - set(layer))} in LAYERS"
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in module_level_imports().items()
        for target in targets
        if target != "lightning_shard"
        and folder_of(source) != folder_of(target)
        and layer[folder_of(source)] <= layer[folder_of(target)]
    )
    assert not upward, f"imports that climb a layer or cross into a sibling folder: {upward}"


def test_no_import_cycle() -> None:
    edges = module_level_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if target == "lightning_shard":
                continue
            if state.get(target) == 1:
                return [*path[path.index(target) :], target] if target in path else [module, target]
            if target not in state and (cycle := visit(target, [*path, target])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            assert (cycle := visit(module, [module])) is None, " -> ".join(cycle)


@pytest.mark.parametrize("folder", ["lightning_shard", "benchmarks"])
def test_no_file_over_400_lines(folder: str) -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in sorted((REPO / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split by responsibility (one job per module): {long}"
