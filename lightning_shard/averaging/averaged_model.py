"""``ShardedAveragedModel``: torch's ``AveragedModel`` (EMA / SWA) for a model sharded by ``fully_shard``.

torch's ``AveragedModel`` deep-copies the model it averages and updates the copy parameter by parameter. On a sharded
model that copy is either the whole unsharded model on every rank (a copy made before sharding) or fails at the first
update (``aten.copy_.default got mixed torch.Tensor and DTensor``). Here the averaged copy is built beside the sharded
parameters instead, as the per-parameter state FSDP2 already keeps (gradients, optimizer states):

* one tensor per parameter and buffer, in fp32 whatever the training precision (a bf16 copy would not move: an EMA
  increment of ``(1 - 0.999) x`` a bf16 weight rounds to zero), with the parameter's placements: a DTensor holding
  this rank's shard, 1/N of the parameter. Nothing is ever gathered whole on one rank.
* ``update_parameters`` after each optimizer step works on the local shards only, with one ``_foreach`` call per
  device and dtype (``torch._foreach_lerp_`` for EMA): no communication, no DTensor dispatch. ``avg_fn``,
  ``multi_avg_fn`` and ``use_buffers`` mean what they mean for ``AveragedModel``; torch's own
  ``get_ema_avg_fn`` / ``get_swa_avg_fn`` (Lightning's ``EMAWeightAveraging`` passes the first) run as their foreach
  forms, any other ``avg_fn`` tensor by tensor. Both see local shards, so they must be elementwise, as every
  averaging function in torch is.
* ``device="cpu"`` keeps the copy in CPU memory (pinned when the shards are on a GPU, so the copies each step are
  fast); by default it sits beside each shard (on the GPU, or in CPU memory under FSDP's CPU offload).
* :meth:`swapped_in` puts the averaged values into the model's shards and back (for validation), :meth:`copy_to`
  for good (at the end of training). The exchange is in place when the parameter is fp32; a 16-bit parameter's
  trained values wait in a copy meanwhile, so the fp32 average is never rounded.
* It is an ``nn.Module`` whose ``state_dict`` is ``AveragedModel``'s - ``module.<name>`` for each parameter and
  persistent buffer (the model's state-dict names), plus ``n_averaged`` - so checkpoints save and load it through
  the same torch.distributed.checkpoint calls as the model: sharded, resharded on load, or gathered into a full file
  (which ``AveragedModel(model).load_state_dict`` reads).

Example:
    >>> from torch.optim.swa_utils import get_ema_multi_avg_fn
    >>> model = fabric.setup(model)  # doctest: +SKIP
    >>> ema = ShardedAveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))  # doctest: +SKIP
    >>> optimizer.step(); ema.update()  # doctest: +SKIP
    >>> with ema.swapped_in():  # doctest: +SKIP
    ...     validate(model)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from lightning.fabric.wrappers import _unwrap_objects
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_swa_avg_fn, get_swa_multi_avg_fn

from lightning_shard.memory.accounting import local_tensor
from lightning_shard.plan.direct_calls import drop_gathered_parameters
from lightning_shard.torch_compat.modules import is_persistent_buffer, visible_name
from lightning_shard.torch_compat.optim import foreach_form

AvgFn = Callable[[Tensor, Tensor, Tensor], Tensor]
MultiAvgFn = Callable[[Sequence[Tensor], Sequence[Tensor], Tensor], None]

# Current values that need a cast or a copy to another device before averaging are converted this many bytes at a
# time: the conversion's temporaries stay small next to the copy itself.
_CONVERSION_BUCKET_BYTES = 64 * 2**20


def averaged_placement(
    requested: torch.device | str | int | None, shard_device: torch.device
) -> tuple[torch.device, bool]:
    """Where the averaged copy of a shard held on ``shard_device`` lives, and whether in pinned memory.

    ``None``: beside the shard. ``"cpu"`` for a shard on a GPU: pinned CPU memory (the copies between them each
    step run at full speed). A device type without an index (``"cuda"``) means the shard's own device of that type.

    Example:
        >>> averaged_placement("cpu", torch.device("cuda", 1))
        (device(type='cpu'), True)
        >>> averaged_placement("cuda", torch.device("cuda", 1))
        (device(type='cuda', index=1), False)
    """
    if requested is None:
        return shard_device, False
    device = torch.device("cuda", requested) if isinstance(requested, int) else torch.device(requested)
    if device.type == shard_device.type and device.index is None:
        device = shard_device
    return device, device.type == "cpu" and shard_device.type == "cuda"


@dataclass(frozen=True)
class _Slot:
    """One parameter or buffer of the model (``owner.<attribute>``) and the local tensor of its averaged copy."""

    owner: nn.Module
    attribute: str
    is_parameter: bool
    averaged: Tensor

    def current(self) -> Tensor:
        """This rank's part of the model's tensor now: the local shard of a DTensor, a buffer as it is."""
        return local_tensor(getattr(self.owner, self.attribute))


class ShardedAveragedModel(nn.Module):
    """The averaged copy (EMA, SWA) of a sharded ``model``: ``torch.optim.swa_utils.AveragedModel``'s arguments and
    methods, with the copy held as fp32 shards beside the model's (see the module docstring).

    Args:
        model: the model after sharding (what ``fabric.setup`` returns, or the LightningModule after the strategy's
            ``setup``). Its values now are the copy's start (``AveragedModel`` copies the model too); the first
            update replaces them.
        device: where the copy lives: ``None`` beside each shard, ``"cpu"`` in (pinned) CPU memory.
        avg_fn: ``(averaged, current, n_averaged) -> new averaged``, as for ``AveragedModel``; default: the equal
            average (SWA).
        multi_avg_fn: ``(averaged list, current list, n_averaged) -> None`` updating in place, as for
            ``AveragedModel`` (``get_ema_multi_avg_fn(decay)`` for EMA).
        use_buffers: average the buffers too; otherwise the copy's buffers follow the model's at each update.

    Example:
        >>> from torch.optim.swa_utils import get_ema_multi_avg_fn
        >>> ema = ShardedAveragedModel(sharded_model, multi_avg_fn=get_ema_multi_avg_fn(0.999))  # doctest: +SKIP
        >>> ema.update()  # after each optimizer.step()  # doctest: +SKIP
    """

    n_averaged: Tensor

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str | int | None = None,
        avg_fn: AvgFn | None = None,
        multi_avg_fn: MultiAvgFn | None = None,
        use_buffers: bool = False,
    ) -> None:
        super().__init__()
        if avg_fn is not None and multi_avg_fn is not None:
            raise ValueError("Pass `avg_fn` or `multi_avg_fn`, not both (as for torch's AveragedModel).")
        self.avg_fn = avg_fn
        self.multi_avg_fn = multi_avg_fn
        self.use_buffers = use_buffers
        # Lightning's EMAWeightAveraging passes torch's `get_ema_avg_fn`: it runs as its foreach form. Integer buffers
        # (`num_batches_tracked`) go tensor by tensor unless the user's `multi_avg_fn` takes them: torch's foreach SWA
        # cannot divide integers.
        default = get_swa_multi_avg_fn() if avg_fn is None else None
        self._foreach_fn = multi_avg_fn or foreach_form(avg_fn) or default
        self._tensor_fn = avg_fn or get_swa_avg_fn()
        model = _unwrap_objects(model)  # Fabric's wrapper: the sharded module inside
        self._model = weakref.ref(model)  # not a submodule: the model's tensors are not this module's state
        self.module = nn.Module()
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long))
        drop_gathered_parameters(model)  # the module attributes must be the sharded parameters
        with torch.no_grad():
            self._slots = self._build_copy(model, device)
        # The model's values while the averaged ones are swapped in: None when not swapped in; per slot, None where
        # the values were exchanged in place.
        self._stashed: list[Tensor | None] | None = None

    # ------------------------------------------------------------------ AveragedModel's methods

    def forward(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            "The averaged copy of a sharded model holds shards, not a runnable model: run the model itself with the "
            "averaged weights swapped in, `with averaged.swapped_in(): model(...)`."
        )

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Average the model's current values into the copy (``AveragedModel.update_parameters``); call after each
        optimizer step. The first call copies them."""
        model = self._check_model(model, "update_parameters")
        if self._stashed is not None:
            raise RuntimeError("The averaged weights are swapped into the model: swap them out before updating.")
        drop_gathered_parameters(model)
        averaged = [slot for slot in self._slots if slot.is_parameter or self.use_buffers]
        if int(self.n_averaged) == 0:
            for slot in averaged:
                slot.averaged.copy_(slot.current())
        else:
            for averaged_values, current_values in _converted([(slot.averaged, slot.current()) for slot in averaged]):
                self._average(averaged_values, current_values)
        if not self.use_buffers:
            for slot in self._slots:
                if not slot.is_parameter:
                    slot.averaged.copy_(slot.current())
        self.n_averaged += 1

    def update(self) -> None:
        """``update_parameters`` of the model this copy was made from: call after each ``optimizer.step()``."""
        self.update_parameters(self._bound_model())

    # ------------------------------------------------------------------ into the model

    @contextmanager
    def swapped_in(self) -> Generator[None, None, None]:
        """The model computes with the averaged values inside the block (validation, sampling); its own come back
        after it. Each rank swaps its own shards, without communication; the model's calls inside the block gather
        as always, so every rank makes them."""
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the averaged values into the model's shards, keeping the model's own for :meth:`swap_out`."""
        if self._stashed is not None:
            raise RuntimeError("The averaged weights are swapped into the model already.")
        model = self._bound_model()
        drop_gathered_parameters(model)
        self._stashed = [_exchange(slot) for slot in self._slots]
        drop_gathered_parameters(model)

    @torch.no_grad()
    def swap_out(self) -> None:
        """Give the model its own values back after :meth:`swap_in`."""
        if self._stashed is None:
            raise RuntimeError("The averaged weights are not swapped into the model.")
        model = self._bound_model()
        drop_gathered_parameters(model)
        for slot, stashed in zip(self._slots, self._stashed, strict=True):
            if stashed is None:
                _exchange(slot)
            else:
                slot.current().copy_(stashed)
        self._stashed = None
        drop_gathered_parameters(model)

    @property
    def is_swapped_in(self) -> bool:
        return self._stashed is not None

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite the model's values with the averaged ones (Lightning's callbacks do at the end of training)."""
        model = self._check_model(model, "copy_to")
        if self._stashed is not None:
            raise RuntimeError("The averaged weights are swapped into the model: swap them out first.")
        drop_gathered_parameters(model)
        for slot in self._slots:
            slot.current().copy_(slot.averaged)
        drop_gathered_parameters(model)

    def local_bytes(self) -> int:
        """Bytes this rank holds for the copy (the averaged shards and buffers)."""
        return sum(slot.averaged.numel() * slot.averaged.element_size() for slot in self._slots)

    # ------------------------------------------------------------------ building and averaging

    def _build_copy(self, model: nn.Module, device: torch.device | str | int | None) -> list[_Slot]:
        """Register an averaged tensor in ``self.module`` under each state name of the model (tied names share one),
        starting from the model's values; return the slots that pair them."""
        slots: list[_Slot] = []
        copies: dict[int, Tensor] = {}  # id of the model's tensor -> its copy, for tied parameters
        named = [(name, tensor, True) for name, tensor in model.named_parameters(remove_duplicate=False)]
        named += [(name, tensor, False) for name, tensor in model.named_buffers(remove_duplicate=False)]
        for name, tensor, is_parameter in named:
            owner_name, _, attribute = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            copy = copies.get(id(tensor))
            if copy is None:
                copy = copies[id(tensor)] = _averaged_like(tensor, device)
                slots.append(_Slot(owner, attribute, is_parameter, local_tensor(copy)))
            shadow_owner_name, _, shadow_attribute = visible_name(name).rpartition(".")
            shadow_owner = _submodule(self.module, shadow_owner_name)
            if is_parameter:
                shadow_owner.register_parameter(shadow_attribute, nn.Parameter(copy, requires_grad=False))
            else:
                shadow_owner.register_buffer(shadow_attribute, copy, persistent=is_persistent_buffer(owner, attribute))
        return slots

    def _average(self, averaged: list[Tensor], current: list[Tensor]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for average, value in zip(averaged, current, strict=True):
            group = groups.setdefault((average.device, average.dtype), ([], []))
            group[0].append(average)
            group[1].append(value)
        for (device, dtype), (averages, values) in groups.items():
            n_averaged = self.n_averaged.to(device)
            if self._foreach_fn is not None and (self.multi_avg_fn is not None or dtype.is_floating_point):
                self._foreach_fn(averages, values, n_averaged)
                continue
            for average, value in zip(averages, values, strict=True):
                average.copy_(self._tensor_fn(average, value, n_averaged))

    def _bound_model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("The model this averaged copy was made from no longer exists.")
        return model

    def _check_model(self, model: nn.Module, method: str) -> nn.Module:
        """The (unwrapped) model this copy was made from, if ``model`` is it."""
        bound = self._bound_model()
        if _unwrap_objects(model) is not bound:
            raise ValueError(
                f"`{method}` got a model other than the one this averaged copy was made from; its values are paired "
                "with that model's shards."
            )
        return bound


def _averaged_like(tensor: Tensor, device: torch.device | str | int | None) -> Tensor:
    """The averaged copy of one parameter or buffer: floating point in at least fp32, on ``device``, a DTensor with
    ``tensor``'s placements if it is one; it starts from the tensor's values."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()
    dtype = torch.promote_types(local.dtype, torch.float32) if local.is_floating_point() else local.dtype
    placed, pinned = averaged_placement(device, local.device)
    copy = torch.empty(local.shape, dtype=dtype, device=placed, pin_memory=pinned)
    copy.copy_(local)
    if not isinstance(tensor, DTensor):
        return copy
    return DTensor.from_local(
        copy, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def _submodule(root: nn.Module, path: str) -> nn.Module:
    """``root``'s submodule at the dotted ``path``, created (empty) where missing."""
    module = root
    for part in path.split(".") if path else ():
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    return module


def _exchange(slot: _Slot) -> Tensor | None:
    """Put the slot's other value into the model: exchanged in place when their dtypes agree (lossless; returns
    None), else the model's value is returned to be kept aside, so that the fp32 average is never rounded to the
    model's dtype."""
    current = slot.current()
    kept = current.clone()
    current.copy_(slot.averaged)
    if current.dtype != slot.averaged.dtype:
        return kept
    slot.averaged.copy_(kept)
    return None


def _converted(pairs: list[tuple[Tensor, Tensor]]) -> Iterator[tuple[list[Tensor], list[Tensor]]]:
    """``(averaged, current)`` lists for the averaging functions, which need both in one dtype and on one device:
    pairs that already agree go as they are, in one list; the others with their current values converted,
    ``_CONVERSION_BUCKET_BYTES`` at a time."""
    direct: tuple[list[Tensor], list[Tensor]] = ([], [])
    bucket: tuple[list[Tensor], list[Tensor]] = ([], [])
    size = 0
    for average, value in pairs:
        if value.dtype == average.dtype and value.device == average.device:
            direct[0].append(average)
            direct[1].append(value)
            continue
        bucket[0].append(average)
        bucket[1].append(value.to(device=average.device, dtype=average.dtype))
        size += average.numel() * average.element_size()
        if size >= _CONVERSION_BUCKET_BYTES:
            yield bucket
            bucket, size = ([], []), 0
    for lists in (bucket, direct):
        if lists[0]:
            yield lists
