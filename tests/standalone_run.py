"""Run a test script under the standalone packages, as Lightning tests ``pytorch_lightning``: the same source with
its imports renamed - ``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric``,
``import lightning as L`` -> the two standalone packages, ``lightning_shard`` -> ``lightning_shard.standalone`` - and
the test helpers it imports (``toy``, ...) renamed the same way.

    STANDALONE_SCRIPT=tests/parity_run.py python tests/standalone_run.py --devices 2 --out OUT full

The script comes in the environment, so that Lightning's launcher, which re-runs this command line for the other
ranks, runs the same.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path
from types import ModuleType

import lightning_fabric
import pytorch_lightning

import lightning_shard  # noqa: F401  (loads lightning_shard.standalone: pytorch_lightning is imported)
from lightning_shard.standalone_packages.rewrite import STANDALONE, standalone_name

TESTS = Path(__file__).resolve().parent
_LIGHTNING = "_standalone_lightning"


class _StandaloneLightning(ModuleType):
    """What ``import lightning as L`` gives under the standalone packages: ``L.Trainer`` from ``pytorch_lightning``,
    ``L.Fabric`` from ``lightning_fabric``."""

    def __getattr__(self, name: str) -> object:
        for package in (pytorch_lightning, lightning_fabric):
            if hasattr(package, name):
                return getattr(package, name)
        raise AttributeError(name)


class _Renamer(ast.NodeTransformer):
    def visit_Import(self, node: ast.Import) -> ast.Import:
        for alias in node.names:
            if alias.name == "lightning":
                alias.name, alias.asname = _LIGHTNING, alias.asname or "lightning"
            elif alias.name == "lightning_shard":
                alias.name, alias.asname = STANDALONE, alias.asname or "lightning_shard"
            elif standalone_name(alias.name) is not None:
                assert alias.asname, f"line {node.lineno}: `import {alias.name}` needs `as name` here"
                alias.name = standalone_name(alias.name)
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
        if node.module == "lightning":
            node.module = _LIGHTNING
        elif node.module is not None and standalone_name(node.module) is not None:
            node.module = standalone_name(node.module)
        return node


def _compiled(path: Path):  # noqa: ANN202
    tree = _Renamer().visit(ast.parse(path.read_text(), str(path)))
    return compile(ast.fix_missing_locations(tree), str(path), "exec", dont_inherit=True)


class _RenamedTestHelpers(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The test helpers (top-level modules in tests/) with their imports renamed."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        file = TESTS / f"{fullname}.py"
        if "." in fullname or not file.exists():
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=str(file))
        spec.has_location = True
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        exec(_compiled(Path(module.__file__)), module.__dict__)


def main() -> None:
    sys.modules[_LIGHTNING] = _StandaloneLightning(_LIGHTNING)
    sys.meta_path.insert(0, _RenamedTestHelpers())
    script = Path(os.environ["STANDALONE_SCRIPT"]).resolve()
    namespace = {"__name__": "__main__", "__file__": str(script), "__builtins__": __builtins__}
    exec(_compiled(script), namespace)


if __name__ == "__main__":
    main()
