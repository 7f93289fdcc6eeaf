"""Record: what building a model on the meta device did, so that materialisation can do it again exactly.

On the meta device nothing has values, so the code that initialises a model (``reset_parameters()``, ``nn.init.*``,
``torch.ones``, a rotary table computed from ``arange``, a cast, a deep copy, a library's own init such as peft's LoRA)
computes nothing. :func:`record_construction` (or a :class:`Recording` started and stopped by
:mod:`lightning_shard.init.meta_window`) takes the code run inside and gives a
:class:`~lightning_shard.init.construction_log.ConstructionLog` noting, in program order:

* every ATen op that creates, reads or writes a meta tensor (at the dispatch level, whatever Python name called it),
  with each meta tensor as the op saw it (:class:`~lightning_shard.init.construction_log.TensorRef`: its storage and
  its view of it at that moment, so that a later ``.data`` swap, as ``Module.to()`` makes, does not change what the op
  read), and every random op on real tensors (it advances the random stream of an eager build):
  :mod:`lightning_shard.init.op_recorder`;
* the calls of the ``torch.nn.init`` functions that do nothing to a meta tensor (``trunc_normal_``, ``orthogonal_``,
  ``sparse_``, ``dirac_``: their draws depend on values), however they were imported, as one op each:
  :mod:`lightning_shard.init.python_calls`;
* the random generator's state changes that are not tensor ops
  (:class:`~lightning_shard.init.construction_log.RngEvent`): ``manual_seed``, ``seed``, ``set_rng_state`` and
  ``fork_rng`` by any name, found by comparing the generator's state before each op:
  :mod:`lightning_shard.init.rng_watch`;
* each registration of a submodule, parameter or buffer, with the modules whose constructors were running (here);
* at its end, where each meta tensor is held, and the log on each module of the model
  (:func:`~lightning_shard.init.construction_log.note_held`).

:mod:`lightning_shard.init.replay` replays the ops on real tensors after sharding, in the same order and from the same
random stream, so the weights equal an eager build whatever code initialised them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from lightning_shard.init.construction_log import (
    ABSENT,
    SEQUENCE,
    ConstructionLog,
    Registration,
    TensorRef,
    note_held,
)
from lightning_shard.init.op_recorder import (
    DataFactories,
    OpRecorder,
    modules_under_construction,
    python_calls_unwatched,
)
from lightning_shard.init.python_calls import PythonCalls
from lightning_shard.init.rng_watch import GeneratorWatch
from lightning_shard.torch_compat.dispatch import remove_mode, torch_functions_off
from lightning_shard.torch_compat.tensors import storage_key


class Recording:
    """A recording in progress (see module docstring): :meth:`start`, then :meth:`stop` (:func:`record_construction`
    is the scoped form). Between them it can step aside (:meth:`pause`, :meth:`resume`) so that a context entered
    before it (the meta device) can leave first: a model stays recorded after its build until it is set up
    (:mod:`lightning_shard.init.meta_window`).

    Example:
        >>> recording = Recording().start()
        >>> recording.stop().ops
        []
    """

    def __init__(self, owes_draws: bool = True) -> None:
        self.log = ConstructionLog(rng_start=torch.default_generator.get_state())
        self.rng = GeneratorWatch(self.log)
        self.recorder = OpRecorder(self.log, self.rng, owes_draws)
        self.calls = PythonCalls(self.log, self.recorder, self.rng)
        self.factories = DataFactories(self.log, self.recorder, self.rng)
        self.handles: list[Any] = []
        self.modes: list[Any] = []  # the modes pushed now, innermost last

    def start(self, resume: bool = True) -> Recording:
        self.handles = [
            register_module_module_registration_hook(self._registered("_modules")),
            register_module_parameter_registration_hook(self._registered("_parameters")),
            register_module_buffer_registration_hook(self._registered("_buffers")),
        ]
        self.calls.__enter__()
        return self.resume() if resume else self

    def resume(self, factories: bool = True) -> Recording:
        """Push the op recorder, and the data factories' recorder (needed where the meta device is the default)."""
        for mode in (self.recorder, self.factories) if factories else (self.recorder,):
            mode.__enter__()
            self.modes.append(mode)
        return self

    def pause(self) -> None:
        """Pop the modes :meth:`resume` pushed, wherever they are on the mode stacks."""
        while self.modes:
            remove_mode(self.modes.pop())

    def stop(self) -> ConstructionLog:
        """End the recording; the log notes where each meta tensor is held now."""
        self.pause()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.calls.__exit__()
        self.rng.check()
        self.log.rng_end = torch.default_generator.get_state()
        note_held(self.log)
        return self.log

    def _registered(self, table: str) -> Callable[[nn.Module, str, Any], None]:
        log = self.log

        def hook(parent: nn.Module, name: str, value: Any) -> None:
            # the recorder's own work: no Python call of it for the call watch, no tensor method for the modes
            with python_calls_unwatched(), torch_functions_off():
                _note(parent, name, value)

        def _note(parent: nn.Module, name: str, value: Any) -> None:
            old = parent.__dict__[table].get(name, ABSENT)
            seq = next(SEQUENCE)
            ref = None
            if isinstance(value, torch.Tensor) and value.is_meta:
                log.storages.setdefault(storage_key(value), value.untyped_storage())
                ref = TensorRef.of(value)
            constructing = modules_under_construction()
            log.registrations.append(Registration(seq, parent, table, name, old, value, constructing, ref))
            log.modules[id(parent)] = parent
            if isinstance(value, nn.Module):
                log.modules[id(value)] = value

        return hook


@contextmanager
def record_construction() -> Iterator[ConstructionLog]:
    """Record the construction of the modules built inside (see module docstring); each module seen keeps the log.

    Example:
        >>> from lightning_shard.init.construction_log import construction_logs
        >>> with torch.device("meta"), record_construction() as log:
        ...     model = nn.Sequential(nn.Linear(2, 2))
        >>> construction_logs(model) == [log]
        True
    """
    recording = Recording().start()
    try:
        yield recording.log
    finally:
        recording.stop()


@contextmanager
def written_storages() -> Iterator[set[int]]:
    """The storages of the meta tensors that the code run inside writes in place (filled in on exit), recorded as a
    construction is, without a log on any module: what an initialisation would set, found on the meta device, where
    it draws nothing.

    Example:
        >>> weight = torch.empty(2, device="meta")
        >>> with written_storages() as written:
        ...     _ = nn.init.ones_(weight)
        >>> written == {storage_key(weight)}
        True
    """
    recording = Recording(owes_draws=False)
    written: set[int] = set()
    try:
        with recording.calls:
            recording.resume()
            try:
                yield written
            finally:
                recording.pause()
    finally:
        written.update(ref.storage for op in recording.log.ops for ref in op.writes)
