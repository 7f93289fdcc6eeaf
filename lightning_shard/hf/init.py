"""Hugging Face models built on the meta device, initialised as transformers initialises them.

The rule (it extends :mod:`lightning_shard.materialize`): a ``transformers.PreTrainedModel`` in the tree is
initialised, at its place in ``modules()`` order, by its own ``_initialize_weights`` / ``_init_weights``, module by
module in transformers' order (``initialize_weights``: children before parents, nested ``PreTrainedModel``\\ s with
their own init), on full-size tensors of one module at a time, from rank 0's random stream. ``_init_weights`` also
recomputes the buffers a constructor computes (rotary ``inv_freq``), and the weights tied in the constructor
(``tie_weights``) stay one parameter through sharding.

An eager build draws twice: each constructor's torch init (``nn.Linear.reset_parameters``, GPT-2's ``Conv1D``)
and then transformers' init at the end of each ``PreTrainedModel.__init__`` (``post_init``). On the meta device the
constructors draw nothing, so :func:`record_constructor_draws` records those draws while the model is built and
materialisation replays them, in order, into scratch tensors: for the same seed the weights and buffers equal an
eager build on one process. (transformers' own meta-device loading does not replay them, so its random init of
missing weights differs from an eager build.)

transformers stays optional: nothing here imports it; a model is a ``PreTrainedModel`` only if transformers is
already imported and says so.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_shard.torch_compat import TorchDispatchMode, draws_random_numbers, tree_map

if TYPE_CHECKING:
    from lightning_shard.materialize import FullSizeParameters

# Set on a PreTrainedModel built under `record_constructor_draws`: its constructors' random draws, in order.
_DRAWS = "_lightning_shard_constructor_draws"


def pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel`` if transformers is imported, else ``None`` (never imports it).

    Example:
        >>> pretrained_model_class() is None or pretrained_model_class().__name__ == "PreTrainedModel"
        True
    """
    return getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)


def is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``PreTrainedModel``.

    Example:
        >>> is_pretrained_model(nn.Linear(2, 2))
        False
    """
    cls = pretrained_model_class()
    return cls is not None and isinstance(module, cls)


def outermost_pretrained_models(root: nn.Module) -> list[nn.Module]:
    """The ``PreTrainedModel``\\ s in ``root`` (``root`` included) that are not inside another one.

    Example:
        >>> outermost_pretrained_models(nn.Sequential(nn.Linear(2, 2)))
        []
    """
    if pretrained_model_class() is None:
        return []
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if is_pretrained_model(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(root)
    return found


@contextmanager
def record_constructor_draws() -> Iterator[None]:
    """Record the random draws that ``PreTrainedModel`` constructors make on the meta device (see module docstring).

    Example:
        >>> with torch.device("meta"), record_constructor_draws():
        ...     layer = nn.Linear(2, 2)  # not inside a PreTrainedModel: nothing is recorded
    """
    recorder = _DrawRecorder()
    with recorder:
        yield
    by_model: dict[int, list[tuple[Any, ...]]] = {}
    for func, args, kwargs, chain in recorder.events:
        by_model.setdefault(id(chain[0]), []).append((func, args, kwargs, tuple(id(m) for m in chain)))
    for model in recorder.models.values():
        model.__dict__[_DRAWS] = by_model.get(id(model), [])


class _DrawRecorder(TorchDispatchMode):
    """Notes every random op on a meta tensor made while a ``PreTrainedModel.__init__`` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[Any, tuple, dict, tuple[nn.Module, ...]]] = []
        self.models: dict[int, nn.Module] = {}  # the outermost models built

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _draws_random_numbers(func) and isinstance(out, torch.Tensor) and out.is_meta:
            chain = _pretrained_models_under_construction()
            if chain:
                self.events.append((func, args, kwargs, chain))
                self.models[id(chain[0])] = chain[0]
        return out


_draws_random_numbers = cache(draws_random_numbers)


def _pretrained_models_under_construction() -> tuple[nn.Module, ...]:
    """The ``PreTrainedModel``\\ s whose ``__init__`` is on the call stack, outermost first."""
    cls = pretrained_model_class()
    if cls is None:
        return ()
    chain: list[nn.Module] = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            if isinstance(obj, cls) and not any(obj is m for m in chain):
                chain.append(obj)
        frame = frame.f_back
    return tuple(reversed(chain))


def initialize_hf_model(model: nn.Module, device: torch.device, swap: FullSizeParameters) -> None:
    """Initialise the sharded, freshly allocated ``model`` (a ``PreTrainedModel``) as transformers would: load its
    pretrained files when it was built by :func:`lightning_shard.hf.from_pretrained`, then run transformers' init
    for everything not loaded (replaying the constructors' draws first when nothing is loaded).

    Raises:
        RuntimeError: naming a tensor that transformers' init leaves uninitialised.
    """
    from lightning_shard.hf.pretrained import load_pretrained_shards  # the loader needs DCP; keep this light

    draws = model.__dict__.pop(_DRAWS, [])
    buffers = [(name, b) for name, b in model.named_buffers() if b.is_floating_point()]
    with torch.no_grad():
        for _, buffer in buffers:
            buffer.fill_(float("nan"))  # so that a buffer transformers' init does not compute is caught below
    loaded = load_pretrained_shards(model)
    if loaded:
        draws = []  # as transformers' from_pretrained: missing weights are drawn from the current stream
    hf_swap = swap.with_policy("nan", keep=lambda p: getattr(p, "_is_hf_initialized", False))
    members = {id(m): m for m in model.modules()}
    with torch.no_grad(), _guard_torch_init_functions():
        for step in _init_steps(model, draws):
            if isinstance(step, int):
                _initialize_like_transformers(members[step], hf_swap)
            else:
                _replay_draw(*step, device=device)
    unset = [name for name, buffer in buffers if bool(buffer.isnan().any())]
    if unset:
        raise RuntimeError(
            f"{type(model).__name__} was built on the meta device, but its `_init_weights` does not compute these "
            f"buffers: {unset}. Build the model in `__init__` instead of `configure_model()`."
        )


def _init_steps(model: nn.Module, draws: list[tuple[Any, ...]]) -> list[Any]:
    """The eager build's order: replay a draw (a tuple), or run one model's transformers init (its id).

    Each ``PreTrainedModel``'s init runs where its constructor ended: before the first draw made outside it.
    """
    steps: list[Any] = []
    done: set[int] = set()
    open_chain: tuple[int, ...] = ()
    for func, args, kwargs, chain in draws:
        for model_id in reversed(open_chain):
            if model_id not in chain and model_id not in done:
                steps.append(model_id)
                done.add(model_id)
        steps.append((func, args, kwargs))
        open_chain = chain
    for model_id in (*reversed(open_chain), id(model)):
        if model_id not in done:
            steps.append(model_id)
            done.add(model_id)
    return steps


def _replay_draw(func: Any, args: tuple, kwargs: dict, device: torch.device) -> None:
    """Run a recorded random op on scratch tensors of the same size: the stream advances as in an eager build."""

    def real(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_meta:
            return torch.empty(value.shape, dtype=value.dtype, device=device)
        if isinstance(value, torch.device) and value.type == "meta":
            return device
        return value

    func(*tree_map(real, args), **tree_map(real, kwargs))


def _initialize_like_transformers(model: nn.Module, swap: FullSizeParameters) -> None:
    """transformers' ``initialize_weights`` (its ``smart_apply``: children first, a nested ``PreTrainedModel`` with
    its own ``_initialize_weights``), one module's full-size parameters at a time. A module's direct children keep
    their full-size parameters until it has run: some inits set a child's weight (GPT-2's ``c_proj``)."""
    extra = (model.is_custom_code(),) if hasattr(model, "is_custom_code") else ()

    def visit(module: nn.Module, init_fn: Any) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if is_pretrained_model(child) else init_fn)
        if not getattr(module, "_is_hf_initialized", False):
            swap.swap_in(module)
            init_fn(module, *extra)
            swap.mark_initialized(module)
        for child in module.children():
            swap.write_back(child)

    visit(model, model._initialize_weights)
    swap.write_back(model)


def _guard_torch_init_functions() -> Any:
    """transformers' guard around ``initialize_weights``: torch's init functions skip tensors already loaded."""
    guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", None)
    return guard() if guard is not None else nullcontext()
