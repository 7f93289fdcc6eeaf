"""What a checkpoint holds besides the model and the optimizers - a Fabric program's own entries, what a
LightningModule or a callback adds in ``on_save_checkpoint`` - kept exactly, on every rank.

Those entries are pickled whole (torch.distributed.checkpoint keeps one rank's pickle of each; a full file is written
by rank 0), which is right for what every rank holds alike (loop counters, hyper-parameters, a ``ModelCheckpoint``'s
scores) and loses the rest: a DTensor pickles as this rank's shard, and whatever differs between ranks (per-rank RNG
states, a rank's own statistics) comes back as one rank's. So before a save, every rank describes each entry - its
pickle with the tensors left out, a digest of each plain tensor's bytes, its DTensors - and one gather
compares them. An entry that is the same on every rank and holds no DTensor is saved as before (readable with plain
``torch.load`` / ``dcp_to_torch_save``). The others move into one entry, :data:`EXTRA_KEY`, the same in both formats:

* ``"dtensors"``: ``{key: {"0": tensor, ...}}``, each DTensor of an entry, sharded as it is (sharded format: a DCP
  tensor written by every rank; full format: gathered to rank 0).
* ``"replicated"``: ``{key: record}`` for an entry that is the same on every rank but holds DTensors;
  ``"per_rank"``: ``{key: {"<rank>": record}}`` for an entry that differs between ranks, one record per rank.
  A record is ``{"pickle": bytes, "tensors": {"0": tensor, ...}}``: the entry pickled with each tensor replaced by a
  persistent id (``("tensor", i)`` for its i-th plain tensor, ``("dtensor", i, placements, mesh_dim_names)``).
* ``"world_size"``: the world size that saved it.

A load (:func:`decode_extra`) puts each entry back: plain tensors as they were, DTensors with their placements on the
model's device mesh (each rank keeps its part of the whole tensor, read whole: extra DTensors are read on every rank
in full), per-rank entries as this rank saved them. At another world size a per-rank entry has no exact meaning:
rank ``r`` gets what rank ``r % saved_world_size`` saved, with a warning naming the entries.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import warnings
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_shard.checkpoint.ranks import all_gathered, rank, world_size

# The checkpoint entry that holds the entries kept per rank or holding DTensors; Lightning ignores keys it does not
# know.
EXTRA_KEY = "sharded_extra_state"


class _TensorsOut(pickle.Pickler):
    """Pickles an entry with its tensors replaced by persistent ids, collecting them."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.plain: list[torch.Tensor] = []
        self.dtensors: list[DTensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, DTensor):
            self.dtensors.append(obj)
            mesh = obj.device_mesh
            return ("dtensor", len(self.dtensors) - 1, tuple(obj.placements), mesh.mesh_dim_names, mesh.ndim)
        if isinstance(obj, torch.Tensor):
            self.plain.append(obj)
            return ("tensor", len(self.plain) - 1)
        return None


class _TensorsIn(pickle.Unpickler):
    """Unpickles an entry, taking its tensors from where :class:`_TensorsOut` left them."""

    def __init__(self, data: bytes, plain: dict[str, torch.Tensor], place: Any) -> None:
        super().__init__(io.BytesIO(data))
        self.plain, self.place = plain, place

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "tensor":
            return self.plain[str(pid[1])]
        return self.place(*pid[1:])


def _digest(tensor: torch.Tensor) -> str:
    """The tensor's dtype, shape and bytes, hashed: what must agree between ranks for it to be saved once."""
    data = tensor.detach().cpu().contiguous().reshape(-1)
    return f"{data.dtype}{tuple(tensor.shape)}" + hashlib.blake2b(data.view(torch.uint8).numpy()).hexdigest()


def _describe(value: Any) -> tuple[bytes, list[torch.Tensor], list[DTensor], tuple[Any, ...]]:
    buffer = io.BytesIO()
    pickler = _TensorsOut(buffer)
    pickler.dump(value)
    data = buffer.getvalue()
    dtensors = tuple((tuple(t.shape), tuple(t.placements)) for t in pickler.dtensors)
    fingerprint = (hashlib.blake2b(data).hexdigest(), tuple(_digest(t) for t in pickler.plain), dtensors)
    return data, pickler.plain, pickler.dtensors, fingerprint


def encode_extra(checkpoint: dict[str, Any], leave: Collection[str], full: bool) -> dict[str, Any]:
    """``checkpoint`` with its entries that hold DTensors or differ between ranks moved into :data:`EXTRA_KEY` (see
    the module docstring); ``leave``: the entries the checkpoint machinery writes as state dicts (model, optimizers,
    averaged copies). ``full``: DTensors gathered (to every rank's CPU memory; rank 0 writes them) and every rank's
    records gathered to rank 0. Call on every rank.

    Raises:
        ValueError: an entry whose DTensors differ between ranks in number, shape or placements (it names the key).

    Example:
        >>> encode_extra({"state_dict": {}, "step": 3}, {"state_dict"}, full=False)
        {'state_dict': {}, 'step': 3}
    """
    keys = [key for key in checkpoint if key not in leave and key != EXTRA_KEY]
    described = {key: _describe(checkpoint[key]) for key in keys}
    fingerprints = {key: found[3] for key, found in described.items()}
    everyone = all_gathered(fingerprints)
    encoded = {key: value for key, value in checkpoint.items() if key not in described}
    extra: dict[str, Any] = {"world_size": world_size(), "dtensors": {}, "replicated": {}, "per_rank": {}}
    for key, (data, plain, dtensors, _) in described.items():
        seen = [theirs[key] for theirs in everyone]
        if len({found[2] for found in seen}) > 1:
            raise ValueError(
                f"The checkpoint entry {key!r} holds DTensors that differ between ranks (in number, shape or "
                "placements): a DTensor must be saved by every rank alike. Save it per rank as plain tensors "
                "(`dtensor.to_local()`), or the same DTensors on every rank."
            )
        same = len({found[:2] for found in seen}) == 1
        if same and not dtensors:
            encoded[key] = checkpoint[key]
            continue
        if dtensors:
            extra["dtensors"][key] = {str(i): t.full_tensor().cpu() if full else t for i, t in enumerate(dtensors)}
        record = {
            "pickle": data,
            "tensors": {str(i): t.detach().cpu() if full else t.detach() for i, t in enumerate(plain)},
        }
        if same:
            extra["replicated"][key] = record
        else:
            extra["per_rank"][key] = _per_rank(record, full)
    if extra["dtensors"] or extra["replicated"] or extra["per_rank"]:
        encoded[EXTRA_KEY] = extra
    return encoded


def _per_rank(record: dict[str, Any], full: bool) -> dict[str, Any]:
    """Every rank's record (``full``: gathered to rank 0, which writes the file) or this rank's, by rank."""
    if not full or not (_distributed_is_initialized() and world_size() > 1):
        return {str(rank()): record}
    gathered: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(record, gathered, dst=0)
    return {str(index): theirs for index, theirs in enumerate(gathered or [])}


def decode_extra(rest: dict[str, Any], model: nn.Module | None) -> dict[str, Any]:
    """The loaded ``rest`` of a checkpoint with the entries :func:`encode_extra` moved put back: DTensors on the
    device mesh of ``model``'s parameters (whole tensors without a model), per-rank entries as this rank saved
    them. A checkpoint without :data:`EXTRA_KEY` is returned as it is.

    Raises:
        ValueError: a DTensor whose mesh (its dimension names and count) is not the model's or a part of it.

    Example:
        >>> decode_extra({"step": 3}, None)
        {'step': 3}
    """
    extra = rest.get(EXTRA_KEY)
    if not isinstance(extra, dict):
        return rest
    decoded = {key: value for key, value in rest.items() if key != EXTRA_KEY}
    saved_world = int(extra.get("world_size", 1))
    mesh = _model_mesh(model)
    for key, record in extra.get("replicated", {}).items():
        decoded[key] = _decode(key, record, extra.get("dtensors", {}).get(key, {}), mesh)
    per_rank = extra.get("per_rank", {})
    if per_rank and saved_world != world_size():
        warnings.warn(
            f"The checkpoint entries {sorted(per_rank)} differ between ranks and were saved at world size "
            f"{saved_world}, loaded at {world_size()}: rank r gets what rank r % {saved_world} saved.",
            stacklevel=2,
        )
    for key, records in per_rank.items():
        record = records[str(rank() % saved_world)]
        decoded[key] = _decode(key, record, extra.get("dtensors", {}).get(key, {}), mesh)
    return decoded


def _decode(key: str, record: dict[str, Any], dtensors: dict[str, torch.Tensor], mesh: DeviceMesh | None) -> Any:
    def place(index: int, placements: tuple[Any, ...], dim_names: tuple[str, ...] | None, ndim: int) -> Any:
        whole = dtensors[str(index)]
        if isinstance(whole, DTensor):  # a load without a target reads the whole tensor; one that had one may not
            whole = whole.full_tensor()
        if mesh is None:
            return whole
        return distribute_tensor(
            whole, _matching_mesh(key, mesh, dim_names, ndim), list(placements), src_data_rank=None
        )

    return _TensorsIn(record["pickle"], record.get("tensors", {}), place).load()


def _model_mesh(model: nn.Module | None) -> DeviceMesh | None:
    for parameter in model.parameters() if model is not None else ():
        if isinstance(parameter, DTensor):
            return parameter.device_mesh
    return None


def _matching_mesh(key: str, mesh: DeviceMesh, dim_names: tuple[str, ...] | None, ndim: int) -> DeviceMesh:
    """The model's mesh, or its sub-mesh of the saved dimension names, for a DTensor saved on a mesh of ``ndim``
    dimensions named ``dim_names``."""
    if mesh.ndim == ndim and (dim_names is None or mesh.mesh_dim_names in (None, dim_names)):
        return mesh
    if dim_names is not None and mesh.mesh_dim_names and set(dim_names) <= set(mesh.mesh_dim_names):
        return mesh[dim_names]
    raise ValueError(
        f"The checkpoint entry {key!r} holds a DTensor saved on a {ndim}-dimensional device mesh {dim_names}; the "
        f"model's mesh is {mesh.mesh_dim_names or mesh.ndim}. Load it where the model's mesh has those dimensions, or "
        "save it as a plain tensor (`dtensor.full_tensor()`)."
    )
