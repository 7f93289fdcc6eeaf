"""Which of the package's definitions use the framework (``lightning.pytorch`` / ``lightning.fabric``), read from the
source: the only ones that exist a second time for the standalone packages.

A module-level statement (function, class, assignment, import, or a statement run at import such as a registration)
depends on the framework when it names a Lightning object, or a name whose statement depends on it, in its module or
in another module of the package (followed to a fixed point). A Lightning name counts unless :data:`NEUTRAL` lists it:
names that behave alike whichever copy of Lightning they come from.

Example:
    >>> analysis = framework_use()
    >>> "lightning_shard.trainer.strategy" in analysis.modules_using_framework()
    True
    >>> "lightning_shard.init.materialize" in analysis.modules_using_framework()  # one registry of libraries for both
    False
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "lightning_shard"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
FRAMEWORK = "lightning"
# Lightning names that behave alike under both packages (a prefix ends with "."), each with the reason.
NEUTRAL = {
    "lightning.fabric.utilities.distributed._distributed_is_initialized": "reads torch.distributed's own state",
    "lightning.fabric.utilities.rank_zero.": "lightning_utilities' functions: one rank attribute for both packages",
    "lightning.pytorch.utilities.rank_zero.": "the same lightning_utilities functions",
    "lightning.fabric.utilities.types.": "type aliases and structural protocols",
    "lightning.fabric.plugins.collectives.torch_collective.default_pg_timeout": "a timedelta",
    "lightning.fabric.plugins.precision.utils.": "dtype casts of torch tensors",
    "lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device": "a device type's name",
    "lightning.fabric.strategies.fsdp._move_torchmetrics_to_device": "moves torchmetrics' states",
}

Target = tuple[str, "str | None"]  # (module, imported name), or (module, None): `import module`
Node = tuple[str, "int | None"]  # (module, statement index), or (module, None): the whole module


@dataclass
class Statement:
    """A top-level statement of a module: the names it binds, the module-level names it reads, what it imports."""

    node: ast.stmt
    binds: set[str]
    reads: set[str]
    imports: set[Target]


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    statements: list[Statement] = field(default_factory=list)
    _binders: dict[str, list[int]] = field(default_factory=dict)

    def binders(self, name: str) -> list[int]:
        """The indices of the statements that bind ``name``."""
        return self._binders.get(name, [])


def _imports(node: ast.AST) -> Iterator[tuple[str, Target]]:
    """(the name bound, what is imported) for each absolute import in ``node``, nested ones included."""
    for child in ast.walk(node):
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield alias.asname or alias.name.split(".")[0], (alias.name, None)
        elif isinstance(child, ast.ImportFrom) and child.module is not None and child.level == 0:
            for alias in child.names:
                yield alias.asname or alias.name, (child.module, alias.name)


def _statement(node: ast.stmt) -> Statement:
    names = [child for child in ast.walk(node) if isinstance(child, ast.Name)]
    binds = {name.id for name in names if isinstance(name.ctx, ast.Store)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        binds = {node.name}
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        binds = {bound for bound, _ in _imports(node)}
    return Statement(node, binds, {name.id for name in names}, {target for _, target in _imports(node)})


def read_module(name: str, path: Path, is_package: bool) -> Module:
    module = Module(name, path, is_package)
    module.statements = [_statement(node) for node in ast.parse(path.read_text(), str(path)).body]
    for index, statement in enumerate(module.statements):
        for bound in statement.binds:
            module._binders.setdefault(bound, []).append(index)
    return module


def _is_neutral(full_name: str) -> bool:
    return any(full_name.startswith(name) if name.endswith(".") else full_name == name for name in NEUTRAL)


class FrameworkUse:
    """The package's modules and which of their top-level statements use the framework."""

    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        # A graph over statements `(module, index)` and whole modules `(module, None)`: each node lists the nodes that
        # depend on it. A node uses the framework when it imports a Lightning name or depends on a node that does.
        self._dependents: dict[Node, list[Node]] = {}
        using = []
        for module in modules.values():
            self._depend((module.name, None), _parent_node(module.name))
            for index, statement in enumerate(module.statements):
                node = (module.name, index)
                self._depend(node, (module.name, None))
                for target in statement.imports:
                    if _is_framework(target):
                        using.append(node)
                    for used in self._nodes_of(target):
                        self._depend(used, node)
                for name in statement.reads - statement.binds:
                    for index_binding in module.binders(name):
                        self._depend((module.name, index_binding), node)
        self.using: set[Node] = set()
        while using:
            node = using.pop()
            if node not in self.using:
                self.using.add(node)
                using.extend(self._dependents.get(node, ()))

    def statements_using_framework(self, module_name: str) -> list[int]:
        """The indices of ``module_name``'s top-level statements that use the framework."""
        return sorted(index for name, index in self.using if name == module_name and index is not None)

    def modules_using_framework(self) -> set[str]:
        return {name for name, index in self.using if index is not None}

    def _depend(self, used: Node, node: Node | None) -> None:
        if node is not None:
            self._dependents.setdefault(used, []).append(node)

    def _nodes_of(self, target: Target) -> list[Node]:
        """The nodes an import of ``target`` from this package depends on."""
        module_name, name = target
        if name is not None and f"{module_name}.{name}" in self.modules:  # `from package import submodule`
            module_name, name = f"{module_name}.{name}", None
        module = self.modules.get(module_name)
        if module is None:
            return []
        if name is not None and module.binders(name):
            return [(module_name, index) for index in module.binders(name)]
        # The whole module, or a name it makes at run time (a module `__getattr__`): the package with its submodules.
        return [(module_name, None)]


def _parent_node(module_name: str) -> Node | None:
    """A module's node feeds its package's: importing a package by name counts all of its submodules."""
    return (module_name.rpartition(".")[0], None) if "." in module_name else None


def _is_framework(target: Target) -> bool:
    module_name, name = target
    full_name = f"{module_name}.{name}" if name else module_name
    return module_name.split(".")[0] == FRAMEWORK and not _is_neutral(full_name)


def package_modules(root: Path = PACKAGE_ROOT) -> dict[str, Module]:
    """Every module of the package under ``root``, by name."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = read_module(name, path, is_package)
    return modules


@functools.cache
def framework_use() -> FrameworkUse:
    """The analysis of this package's installed source (read once per process).

    Example:
        >>> framework_use().statements_using_framework("lightning_shard.plan.config")
        []
    """
    return FrameworkUse(package_modules())
