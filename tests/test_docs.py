"""The docs say what the code does: their examples run, and every name and path they mention exists.

- Every ```python block of README.md and docs/*.md runs: one subprocess for all pages (the imports are paid once),
  each page in a namespace of its own, in an empty working directory of its own, its blocks in order (a block may
  use what an earlier one of its page defined), on the CPU in one process. A block whose fence says
  ```python skip-run (it needs several processes, a GPU, or a model and data a user has) is compiled, not run.
  Every page has at least one block that runs.
- ```yaml blocks parse, and every ``class_path`` in them imports.
- Every ``lightning_shard/...`` path and ``lightning_shard.x.y`` dotted name exists (also ``examples.x.y``), and so
  does every path under ``examples/``, ``configs/``, ``benchmarks/``, ``scripts/``, ``tests/`` and ``docs/`` the pages
  name: when a module moves, this test names the page that still points at its old place.
- Relative links point at files that exist, and their ``#anchors`` at headings of those files.

Run it alone: ``PYTHONPATH=$PWD python -m pytest -q tests/test_docs.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP_RUN = "skip-run"
FENCE = re.compile(r"^( *)```(\w+)?([^\n]*)\n(.*?)^\1```\s*$", re.M | re.S)


@dataclass
class Block:
    page: Path
    line: int
    language: str
    options: set[str]
    code: str


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, m.start()) + 1, m[2] or "", set(m[3].split()), textwrap.dedent(m[4]))
        for m in FENCE.finditer(text)
    ]


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


# ---- the examples run -------------------------------------------------------------------------------------------


def _run_pages(pages: list[str], out: Path) -> None:
    """In the subprocess: run each page's python blocks, write {page: {"error": str | None, "seconds": float}}."""
    import torch.distributed as dist

    results: dict[str, dict] = {}
    root = Path(tempfile.mkdtemp(prefix="docs_"))
    for name in pages:
        page = REPO / name
        cwd = root / name.replace("/", "_")
        cwd.mkdir()
        os.chdir(cwd)
        namespace: dict = {"__name__": "__docs__"}
        start, error = time.perf_counter(), None
        for block in blocks(page):
            if block.language != "python" or SKIP_RUN in block.options:
                continue
            try:
                exec(compile(block.code, f"{name}:{block.line}", "exec"), namespace)
            except BaseException:  # noqa: BLE001 - SystemExit too: reported, the next page still runs
                error = traceback.format_exc()
                break
        # A Fabric run has no teardown of its own (docs/fabric.md): end it, so that the next page starts clean.
        for value in namespace.values():
            strategy = getattr(value, "strategy", None)
            if type(value).__name__ == "Fabric" and hasattr(strategy, "teardown"):
                strategy.teardown()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        results[name] = {"error": error, "seconds": round(time.perf_counter() - start, 2)}
        out.write_text(json.dumps(results))


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("docs") / "results.json"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
    )
    pages = [page_id(p) for p in PAGES]
    run = subprocess.run(
        [sys.executable, __file__, str(out), *pages], env=env, capture_output=True, text=True, timeout=900
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_page_examples_run(page: Path, page_runs: dict[str, dict]) -> None:
    result = page_runs.get(page_id(page))
    assert result is not None, "the runner stopped before this page"
    assert result["error"] is None, result["error"]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_page_has_an_example_that_runs(page: Path) -> None:
    python = [b for b in blocks(page) if b.language == "python"]
    assert any(SKIP_RUN not in b.options for b in python), f"{page_id(page)}: no ```python block that runs"
    for block in python:  # the ones marked skip-run at least compile
        compile(block.code, f"{page_id(page)}:{block.line}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_yaml_blocks_parse_and_their_classes_import(page: Path) -> None:
    yaml = pytest.importorskip("yaml")
    for block in blocks(page):
        if block.language != "yaml":
            continue

        def class_paths(node):
            if isinstance(node, dict):
                for key, value in node.items():
                    if key == "class_path":
                        yield value
                    yield from class_paths(value)
            elif isinstance(node, list):
                for value in node:
                    yield from class_paths(value)

        for class_path in class_paths(yaml.safe_load(block.code)):
            assert resolve(class_path), f"{page_id(page)}:{block.line}: {class_path} does not import"


# ---- names, paths and links exist -------------------------------------------------------------------------------

DOTTED = re.compile(r"(?<![\w./])((?:lightning_shard|examples)(?:\.[A-Za-z_]\w*)+)")
PACKAGE_PATH = re.compile(r"(?<![\w./])(lightning_shard(?:/[\w.-]+)*/?)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:examples|configs|benchmarks|scripts|tests|docs)/[\w./-]*[\w/])(?![\w{])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Paths the pages name that a run writes, not the repository.
WRITTEN_BY_A_RUN = {"benchmarks/results/gpu_check.json"}


def resolve(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module, or an attribute reached from the longest importable module prefix."""
    importlib.import_module("lightning_shard")  # makes lightning_shard.standalone
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_modules_and_paths_exist(page: Path) -> None:
    text = page.read_text()
    missing = sorted({name for name in DOTTED.findall(text) if not resolve(name.rstrip("."))})
    missing += sorted({p for p in PACKAGE_PATH.findall(text) if not (REPO / p.rstrip(".")).exists()})
    missing += sorted(
        {p for p in REPO_PATH.findall(text) if p not in WRITTEN_BY_A_RUN and not (REPO / p.rstrip(".")).exists()}
    )
    assert not missing, f"{page_id(page)} names what does not exist (moved or renamed?): {missing}"


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"\w+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path) if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{page_id(page)}: broken links {broken}"


def test_architecture_names_every_layer_folder() -> None:
    """A folder added to the layers (tests/test_layout.py) gets its line in docs/architecture.md."""
    spec = importlib.util.spec_from_file_location("test_layout", REPO / "tests" / "test_layout.py")
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    text = (REPO / "docs" / "architecture.md").read_text()
    folders = {name for layer in layout.LAYERS for name in layer} - {"__init__"}
    shown = {name for name in folders if f"`{name}/`" in text or f"`{name}.py`" in text}
    assert shown == folders, f"docs/architecture.md does not show {sorted(folders - shown)}"


if __name__ == "__main__":
    _run_pages(sys.argv[2:], Path(sys.argv[1]))
