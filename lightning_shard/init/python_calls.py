"""The Python-level half of the recorder (:mod:`lightning_shard.init.construction`): calls no op shows.

Takes the Python calls made while a construction is recorded (a profile hook, ``sys.setprofile``, chained to any
already set); gives the log what the dispatcher does not see:

* the calls of the ``torch.nn.init`` functions that do nothing to a meta tensor (:data:`WHOLE_INIT_FUNCTIONS`: their
  draws depend on values), however they were imported, as one op each, replayed whole;
* ``get_rng_state()`` / ``set_rng_state()`` of a state taken while recording (``fork_rng``), as a save and a restore
  (:mod:`lightning_shard.init.rng_watch`);
* a generator's state set or read by any caller, which forgives or settles its skipped draws
  (:mod:`lightning_shard.init.skipped_draws`).

Example:
    >>> weight = torch.empty(2, 2, device="meta")
    >>> log = ConstructionLog(rng_start=torch.default_generator.get_state())
    >>> rng = GeneratorWatch(log)
    >>> with PythonCalls(log, OpRecorder(log, rng, owes_draws=False), rng):
    ...     _ = torch.nn.init.trunc_normal_(weight)
    >>> [op.func.__name__ for op in log.ops]
    ['trunc_normal_']
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from lightning_shard.init.construction_log import ConstructionLog, TensorRef
from lightning_shard.init.op_recorder import OpRecorder, new_op, recorded_args
from lightning_shard.init.rng_watch import INTERNAL, GeneratorWatch
from lightning_shard.init.skipped_draws import SKIPPED

# torch.nn.init functions that return at once on a meta tensor: recorded as one op each, replayed whole.
WHOLE_INIT_FUNCTIONS = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")
_GENERATOR = torch.Generator


class PythonCalls:
    """A profile hook (``sys.setprofile``, chained to any already set) that sees the calls of the functions recorded
    whole and of ``get_rng_state`` / ``set_rng_state`` by their code objects, so that any name bound to them counts
    (``from torch.nn.init import trunc_normal_`` before recording, as timm-style code does)."""

    watches_python_calls = True  # what :func:`~lightning_shard.init.op_recorder.python_calls_unwatched` looks for

    def __init__(self, log: ConstructionLog, recorder: OpRecorder, rng: GeneratorWatch) -> None:
        self.log, self.recorder, self.rng = log, recorder, rng
        self.whole = {
            getattr(torch.nn.init, name).__code__: getattr(torch.nn.init, name) for name in WHOLE_INIT_FUNCTIONS
        }
        self.get_state = torch.random.get_rng_state.__code__
        self.set_state = torch.random.set_rng_state.__code__
        self.open: list[Any] = []  # frames of the calls being recorded whole
        self.stop_at: dict[Any, Callable[[], None]] = {}  # code object -> what to do when it is called
        self.previous: Any = None

    def __enter__(self) -> PythonCalls:
        self.previous = sys.getprofile()
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self.previous)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        # Called for every Python and C call and return of the construction (150,000 events for the GPT 350M): the few
        # it looks for are told apart here, inline (the hook's own time was a fifth of the recording's).
        if self.previous is not None:
            self.previous(frame, event, arg)
        if event == "call":
            code = frame.f_code
            if code in self.stop_at or code in self.whole or code is self.set_state:
                self._call(frame)
        elif event == "return":
            if (self.open and frame is self.open[-1]) or frame.f_code is self.get_state:
                self._return(frame, arg)
        elif event == "c_call":
            # `is_generator` (torch_compat.tensors) written out: this line runs for every C call of the construction
            if issubclass(type(getattr(arg, "__self__", None)), _GENERATOR):
                self._generator_call(arg.__self__, arg.__name__)

    def _generator_call(self, generator: torch.Generator, method: str) -> None:
        """A generator's state set (its skipped draws forgiven) or read (they are drawn first), by any caller."""
        if INTERNAL.active or self.rng._reading:  # the recorder's own reads
            return
        if method in ("manual_seed", "seed", "set_state", "graphsafe_set_state"):
            SKIPPED.forget(generator)
            if generator is torch.default_generator:
                self.rng.last = b""  # a "set" even to the state it holds: the eager stream stood elsewhere
        elif method in ("get_state", "graphsafe_get_state"):
            self.recorder.settle(generator)

    def _call(self, frame: Any) -> None:
        code = frame.f_code
        if code in self.stop_at:
            self.stop_at[code]()
            return
        if self.recorder.suspended:
            return
        if code is self.set_state:
            self.rng.check()
            if not self.rng.restoring(frame.f_locals.get("new_state")):
                return  # a state from elsewhere: the generator watch records the state it leaves
            # what the generator does to the state tensor inside is no construction's (and the state it sets is
            # recorded already)
            self.open.append(frame)
            self.recorder.suspended += 1
        elif code in self.whole:
            tensor = frame.f_locals.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                self._record_whole(self.whole[code], frame, tensor)

    def _record_whole(self, function: Callable[..., Any], frame: Any, tensor: torch.Tensor) -> None:
        self.rng.check()
        parameters = list(_signature(function).parameters)
        kwargs = {name: frame.f_locals[name] for name in parameters[1:] if name in frame.f_locals}
        ref = TensorRef.of(tensor)
        self.log.storages.setdefault(ref.storage, tensor.untyped_storage())
        overwritten = frozenset({ref.storage}) if ref.whole else frozenset()
        updates = () if ref.whole else (ref,)
        random = function.__name__ != "dirac_"
        op = new_op(function, (ref,), recorded_args(kwargs), [], (ref,), (), updates, overwritten, random, False)
        self.log.ops.append(op)
        self.recorder.owe(op)
        self.open.append(frame)
        self.recorder.suspended += 1

    def _return(self, frame: Any, value: Any) -> None:
        if self.open and frame is self.open[-1]:
            self.open.pop()
            self.recorder.suspended -= 1
            if frame.f_code is self.set_state:
                self.rng.explained()
        elif frame.f_code is self.get_state and not self.recorder.suspended and isinstance(value, torch.Tensor):
            self.rng.check()
            self.rng.saved_state(value)


@functools.cache
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(function)
