"""Which submodules a model's own code reaches into instead of calling them - the ones that cannot be FSDP units.

FSDP2 gathers a unit's parameters in a hook around the unit's ``__call__``. Code that reads a unit's tensors or
submodules without calling it sees the sharded DTensors: ``nn.MultiheadAttention.forward`` hands
``self.out_proj.weight`` to ``F.multi_head_attention_forward`` ("got mixed torch.Tensor and DTensor" if ``out_proj``
is a unit); diffusers' DiT calls ``self.transformer_blocks[0].norm1.emb(...)`` from its own forward. Found statically:
the source of every module class's ``forward`` (and of the methods it calls on ``self``) is parsed once per function
(``ast``), and each attribute chain rooted at ``self`` - directly, or through a name bound by a ``for`` loop
(``enumerate`` / ``zip`` / tuple unpacking) or an assignment - is followed on the live module tree. A module reached
and then looked into (a parameter, a buffer, a submodule, a method other than ``__call__``, an index or an iteration)
is read from outside; one that is only called is not. Reading a tensor's metadata (``self.proj.weight.dtype``) is
not a read of its values.

What the source does not show - ``getattr(self, name)`` with a computed name, a lambda stored in ``__init__``, a C++
module - is not seen; a module named here may still be safe (a false alarm only costs a unit).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

# Tensor attributes that say what a tensor is, not what it holds: reading them from a sharded parameter is harmless.
_METADATA = frozenset({"dtype", "device", "shape", "ndim", "requires_grad", "is_cuda", "is_meta", "layout", "size"})
# Iterating these calls yields a container's modules; `items()` / `named_children()` yield (name, module) pairs.
_MODULE_ITERATORS = frozenset({"values", "children"})
_NAMED_MODULE_ITERATORS = frozenset({"items", "named_children"})
# Lightning runs a LightningModule through these, not only `forward` (the strategy gathers the root around them).
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
# Builtins that look at a value's structure or type, never at tensor values.
_STRUCTURE_ONLY = frozenset({"len", "isinstance", "hasattr", "type", "id", "callable"})
# Builtins whose iteration yields the elements of their first argument.
_PASS_THROUGH = frozenset({"list", "tuple", "reversed", "iter", "sorted"})

_MISSING = object()
Step = tuple[str, object]  # ("attr", name) | ("index", int | str | None) | ("slice", None) | ("iter", None)


@dataclass(frozen=True)
class _Chain:
    """``self.a[0].b`` as steps from ``self``; ``called``: the whole chain is called (``self.a[0].b(...)``)."""

    steps: tuple[Step, ...]
    called: bool
    source: str


def modules_read_from_outside(root: nn.Module) -> dict[int, str]:
    """The submodules of ``root`` whose insides an enclosing module's code reads without calling them, by ``id``,
    each with the reason (which forward, which expression).

    Example:
        >>> attention = nn.MultiheadAttention(8, 2)
        >>> reasons = modules_read_from_outside(attention)
        >>> reasons[id(attention.out_proj)]
        'MultiheadAttention.forward reads `self.out_proj.weight`'
    """
    found: dict[int, str] = {}
    for module in root.modules():
        for chain in _chains(type(module)):
            for reached in _reached_into(module, chain):
                if reached is not module and not _is_container(reached):
                    found.setdefault(id(reached), f"{type(module).__name__}.forward reads `{chain.source}`")
    return found


def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class implements ``forward`` (containers such as ``nn.ModuleList`` do not).

    Example:
        >>> has_own_forward(nn.ModuleList()), has_own_forward(nn.Linear(2, 2))
        (False, True)
    """
    return type(module).forward is not nn.Module.forward


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) or not has_own_forward(module)


def _reached_into(module: nn.Module, chain: _Chain) -> list[nn.Module]:
    """The modules ``chain`` looks into when followed from ``module``: every module it passes through that is not the
    called end. A path that meets an attribute this module tree does not have is a branch its code does not take
    here (``self.blocks[0].norm1.emb`` where ``norm1`` is a ``LayerNorm``): it reads nothing."""
    reached: list[nn.Module] = []

    def walk(value: nn.Module, position: int, passed: list[nn.Module]) -> None:
        if position == len(chain.steps):
            reached.extend(passed)
            return
        step = chain.steps[position]
        if position == len(chain.steps) - 1 and chain.called and step == ("attr", "__call__"):
            reached.extend(passed)  # the end of the chain, called: its FSDP hooks run
            return
        found = _follow(value, step)
        if found is _MISSING:
            return
        if found is None:  # a plain attribute (`first_layer.self_attn.batch_first`): no tensor is read
            return
        if not found:
            reached.extend([*passed, value])
        for child in found:
            walk(child, position + 1, [*passed, value])

    walk(module, 0, [])
    return reached


def _follow(module: nn.Module, step: Step) -> list[nn.Module] | None | object:
    """The submodules ``step`` reaches from ``module`` (none for a tensor or a method); ``None`` when it reads a
    plain attribute (a number, a config), which says nothing about the module's tensors; ``_MISSING`` when this
    module cannot take the step at all."""
    kind, key = step
    if kind == "attr":
        assert isinstance(key, str)
        if key in module._modules:
            child = module._modules[key]
            return [child] if child is not None else None
        if key in module._parameters or key in module._buffers or key == "__call__":
            return []
        if callable(getattr(type(module), key, None)):
            return []
        return None if hasattr(module, key) else _MISSING
    if not hasattr(type(module), "__iter__" if kind == "iter" else "__getitem__"):
        return _MISSING  # iterating or indexing this module would raise: a branch not taken for it
    children = [child for child in module._modules.values() if child is not None]
    if kind == "slice":
        return [module]
    if kind == "iter" or key is None:
        return children
    if isinstance(key, str):
        child = module._modules.get(key)
        return [child] if child is not None else _MISSING
    if isinstance(key, int) and -len(children) <= key < len(children):
        return [children[key]]
    return _MISSING


@functools.cache
def _chains(cls: type) -> tuple[_Chain, ...]:
    """Every ``self``-rooted chain in ``cls.forward`` (and a LightningModule's step methods) and in the methods of
    ``cls`` they call, transitively."""
    chains: list[_Chain] = []
    pending, seen = ["forward", *_STEP_METHODS], set()
    while pending:
        name = pending.pop()
        function = getattr(cls, name, None)
        if name in seen or not inspect.isfunction(function) or function is nn.Module.forward:
            continue
        seen.add(name)
        for chain in _function_chains(function):
            chains.append(chain)
            if chain.called and len(chain.steps) == 2 and chain.steps[0][0] == "attr":
                pending.append(str(chain.steps[0][1]))  # `self.helper(...)`: its body runs as part of forward
    return tuple(chains)


@functools.cache
def _function_chains(function: Callable) -> tuple[_Chain, ...]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ()  # no source to read (built in C, generated): nothing known
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)) or not definition.args.args:
        return ()
    collector = _ChainCollector(definition.args.args[0].arg)
    for statement in definition.body:
        collector.visit(statement)
    return tuple(collector.chains)


class _ChainCollector(ast.NodeVisitor):
    """Collects the chains rooted at ``self`` (named ``self_name``) or at local names bound to parts of it, in the
    order the statements bind and use them."""

    def __init__(self, self_name: str) -> None:
        self.aliases: dict[str, tuple[Step, ...]] = {self_name: ()}
        self.chains: list[_Chain] = []

    # -------------------------------------------------------------- bindings

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        self._bind_iteration(node.target, node.iter)
        for statement in [*node.body, *node.orelse]:
            self.visit(statement)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self.visit(node.iter)
        self._bind_iteration(node.target, node.iter)
        for condition in node.ifs:
            self.visit(condition)

    def _visit_comprehension_expression(self, node: ast.AST, elements: list[ast.AST]) -> None:
        for generator in node.generators:  # type: ignore[attr-defined]
            self.visit_comprehension(generator)
        for element in elements:
            self.visit(element)

    def visit_ListComp(self, node: ast.ListComp) -> None:
        self._visit_comprehension_expression(node, [node.elt])

    visit_SetComp = visit_ListComp  # noqa: N815  (ast.NodeVisitor's naming)
    visit_GeneratorExp = visit_ListComp  # noqa: N815

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._visit_comprehension_expression(node, [node.key, node.value])

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        steps = self._steps(node.value)
        for target in node.targets:
            if steps is not None:
                self._bind(target, steps)
            else:
                self._unbind(target)

    def _bind_iteration(self, target: ast.AST, iterable: ast.AST) -> None:
        if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) and iterable.args:
            name, args = iterable.func.id, iterable.args
            if name == "enumerate" and isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == 2:
                self._unbind(target.elts[0])
                self._bind_iteration(target.elts[1], args[0])
                return
            if name == "zip" and isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == len(args):
                for element, arg in zip(target.elts, args, strict=True):
                    self._bind_iteration(element, arg)
                return
            if name in _PASS_THROUGH:
                self._bind_iteration(target, args[0])
                return
        if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Attribute) and not iterable.args:
            steps = self._steps(iterable.func.value)
            method = iterable.func.attr
            if steps is not None and method in _MODULE_ITERATORS:
                self._bind(target, (*steps, ("iter", None)))
                return
            if steps is not None and method in _NAMED_MODULE_ITERATORS and isinstance(target, (ast.Tuple, ast.List)):
                self._unbind(target.elts[0])
                self._bind(target.elts[1], (*steps, ("iter", None)))
                return
        steps = self._steps(iterable)
        if steps is None:
            self._unbind(target)
        else:
            self._bind(target, (*steps, ("iter", None)))

    def _bind(self, target: ast.AST, steps: tuple[Step, ...]) -> None:
        if isinstance(target, ast.Name):
            self.aliases[target.id] = steps
        elif isinstance(target, (ast.Tuple, ast.List)):
            for index, element in enumerate(target.elts):
                self._bind(element, (*steps, ("index", index)))
        else:
            self._unbind(target)

    def _unbind(self, target: ast.AST) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                self.aliases.pop(node.id, None)

    # -------------------------------------------------------------- uses

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in _STRUCTURE_ONLY:
            return  # `len(block.resnets)`: how many, not what they hold
        if isinstance(node.func, (ast.Attribute, ast.Subscript, ast.Name)):
            self._record(node.func, called=True)
        else:
            self.visit(node.func)
        for argument in [*node.args, *(keyword.value for keyword in node.keywords)]:
            self.visit(argument)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._record(node, called=False)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self._record(node, called=False)
        self.visit(node.slice)

    def _record(self, node: ast.AST, called: bool) -> None:
        steps = self._steps(node)
        if steps is None:
            self._visit_inner(node)
            return
        if called:
            steps = (*steps, ("attr", "__call__"))
        if steps:
            self.chains.append(_Chain(steps, called, ast.unparse(node)))
        self._visit_inner(node)

    def _visit_inner(self, node: ast.AST) -> None:
        """Visit what a chain's subscripts and its base hold (``self.a[self.b.c]``), not the chain again."""
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Subscript):
                self.visit(node.slice)
            node = node.value
        if not isinstance(node, ast.Name):
            self.visit(node)

    def _steps(self, node: ast.AST) -> tuple[Step, ...] | None:
        """``node`` as steps from ``self`` (through an alias), or ``None`` when it does not start at ``self``."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._steps(node.value)
            if base is None:
                return None
            if node.attr in _METADATA and base and base[-1][0] == "attr":
                return None  # `self.proj.weight.dtype`: the tensor itself is not read (`_follow` tells tensors)
            return (*base, ("attr", node.attr))
        if isinstance(node, ast.Subscript):
            base = self._steps(node.value)
            if base is None:
                return None
            if isinstance(node.slice, ast.Slice):
                return (*base, ("slice", None))  # `self.layers[1:]`: a part of the same container
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
            return (*base, ("index", key if isinstance(key, (int, str)) else None))
        return None
