"""What building a model on the meta device did to its tensors, recorded so that materialisation can do it again.

On the meta device nothing has values, so the ops that initialise a model (``reset_parameters()``, ``nn.init.*``,
``torch.ones``, a library's own init such as peft's LoRA: ``kaiming_uniform_`` on A, ``zeros_`` on B) compute
nothing. :func:`record_construction` notes, in program order, each op that creates or writes a meta tensor, and each
registration of a submodule, parameter or buffer, each with the modules whose constructors were running
(:class:`ConstructionLog`). :mod:`lightning_shard.materialize` replays the ops on real tensors after sharding, in the
same order and from the same random stream, so the weights equal an eager build whatever code initialised them; the
registrations tell which constructor built a module and which modules were changed after their construction (peft
replacing a transformers model's ``q_proj`` by its ``lora.Linear``).

An op is replayable when everything it reads is known: scalars, real tensors, the tensor it writes, or (a copy:
``clone``, ``copy_``, ``.to``) another recorded tensor as a whole. A tensor computed from other tensors in any other
way (a rotary table from ``arange``) is not: its module must recompute it in ``reset_parameters()``. The
``torch.nn.init`` functions whose work depends on values (``trunc_normal_``'s rejection sampling, ``orthogonal_``'s
QR) return at once on a meta tensor (torch 2.13) or compute from other tensors: while recording, each call on a meta
tensor is noted as one op, replayed by calling the function on the real tensor.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from lightning_shard.torch_compat import TorchDispatchMode, draws_random_numbers, op_arguments, storage_key, tree_map

# Set on every module seen while a log was recorded: the log.
_LOG = "_lightning_shard_construction_log"
# One order for every log: a model built in two recorded steps replays them in program order.
_SEQUENCE = itertools.count()
# `table name of a module -> the kind of what it holds`
TABLES = {"_modules": "module", "_parameters": "parameter", "_buffers": "buffer"}
ABSENT = object()  # what a registration replaced when nothing was registered under that name before

# A module's tensor, named by where it is held: (id(module), "_parameters" | "_buffers", name).
HolderKey = tuple[int, str, str]

# Ops that create a tensor without giving it values.
_ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}
# In-place ops that overwrite the whole tensor they write without reading it.
_OVERWRITES = {
    "aten::uniform_",
    "aten::normal_",
    "aten::fill_",
    "aten::zero_",
    "aten::random_",
    "aten::exponential_",
    "aten::geometric_",
    "aten::cauchy_",
    "aten::log_normal_",
    "aten::bernoulli_",
    "aten::copy_",
}
# Out-of-place ops whose result is a copy of their one tensor input.
_COPIES = {"aten::clone", "aten::_to_copy"}
# torch.nn.init functions recorded as one op each (module docstring), and whether they draw random numbers.
_INIT_FUNCTIONS = {"trunc_normal_": True, "orthogonal_": True, "sparse_": True, "dirac_": False}

OpKind = Literal["allocate", "create", "write", "copy", "computed"]


@dataclass(eq=False)
class Op:
    """One recorded op that created or wrote a meta tensor.

    Attributes:
        kind: ``"allocate"`` (``empty``: no values), ``"create"`` (a factory: ``ones``, ``randn``), ``"write"`` (in
            place, reading only scalars, real tensors and the tensor it writes), ``"copy"`` (the whole of ``source``
            into ``target``) or ``"computed"`` (from other meta tensors: not replayable).
        target: the tensor created or written (a view when a slice is written); ``None`` for a draw whose result
            is no meta tensor (it still advances the random stream).
        whole: ``target`` spans its whole storage; ``overwrites``: the op sets every element without reading them.
        constructing: the modules whose ``__init__`` was running, outermost first.
    """

    seq: int
    func: Any
    args: tuple
    kwargs: dict
    kind: OpKind
    target: torch.Tensor | None
    source: torch.Tensor | None
    whole: bool
    overwrites: bool
    random: bool
    constructing: tuple[nn.Module, ...]

    @property
    def storage(self) -> int | None:
        return None if self.target is None else storage_key(self.target)

    @property
    def source_storage(self) -> int | None:
        return None if self.source is None else storage_key(self.source)


@dataclass(eq=False)
class Registration:
    """``parent.<name> = new`` (a submodule, parameter or buffer), replacing ``old`` (:data:`ABSENT`: nothing)."""

    seq: int
    parent: nn.Module
    table: str
    name: str
    old: Any
    new: Any
    constructing: tuple[nn.Module, ...]


@dataclass(eq=False)
class ConstructionLog:
    """Everything :func:`record_construction` noted, and at its end the storage each meta tensor was held in.

    Example:
        >>> with torch.device("meta"), record_construction() as log:
        ...     layer = nn.Linear(2, 2)
        >>> [op.func.__name__ for op in log.ops if op.kind == "write"]
        ['uniform_.default', 'uniform_.default']
    """

    ops: list[Op] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)
    # HolderKey -> the meta tensor held there when construction ended (its storage identifies it in `ops`).
    held: dict[HolderKey, torch.Tensor] = field(default_factory=dict)
    modules: dict[int, nn.Module] = field(default_factory=dict)  # every module seen, by id (kept alive)

    def constructor_ends(self) -> dict[int, float]:
        """``id(module) -> position just after the last op or registration made while its __init__ ran``: where an
        eager build finished constructing it."""
        ends: dict[int, float] = {}
        for entry in itertools.chain(self.ops, self.registrations):
            for module in entry.constructing:
                ends[id(module)] = max(ends.get(id(module), -1.0), entry.seq + 0.5)
        return ends


def covers_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` spans its whole storage, contiguously.

    Example:
        >>> weight = torch.empty(2, 2, device="meta")
        >>> covers_storage(weight), covers_storage(weight[1])
        (True, False)
    """
    return (
        tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    )


@contextmanager
def record_construction() -> Iterator[ConstructionLog]:
    """Record the construction of the modules built inside (see module docstring); each module seen keeps the log.

    Example:
        >>> with torch.device("meta"), record_construction() as log:
        ...     model = nn.Sequential(nn.Linear(2, 2))
        >>> construction_logs(model) == [log]
        True
    """
    log = ConstructionLog()
    recorder = _OpRecorder(log)

    def registered(table: str) -> Any:
        def hook(parent: nn.Module, name: str, value: Any) -> None:
            old = parent.__dict__[table].get(name, ABSENT)
            seq = next(_SEQUENCE)
            log.registrations.append(Registration(seq, parent, table, name, old, value, _modules_under_construction()))
            log.modules[id(parent)] = parent
            if isinstance(value, nn.Module):
                log.modules[id(value)] = value

        return hook

    handles = [
        register_module_module_registration_hook(registered("_modules")),
        register_module_parameter_registration_hook(registered("_parameters")),
        register_module_buffer_registration_hook(registered("_buffers")),
    ]
    originals = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name, random in _INIT_FUNCTIONS.items():
        setattr(torch.nn.init, name, _recorded_init_function(originals[name], random, log))
    try:
        with recorder:
            yield log
    finally:
        for handle in handles:
            handle.remove()
        for name, original in originals.items():
            setattr(torch.nn.init, name, original)
    for module in log.modules.values():
        module.__dict__[_LOG] = log
        for table in ("_parameters", "_buffers"):
            for name, tensor in module.__dict__[table].items():
                if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                    log.held[(id(module), table, name)] = tensor


def _recorded_init_function(original: Any, random: bool, log: ConstructionLog) -> Any:
    @functools.wraps(original)
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
            return original(tensor, *args, **kwargs)
        op = _op(original, (tensor, *args), kwargs, "write", tensor, None, True, random)
        assert op is not None
        log.ops.append(op)
        return tensor

    return init


def construction_logs(root: nn.Module) -> list[ConstructionLog]:
    """The logs recorded while ``root``'s modules were built (usually one; none if built outside a recording).

    Example:
        >>> construction_logs(nn.Linear(2, 2))
        []
    """
    logs = {id(log): log for m in root.modules() if (log := m.__dict__.get(_LOG)) is not None}
    return list(logs.values())


def forget_construction(root: nn.Module) -> None:
    """Drop the logs from ``root``'s modules once materialised: they are replayed once.

    Example:
        >>> forget_construction(model); construction_logs(model)  # doctest: +SKIP
        []
    """
    for module in root.modules():
        module.__dict__.pop(_LOG, None)


class _OpRecorder(TorchDispatchMode):
    def __init__(self, log: ConstructionLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = _classify(func, args, kwargs, out)
        if op is not None:
            self.log.ops.append(op)
        return out


def _classify(func: Any, args: tuple, kwargs: dict, out: Any) -> Op | None:
    arguments = op_arguments(func)
    written = [
        value
        for argument, value in zip(arguments, args, strict=False)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]
    written += [
        kwargs[argument.name]
        for argument in arguments
        if argument.alias_info is not None and argument.alias_info.is_write and argument.name in kwargs
    ]
    targets = [t for t in written if isinstance(t, torch.Tensor) and t.is_meta]
    inputs = [t for t in _tensors((args, kwargs)) if t.is_meta and not any(t is w for w in targets)]
    random = _draws_random_numbers(func)
    if targets:
        target = targets[0]
        if len(targets) > 1:
            kind: OpKind = "computed"
        elif not inputs:
            kind = "write"
        else:
            kind = "copy" if func.name() == "aten::copy_" and _whole_copy(inputs[0], target) else "computed"
        source = inputs[0] if kind == "copy" else None
        overwrites = func.name() in _OVERWRITES and covers_storage(target)
        return _op(func, args, kwargs, kind, target, source, overwrites, random)
    input_storages = {storage_key(t) for t in inputs}
    created = [t for t in _tensors(out) if t.is_meta and storage_key(t) not in input_storages]
    if not created:
        # a view, or an op with no meta result; a draw still advances the random stream of an eager build
        return _op(func, args, kwargs, "computed", None, None, False, True) if random else None
    target = created[0]
    if not inputs:
        kind = "allocate" if func.name() in _ALLOCATIONS else "create"
    elif len(created) == 1 and func.name() in _COPIES and len(inputs) == 1 and _whole_copy(inputs[0], target):
        kind = "copy"
    else:
        kind = "computed"
    source = inputs[0] if kind == "copy" else None
    return _op(func, args, kwargs, kind, target, source, kind != "computed", random)


def _op(
    func: Any,
    args: tuple,
    kwargs: dict,
    kind: OpKind,
    target: torch.Tensor | None,
    source: torch.Tensor | None,
    overwrites: bool,
    random: bool,
) -> Op | None:
    if target is None and not random:
        return None
    whole = target is not None and covers_storage(target)
    return Op(
        next(_SEQUENCE),
        func,
        args,
        kwargs,
        kind,
        target,
        source,
        whole,
        overwrites and whole,
        random,
        _modules_under_construction(),
    )


def _whole_copy(source: torch.Tensor, target: torch.Tensor) -> bool:
    return covers_storage(source) and covers_storage(target) and source.shape == target.shape


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda value: found.append(value) if isinstance(value, torch.Tensor) else None, tree)
    return found


_draws_random_numbers = functools.cache(draws_random_numbers)


def _modules_under_construction() -> tuple[nn.Module, ...]:
    """The modules whose ``__init__`` is on the call stack, outermost first."""
    chain: list[nn.Module] = []
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module) and not any(obj is m for m in chain):
                chain.append(obj)
        frame = frame.f_back
    return tuple(reversed(chain))
