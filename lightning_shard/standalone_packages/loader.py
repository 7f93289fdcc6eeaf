"""The import machinery of ``lightning_shard.standalone``: a finder that loads the package's modules a second time
under that name, and a hook that loads the namespace when ``pytorch_lightning`` or ``lightning_fabric`` is imported.

A standalone module starts as the unified module's namespace (the same objects: functions, classes, registries,
state), minus its submodules; then the statements that use the framework run again on top of it from the same source
file, with their imports renamed (:mod:`.rewrite`). So ``lightning_shard.standalone.trainer.strategy.ShardedStrategy``
subclasses ``pytorch_lightning``'s classes, while, say, ``ShardingConfig`` is one class for both packages.

Example:
    >>> import lightning_shard  # installs the finder; then, with pytorch_lightning imported:
    >>> from lightning_shard.standalone import ShardedStrategy  # doctest: +SKIP
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

from packaging.version import Version

from lightning_shard.standalone_packages.dependencies import PACKAGE, framework_use
from lightning_shard.standalone_packages.rewrite import STANDALONE, rewrite_imports

# The Lightning versions the package supports (pyproject.toml's `lightning` range); another pytorch_lightning is left
# alone with a warning, since the framework statements use Lightning's private names.
SUPPORTED_LIGHTNING = (Version("2.5"), Version("2.7"))
_WATCHED = ("pytorch_lightning", "lightning_fabric")
# Attributes that belong to a module object itself, not to its namespace.
_MODULE_ATTRIBUTES = {"__name__", "__loader__", "__package__", "__spec__", "__path__", "__file__", "__cached__"}


class StandaloneFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning_shard.standalone[.module]`` for each module of the package and loads it (module docstring)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != STANDALONE and not fullname.startswith(STANDALONE + "."):
            return None
        module = framework_use().modules.get(PACKAGE + fullname[len(STANDALONE) :])
        if module is None:
            return None
        # A package's submodules come from this finder alone (an empty search path).
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=str(module.path), is_package=module.is_package)
        spec.has_location = True  # `__file__` names the source file, for tracebacks and `inspect`
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        name = PACKAGE + module.__name__[len(STANDALONE) :]
        unified = importlib.import_module(name)
        for key, value in vars(unified).items():
            # Submodules are left out: importing one by name gives its standalone counterpart.
            is_submodule = isinstance(value, ModuleType) and value.__name__.startswith(name + ".")
            if key not in _MODULE_ATTRIBUTES and not is_submodule:
                module.__dict__.setdefault(key, value)
        analysis = framework_use()
        source = analysis.modules[name]
        kept = set(analysis.statements_using_framework(name))
        statements = [
            copy.deepcopy(statement.node)  # the renaming edits nodes in place
            for index, statement in enumerate(source.statements)
            if index in kept or _is_future_import(statement.node)
        ]
        tree = rewrite_imports(ast.Module(body=statements, type_ignores=[]), name)
        exec(compile(tree, str(source.path), "exec", dont_inherit=True), module.__dict__)


def _is_future_import(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and node.module == "__future__"


class _LoadAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: gives a watched package's spec a loader that loads the standalone namespace after it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if finder is not self and find_spec else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenLoadStandalone(spec.loader)
                return spec
        return None


class _ThenLoadStandalone(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # no trace of this wrapper is left
        self.loader.exec_module(module)
        _after_import(module.__name__)


def _after_import(name: str) -> None:
    if name == "lightning_fabric" and "pytorch_lightning" in sys.modules:
        return  # pytorch_lightning is importing lightning_fabric: load once it is complete
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _LoadAfterImport)]
    _load_standalone()


def _load_standalone() -> None:
    try:
        version = Version(importlib.metadata.version("pytorch_lightning"))
    except importlib.metadata.PackageNotFoundError:
        return  # lightning_fabric alone: the standalone namespace needs both packages
    low, high = SUPPORTED_LIGHTNING
    if not low <= version < high:
        warnings.warn(
            f"lightning_shard supports pytorch_lightning >={low},<{high}, but {version} is installed: "
            f"`lightning_shard.standalone` is not loaded (use `lightning` {low}+ or upgrade pytorch_lightning)",
            stacklevel=3,
        )
        return
    importlib.import_module(STANDALONE)


def load_when_imported() -> None:
    """Make ``lightning_shard.standalone`` importable, and load it now if ``pytorch_lightning`` or ``lightning_fabric``
    is imported already, else as soon as one of them is (so that its strategy names are registered either way).

    Example:
        >>> load_when_imported()  # `import lightning_shard` calls it
    """
    if not any(isinstance(finder, StandaloneFinder) for finder in sys.meta_path):
        sys.meta_path.append(StandaloneFinder())
    if any(name in sys.modules for name in _WATCHED):
        _load_standalone()
    elif not any(isinstance(finder, _LoadAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LoadAfterImport())
