"""The source of a module's framework part, with its imports pointed at the standalone packages.

Lightning builds ``pytorch_lightning`` and ``lightning_fabric`` from the ``lightning`` sources by renaming imports;
this applies the same renaming to the statements :mod:`.dependencies` found to use the framework, and points the
package's own imports at the standalone namespace (whose modules hold the same objects for everything else). What the
renaming cannot express is refused with the spelling to use instead, when the module is loaded.

Example:
    >>> import ast
    >>> tree = ast.parse("from lightning.pytorch.callbacks import Callback")
    >>> ast.unparse(rewrite_imports(tree, "lightning_shard.example"))
    'from pytorch_lightning.callbacks import Callback'
"""

from __future__ import annotations

import ast

from lightning_shard.standalone_packages.dependencies import PACKAGE

STANDALONE = f"{PACKAGE}.standalone"
# Lightning's own mapping from the unified package to the standalone ones.
RENAMES = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric", PACKAGE: STANDALONE}


def standalone_name(module_name: str) -> str | None:
    """``module_name`` under the standalone packages, or None where it has no counterpart.

    Example:
        >>> standalone_name("lightning.pytorch.callbacks")
        'pytorch_lightning.callbacks'
    """
    for unified, standalone in RENAMES.items():
        if module_name == unified or module_name.startswith(unified + "."):
            return standalone + module_name[len(unified) :]
    return None


class _Renamer(ast.NodeTransformer):
    def __init__(self, module_name: str, names_lightning_attributes: bool) -> None:
        self.module_name = module_name
        self.names_lightning_attributes = names_lightning_attributes

    def _refuse(self, node: ast.stmt, why: str) -> ImportError:
        return ImportError(f"{self.module_name}, line {node.lineno}: `{ast.unparse(node)}` {why}")

    def visit_Import(self, node: ast.Import) -> ast.Import:
        names = []
        for alias in node.names:
            renamed = standalone_name(alias.name)
            if alias.name == "lightning" and alias.asname is None:
                # `lightning.__version__` reads the version of the package in use.
                if self.names_lightning_attributes:
                    raise self._refuse(node, "reaches a sub-package by attribute: import it by its name")
                renamed, alias = "pytorch_lightning", ast.alias("pytorch_lightning", "lightning")
            elif renamed is not None and alias.asname is None:
                raise self._refuse(node, "binds the top-level name: write `import ... as name` or `from ... import`")
            names.append(ast.alias(renamed or alias.name, alias.asname))
        return ast.copy_location(ast.Import(names=names), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
        if node.level:
            raise self._refuse(node, "is relative: the package imports by absolute names")
        if node.module == "lightning":
            raise self._refuse(node, "has no standalone counterpart: import from lightning.pytorch or lightning.fabric")
        renamed = standalone_name(node.module or "")
        if renamed is None:
            return node
        return ast.copy_location(ast.ImportFrom(module=renamed, names=node.names, level=0), node)


def rewrite_imports(tree: ast.Module, module_name: str) -> ast.Module:
    """``tree`` with each import of ``lightning.pytorch``, ``lightning.fabric`` and this package renamed (in place).

    Example:
        >>> ast.unparse(rewrite_imports(ast.parse("from lightning_shard.trainer.strategy import X"), "m"))
        'from lightning_shard.standalone.trainer.strategy import X'
    """
    names_lightning_attributes = any(
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "lightning"
        and node.attr in ("pytorch", "fabric")
        for node in ast.walk(tree)
    )
    return ast.fix_missing_locations(_Renamer(module_name, names_lightning_attributes).visit(tree))
