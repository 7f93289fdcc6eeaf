"""The dispatch-level half of the recorder (:mod:`lightning_shard.init.construction`): the ops run on meta tensors.

Takes the ATen ops that reach the dispatcher while a construction is recorded; gives the log one
:class:`~lightning_shard.init.construction_log.Op` for each op that creates, reads or writes a meta tensor (whatever
Python name called it), and for each random op on real CPU tensors (it advances the random stream of an eager build).
:class:`OpRecorder` classifies each op by its schema: what it reads, what it writes whole (:data:`OVERWRITES`, or an
``out=`` argument) and what it only updates. :class:`DataFactories` records ``torch.tensor(data)`` and its kin, which
copy their data below the dispatcher. A random op on meta tensors draws nothing: it is owed to the live generator
(:mod:`lightning_shard.init.skipped_draws`) and made up before the generator's state next matters.

Example:
    >>> log = ConstructionLog(rng_start=torch.default_generator.get_state())
    >>> with OpRecorder(log, GeneratorWatch(log), owes_draws=False):
    ...     _ = torch.ones(2, device="meta")
    >>> [op.func.__name__ for op in log.ops]
    ['ones.default']
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_shard.init.construction_log import SEQUENCE, ConstructionLog, Op, Scratch, TensorRef
from lightning_shard.init.recorded_inputs import GeneratorAt, RealValue
from lightning_shard.init.rng_watch import INTERNAL, GeneratorWatch
from lightning_shard.init.skipped_draws import SKIPPED, generator_of
from lightning_shard.torch_compat.dispatch import (
    TorchDispatchMode,
    draws_random_numbers,
    op_arguments,
    op_base_name,
    torch_functions_off,
    tree_leaves,
    tree_map,
)
from lightning_shard.torch_compat.tensors import is_generator, storage_key

# In-place ops that set every element of the tensor they write without reading it (by their overload packet's name:
# `aten::fill_` for `aten::fill_.Scalar`). Knowing them only saves memory: the value before is not kept for them.
OVERWRITES = frozenset(
    {
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
)


class OpRecorder(TorchDispatchMode):
    def __init__(self, log: ConstructionLog, rng: GeneratorWatch, owes_draws: bool) -> None:
        super().__init__()
        self.log = log
        self.rng = rng
        self.owes_draws = owes_draws  # its skipped draws are owed to the live generators (SKIPPED)
        self.suspended = 0  # inside a function recorded whole

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        with python_calls_unwatched():
            return self._record(func, args, kwargs)

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self.rng.check()
        if self.owes_draws and draws_random_numbers(func) and not any(t.is_meta for t in _tensors((args, kwargs))):
            self.settle(generator_of((args, kwargs)))  # a real draw: from where an eager build's stream stands
        out = _run(func, args, kwargs)
        with torch_functions_off():
            op = self._classify(func, args, kwargs, out)
        if op is not None:
            self.log.ops.append(op)
            if op.real_draw:
                self.rng.explained()
            else:
                self.owe(op)
        return out

    def owe(self, op: Op) -> None:
        """Note a draw skipped on the meta device (see :mod:`lightning_shard.init.skipped_draws`)."""
        if self.owes_draws and op.random:
            SKIPPED.add(generator_of((op.args, op.kwargs)), op)

    def settle(self, generator: torch.Generator) -> None:
        """Make up ``generator``'s skipped draws now, unrecorded."""
        if generator.device.type != "cpu" or id(generator) not in SKIPPED.pending:
            return
        self.suspended += 1
        try:
            SKIPPED.pay(generator)
        finally:
            self.suspended -= 1
        self.rng.explained()

    def _classify(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Op | None:
        inputs = _tensors((args, kwargs))
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        random = draws_random_numbers(func)
        real = not any(t.is_meta for t in [*inputs, *results])
        if real and (not random or any(t.device.type != "cpu" for t in [*inputs, *results])):
            # On real tensors only: no value of the model's; but a draw on the CPU advances the eager build's stream.
            return None
        input_storages = {storage_key(t) for t in inputs if t.is_meta}
        outputs = [TensorRef.of(t) if t.is_meta and storage_key(t) not in input_storages else None for t in results]
        writes: list[TensorRef] = []
        reads: list[TensorRef] = []
        updates: list[TensorRef] = []
        written_real: set[int] = set()
        overwritten = {ref.storage for ref in outputs if ref is not None}
        for argument, value in _arguments(func, args, kwargs):
            written = argument.alias_info is not None and argument.alias_info.is_write
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                if not isinstance(tensor, torch.Tensor):
                    continue
                if not tensor.is_meta:
                    if written:
                        written_real.add(id(tensor))
                    continue
                self.log.storages.setdefault(storage_key(tensor), tensor.untyped_storage())
                ref = TensorRef.of(tensor)
                if not written:
                    reads.append(ref)
                    continue
                writes.append(ref)
                # An `out=` argument is set without being read; `self` of an in-place op that sets every element
                # (`fill_`, `normal_`, `copy_`) too, when it spans its storage. Anything else updates what it writes.
                if ref.whole and (argument.kwarg_only or op_base_name(func) in OVERWRITES):
                    overwritten.add(ref.storage)
                else:
                    updates.append(ref)
        if not writes and not any(outputs) and not random:
            return None  # a view, or a query (`is_nonzero`, `sym_size`)
        for tensor in results:
            if tensor.is_meta:
                self.log.storages.setdefault(storage_key(tensor), tensor.untyped_storage())
        recorded = partial(recorded_args, scratch=written_real)
        return new_op(
            func,
            recorded(args),
            recorded(kwargs),
            outputs,
            tuple(writes),
            tuple(reads),
            tuple(updates),
            frozenset(overwritten),
            random,
            real,
        )


_NORMAL = torch.ops.aten.normal_.default


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``, except for ``normal_`` of a meta tensor with a valid ``std``: it returns its tensor
    unchanged, and torch's meta kernel for it is a Python decomposition (about 0.2 ms a call, a quarter of recording
    the GPT example). Any other ``std`` runs the kernel, which raises torch's own error."""
    if func is _NORMAL and args and args[0].is_meta:
        std = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
        if isinstance(std, int | float) and std >= 0:
            return args[0]
    return func(*args, **kwargs)


def new_op(
    func: Any,
    args: tuple,
    kwargs: dict,
    outputs: list[TensorRef | None],
    writes: tuple[TensorRef, ...],
    reads: tuple[TensorRef, ...],
    updates: tuple[TensorRef, ...],
    overwritten: frozenset[int],
    random: bool,
    real_draw: bool,
) -> Op:
    return Op(
        next(SEQUENCE),
        func,
        args,
        kwargs,
        outputs,
        writes,
        reads,
        updates,
        overwritten,
        random,
        real_draw,
        modules_under_construction(),
    )


def _arguments(func: Any, args: tuple, kwargs: dict) -> Iterator[tuple[Any, Any]]:
    """``(schema argument, value)`` for each argument ``func`` was called with."""
    for position, argument in enumerate(op_arguments(func)):
        if position < len(args):
            yield argument, args[position]
        elif argument.name in kwargs:
            yield argument, kwargs[argument.name]


def recorded_args(tree: Any, scratch: set[int] = frozenset()) -> Any:  # type: ignore[assignment]
    """An op's arguments as recorded: meta tensors as ``TensorRef``, real tensors it writes (``scratch``, by id: a real
    draw's target) as ``Scratch`` placeholders, other real tensors as ``RealValue``."""

    def recorded(value: Any) -> Any:
        if is_generator(value):
            return GeneratorAt(value, INTERNAL.run(value.get_state))
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_meta:
            return TensorRef.of(value)
        return Scratch(TensorRef.of(value)) if id(value) in scratch else RealValue.of(value)

    return tree_map(recorded, tree)


class DataFactories(TorchFunctionMode):
    """``torch.tensor(data)`` and its kin copy Python or NumPy data to the meta device below the dispatcher, where no
    op is seen: each call that returns a meta tensor is recorded as one op, replayed by calling it again with a copy of
    the data as it was (``nn.Parameter(torch.tensor(2.6592))``, CLIP's ``logit_scale``)."""

    FUNCTIONS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})

    def __init__(self, log: ConstructionLog, recorder: OpRecorder, rng: GeneratorWatch) -> None:
        super().__init__()
        self.log, self.recorder, self.rng = log, recorder, rng

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in self.FUNCTIONS or self.recorder.suspended:
            return func(*args, **kwargs)
        self.rng.check()
        data = recorded_args(copy.deepcopy(args))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_meta:
            self.log.storages.setdefault(storage_key(out), out.untyped_storage())
            ref = TensorRef.of(out)
            op = new_op(func, data, recorded_args(kwargs), [ref], (), (), (), frozenset({ref.storage}), False, False)
            self.log.ops.append(op)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda value: found.append(value) if isinstance(value, torch.Tensor) else None, tree)
    return found


class python_calls_unwatched:  # noqa: N801  (used as a function: ``with python_calls_unwatched():``)
    """Inside, the Python calls of this thread reach no :class:`~lightning_shard.init.python_calls.PythonCalls` hook
    (a profiler it chains to still sees them): recording an op and running it on meta tensors makes thousands of calls
    (pytree, torch's meta kernels in Python), none of which the hook looks for, and each of which it would cost. A
    class, not a generator context: it is entered for every op and registration.

    Example:
        >>> with python_calls_unwatched():
        ...     pass
    """

    __slots__ = ("hook",)

    def __enter__(self) -> None:
        self.hook = sys.getprofile()
        if getattr(self.hook, "watches_python_calls", False):
            sys.setprofile(self.hook.previous)
        else:
            self.hook = None

    def __exit__(self, *exc: object) -> None:
        if self.hook is not None:
            sys.setprofile(self.hook)


def modules_under_construction() -> tuple[nn.Module, ...]:
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
