"""The recording of a model built on the meta device lasts until the model is set up.

Between ``fabric.init_module(empty_init=True)`` (or ``configure_model()``) and setup, code may still act on the meta
tensors: litgpt's pretraining script overrides each module's ``reset_parameters`` with the GPT-NeoX init and calls them,
users call ``model.apply(init)`` or tie weights. On the meta device that computes nothing, so it must be recorded to be
replayed. So :func:`meta_window` starts a recording (:class:`~lightning_shard.init.construction.Recording`) that
outlives
its block: at the block's end it steps aside while the meta device's context leaves, then records on (the ops on meta
tensors, the random draws, the registrations) until :func:`end_meta_window` - called where setup starts sharding, or
when the next model is started on the meta device, or when ``fully_shard`` or ``parallelize_module`` is called on
it by hand. A meta tensor changed after its recording ended is refused before
sharding, naming it (:func:`refuse_changes_after_recording`).

Example:
    >>> with meta_window(torch.device("meta")):
    ...     layer = torch.nn.Linear(2, 2)
    >>> _ = torch.nn.init.zeros_(layer.bias)  # recorded too
    >>> end_meta_window()
"""

from __future__ import annotations

import atexit
import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch  # noqa: F401  (the example)
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from lightning_shard.init.construction import Recording
from lightning_shard.init.construction_log import construction_logs
from lightning_shard.torch_compat.modules import visible_name

_OPEN: list[Recording] = []  # the recording still open after its block, at most one
_SHARDING_CODES = (inspect.unwrap(fully_shard).__code__, inspect.unwrap(parallelize_module).__code__)


@contextmanager
def meta_window(*contexts: AbstractContextManager) -> Iterator[None]:
    """Record what runs inside ``contexts`` (entered in order, the meta device among them) and after them, until
    :func:`end_meta_window`. A block that built nothing ends its recording at once.

    Example:
        >>> with meta_window(torch.device("meta")):
        ...     pass
        >>> _OPEN
        []
    """
    end_meta_window()
    recording = Recording().start(resume=False)
    _OPEN.append(recording)
    try:
        with ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            recording.resume()
            stack.callback(recording.pause)  # first out: the contexts entered before leave after it
            yield
    except BaseException:
        end_meta_window()
        raise
    if recording.log.ops or recording.log.registrations:
        recording.resume(factories=False)  # ops on meta tensors need no meta default device to be seen
        # Sharding the model by hand after its block (not in `configure_model()`) ends its construction.
        recording.calls.stop_at = dict.fromkeys(_SHARDING_CODES, end_meta_window)
    else:
        end_meta_window()


def end_meta_window() -> None:
    """End the open recording, if any (its log stays on the modules it saw, for their materialisation).

    Example:
        >>> end_meta_window()
    """
    while _OPEN:
        _OPEN.pop().stop()


def refuse_changes_after_recording(root: nn.Module) -> None:
    """Refuse ``root``'s meta tensors changed in place after their recording ended (by code run once another model was
    started on the meta device): what changed them cannot be replayed, and dropping it would be silent. Call before
    anything else acts on the model (sharding moves tensors).

    Example:
        >>> refuse_changes_after_recording(torch.nn.Linear(2, 2))
    """
    modules = {id(module): (name, module) for name, module in root.named_modules()}
    changed = [
        visible_name(".".join(filter(None, [modules[module_id][0], name])))
        for log in construction_logs(root)
        for (module_id, table, name), (tensor_id, version) in log.versions.items()
        if module_id in modules
        and id(live := modules[module_id][1].__dict__[table].get(name)) == tensor_id
        and live._version != version
    ]
    if changed:
        raise RuntimeError(
            f"{changed[:8]} were changed on the meta device after their recording ended (by code run after another "
            "model was started on the meta device), so what changed them cannot be replayed. Finish initialising a "
            "model before starting the next one on the meta device, or set each up before building the next."
        )


atexit.register(end_meta_window)  # a model never set up: its recording ends with the interpreter, not after torch
