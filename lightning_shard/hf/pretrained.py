"""Pretrained Hugging Face weights, shard by shard.

``lightning_shard.hf.from_pretrained(AutoModelForCausalLM, path)`` in ``configure_model()`` builds the model on the
meta device from ``path``'s ``config.json`` and notes ``path`` on it. After sharding, materialisation
(:func:`lightning_shard.hf.init.initialize_hf_model`) calls :func:`load_pretrained_shards`: every rank
reads only its own slices of the safetensors files, through torch.distributed.checkpoint's
``HuggingFaceStorageReader``, straight into its DTensor shards (as torchtitan loads HF weights); no rank ever holds
the whole model. What the files do not hold (non-persistent buffers such as rotary ``inv_freq``, a new head) gets
transformers' init. A Lightning checkpoint given to ``fit(ckpt_path=...)`` is loaded after this and wins.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

# Set on a model built by `from_pretrained` on the meta device: the directory its weights are loaded from.
_PRETRAINED = "_lightning_shard_pretrained_path"

# from_pretrained arguments about loading or placement that the shard-by-shard path does its own way.
_REFUSED = {
    "device_map": "the strategy places and shards the model",
    "tp_plan": "the strategy shards the model (FSDP2); tensor parallelism is not supported",
    "tp_size": "the strategy shards the model (FSDP2); tensor parallelism is not supported",
    "device_mesh": "the strategy builds the mesh",
    "quantization_config": "quantized weights are not supported by the shard-by-shard loader",
    "state_dict": "the weights are read from the safetensors files in `path`",
    "gguf_file": "only safetensors files are read",
    "variant": "only the plain safetensors files (`model*.safetensors`) are read",
    "subfolder": "pass the subfolder as part of `path`",
    "key_mapping": "names are matched to the model's state dict as saved by `save_pretrained`",
}


def from_pretrained(model_class: Any, path: str | Path, **kwargs: Any) -> nn.Module:
    """A Hugging Face model whose weights the sharded strategy loads shard by shard after sharding.

    Call it in ``configure_model()``. There the strategy builds on the meta device: the model is created from
    ``path``'s config, and each rank later reads only its slices of ``path``'s safetensors files. Anywhere else
    (``__init__``, another strategy, one process) it is transformers' ``model_class.from_pretrained(path)``.

    Args:
        model_class: ``AutoModelForCausalLM`` or any transformers model class.
        path: a local directory written by ``save_pretrained`` (``config.json`` and ``*.safetensors``); nothing
            is downloaded: fetch a Hub model first (``hf download NAME --local-dir DIR``).
        **kwargs: config overrides and ``from_config`` arguments (``dtype=torch.float32``,
            ``attn_implementation="sdpa"``, ...), as transformers' ``from_pretrained`` takes them.

    Example:
        >>> from transformers import AutoModelForCausalLM  # doctest: +SKIP
        >>> def configure_model(self):  # doctest: +SKIP
        ...     self.model = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, "checkpoints/llama")
    """
    path = Path(path)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"`lightning_shard.hf.from_pretrained` reads a local directory written by `save_pretrained` "
            f"(config.json and *.safetensors files); {str(path)!r} is not one. Download a Hub model first, e.g. "
            "`hf download NAME --local-dir DIR`."
        )
    if torch.get_default_device().type != "meta":
        return model_class.from_pretrained(path, local_files_only=True, **kwargs)
    refused = sorted(set(kwargs) & _REFUSED.keys())
    if refused:
        raise TypeError(
            f"`lightning_shard.hf.from_pretrained` does not take {refused}: "
            + "; ".join(f"`{name}`: {_REFUSED[name]}" for name in refused)
            + "."
        )
    from transformers import AutoConfig

    config, model_kwargs = AutoConfig.from_pretrained(path, return_unused_kwargs=True, local_files_only=True, **kwargs)
    build = getattr(model_class, "from_config", None) or model_class._from_config
    model = build(config, **model_kwargs)
    model.__dict__[_PRETRAINED] = str(path)
    return model


def load_pretrained_shards(model: nn.Module) -> bool:
    """Load the files noted by :func:`from_pretrained` into ``model``'s shards; ``False`` if none were noted.

    Every tensor read is flagged ``_is_hf_initialized`` (as transformers flags loaded weights), so the init that
    follows leaves it alone. Call on every rank, after sharding and allocation.

    Raises:
        ValueError: when no tensor of the files matches the model's names.
    """
    path = model.__dict__.pop(_PRETRAINED, None)
    if path is None:
        return False
    import torch.distributed.checkpoint as dcp

    reader_class = getattr(dcp, "HuggingFaceStorageReader", None)
    if reader_class is None:  # torch < 2.8
        raise RuntimeError(
            f"Loading {path} shard by shard needs torch.distributed.checkpoint.HuggingFaceStorageReader "
            f"(torch >= 2.8; this is {torch.__version__}). Upgrade torch, or call transformers' `from_pretrained` "
            "in `__init__`."
        )
    reader_class = _slice_reader_class(reader_class)
    stored = reader_class(path).read_metadata().state_dict_metadata
    prefix = getattr(model, "base_model_prefix", "")
    targets: dict[str, torch.Tensor] = {}
    loaded: set[int] = set()
    names_of: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
        key = _stored_name(name, stored, prefix)
        if key is not None and id(tensor) not in loaded and key not in targets:
            targets[key] = tensor
            loaded.add(id(tensor))
    if not targets:
        raise ValueError(
            f"None of the tensors in {path} matches a parameter or buffer name of {type(model).__name__} "
            f"(files: {sorted(stored)[:3]}..., model: {sorted(model.state_dict())[:3]}...). Is it a checkpoint of "
            "this model class?"
        )
    dcp.load(targets, storage_reader=reader_class(path))
    for tensor in targets.values():
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if own and all(getattr(t, "_is_hf_initialized", False) for t in own):
            module._is_hf_initialized = True
    missing = sorted(names[0] for tensor_id, names in names_of.items() if tensor_id not in loaded)
    unexpected = sorted(set(stored) - targets.keys())
    if missing:
        rank_zero_warn(f"{path} holds no {missing}: they get {type(model).__name__}'s initialisation instead.")
    if unexpected:
        rank_zero_warn(f"{path} holds tensors {type(model).__name__} does not use; not loaded: {unexpected}")
    return True


@cache
def _slice_reader_class(base: type) -> type:
    """``HuggingFaceStorageReader`` reading each rank's rows with plain file reads instead of through the mapping.

    The base class reads through ``safe_open``, which maps the whole file: every page a rank touches then counts in
    its RSS until the file is closed, so a rank's RSS grew by its slices twice (its shard, and the mapped pages
    behind it: +592 MiB for a 256 MiB shard of a 134M-parameter model). FSDP2 shards along dim 0, so a rank's
    slice of a tensor is one contiguous byte range of the file; it is read straight into the target (through a
    buffer of the slice's size when the dtype or device differs). Other slices take the base class's path.
    """

    class SafetensorsSliceReader(base):  # type: ignore[misc, valid-type]
        def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
            info = self.storage_data[req.storage_index]
            header_bytes, tensors = _safetensors_header(info.relative_path, os.stat(info.relative_path).st_mtime_ns)
            start, end = tensors[req.storage_index.fqn]["data_offsets"]
            shape = list(info.shape)
            if not shape or list(req.lengths[1:]) != shape[1:] or any(req.storage_offsets[1:]):
                return super()._process_read_request(f, req, planner)
            row_bytes = (end - start) // shape[0] if shape[0] else 0
            target = planner.resolve_tensor(req).detach()
            direct = target.dtype == info.dtype and target.device.type == "cpu" and target.is_contiguous()
            buffer = target if direct else torch.empty(list(req.lengths), dtype=info.dtype)
            with open(info.relative_path, "rb") as file:
                file.seek(8 + header_bytes + start + req.storage_offsets[0] * row_bytes)
                if file.readinto(buffer.view(-1).view(torch.uint8).numpy()) != req.lengths[0] * row_bytes:
                    raise OSError(f"{info.relative_path} ended inside {req.storage_index.fqn!r}: truncated file?")
            if not direct:
                target.copy_(buffer)
            planner.commit_tensor(req, target)

    return SafetensorsSliceReader


@cache
def _safetensors_header(file: str, modified_ns: int) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header: its length and ``{name: {"dtype", "shape", "data_offsets"}}`` (the format's
    first 8 bytes are the little-endian header length, then the JSON header, then the data). Cached per file
    version (``modified_ns``): read once, not once per tensor."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return length, json.loads(handle.read(length))


def _stored_name(name: str, stored: Any, prefix: str) -> str | None:
    """``name`` as the files spell it: as is, or with / without the base model's prefix (a base model's checkpoint
    loaded into a model with a head, or the reverse), as transformers matches them."""
    candidates = [name]
    if prefix:
        candidates += [f"{prefix}.{name}", name.removeprefix(f"{prefix}.")]
    return next((candidate for candidate in candidates if candidate in stored), None)


@contextmanager
def explain_meta_from_pretrained() -> Iterator[None]:
    """Replace transformers' refusal to run ``from_pretrained`` on the meta device with the ways that work."""
    try:
        yield
    except Exception as error:
        if not _raised_in_transformers_from_pretrained(error):
            raise
        raise RuntimeError(
            "transformers' `from_pretrained` cannot run in `configure_model()` under the sharded strategy, which "
            "builds models on the meta device so that no rank holds the whole model. Use "
            "`self.model = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, path)` there (each rank loads "
            "only its shards after sharding), or call transformers' `from_pretrained` in `__init__` (every rank "
            "loads the whole model, then it is sharded)."
        ) from error


def _raised_in_transformers_from_pretrained(error: BaseException) -> bool:
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        return False
    model_file = modeling_utils.__file__
    return any(
        frame.f_code.co_name == "from_pretrained" and frame.f_code.co_filename == model_file
        for frame, _ in traceback.walk_tb(error.__traceback__)
    )
