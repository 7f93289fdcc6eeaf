"""Pretrained Hugging Face weights, shard by shard.

``lightning_shard.hf.from_pretrained(AutoModelForCausalLM, path)`` in ``configure_model()`` builds the model on the
meta device from ``path``'s ``config.json`` and works out which file tensor fills which model tensor, with
transformers' own conversion mapping (:mod:`lightning_shard.hf.conversion`): a checkpoint that does not fill the model
is refused there, before anything is sharded. After sharding, materialisation (transformers' step of it,
:mod:`lightning_shard.hf.init`) calls :func:`load_pretrained_shards` on the model as it was built (a wrapper such as
peft's undone around it, so the planned names hold): every rank reads only its own slices of the safetensors files,
through torch.distributed.checkpoint's ``HuggingFaceStorageReader``, straight into its DTensor shards (as torchtitan
loads HF weights), in the shards' dtype (the precision plugin's: fp32 under "-mixed" for a bf16 file); tensors that
transformers fuses on load (MoE experts) are converted for the rank's rows only. No rank ever holds the whole model.
What the files do not fill (non-persistent buffers such as rotary ``inv_freq``, a new head) gets transformers' init.
The tensors read and their files are noted (:mod:`lightning_shard.hf.frozen_weights`: frozen ones can be left out of
checkpoints). A Lightning checkpoint given to ``fit(ckpt_path=...)`` is loaded after this and wins.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_shard.hf.conversion import LoadPlan, load_converted, plan_load
from lightning_shard.hf.frozen_weights import note_loaded
from lightning_shard.hf.safetensors_files import slice_reader_class, stored_tensors
from lightning_shard.torch_compat.dispatch import holds_values

# Set on a model built by `from_pretrained` on the meta device: the `LoadPlan` of its weights.
_PRETRAINED = "_lightning_shard_pretrained_plan"

# from_pretrained arguments about loading or placement that the shard-by-shard path does its own way.
_REFUSED = {
    "device_map": "the strategy places and shards the model",
    "tp_plan": "the strategy splits the model: `ShardedStrategy(tensor_parallel_size=k)` applies the model's own "
    "`tp_plan` (or `tensor_parallel_plan=...`)",
    "tp_size": "the strategy splits the model: pass `ShardedStrategy(tensor_parallel_size=k)`",
    "device_mesh": "the strategy builds the mesh",
    "quantization_config": "quantized weights are not supported by the shard-by-shard loader",
    "state_dict": "the weights are read from the safetensors files in `path`",
    "gguf_file": "only safetensors files are read",
    "variant": "only the plain safetensors files (`model*.safetensors`) are read",
    "subfolder": "pass the subfolder as part of `path`",
    "key_mapping": "names are matched as transformers' `from_pretrained` matches them (its conversion mapping)",
}


def from_pretrained(model_class: Any, path: str | Path, **kwargs: Any) -> nn.Module:
    """A Hugging Face model whose weights the sharded strategy loads shard by shard after sharding.

    Call it in ``configure_model()``. There the strategy builds on the meta device: the model is created from
    ``path``'s config, the files' tensors are matched to it as transformers matches them (renamed and fused MoE
    experts included), and each rank later reads only its slices of ``path``'s safetensors files, in the dtype the
    precision stores parameters in (fp32 under "bf16-mixed" for a bf16 checkpoint). Anywhere else (``__init__``,
    another strategy, one process) it is transformers' ``model_class.from_pretrained(path)``.

    Args:
        model_class: ``AutoModelForCausalLM`` or any transformers model class.
        path: a local directory written by ``save_pretrained`` (``config.json`` and ``*.safetensors``); nothing
            is downloaded: fetch a Hub model first (``hf download NAME --local-dir DIR``).
        **kwargs: config overrides and ``from_config`` arguments (``attn_implementation="sdpa"``, ...), as
            transformers' ``from_pretrained`` takes them.

    Raises:
        ValueError: before anything is sharded, when the files leave tensors of the model's body unfilled (names
            that need a conversion transformers does not know), or their shapes differ from the config's.

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
    kwargs.setdefault("local_files_only", True)  # a local directory: nothing to download
    if torch.get_default_device().type != "meta":
        return model_class.from_pretrained(path, **kwargs)
    refused = sorted(set(kwargs) & _REFUSED.keys())
    if refused:
        raise TypeError(
            f"`lightning_shard.hf.from_pretrained` does not take {refused}: "
            + "; ".join(f"`{name}`: {_REFUSED[name]}" for name in refused)
            + "."
        )
    from transformers import AutoConfig

    config, model_kwargs = AutoConfig.from_pretrained(path, return_unused_kwargs=True, **kwargs)
    build = getattr(model_class, "from_config", None) or model_class._from_config
    model = build(config, **model_kwargs)
    model.__dict__[_PRETRAINED] = plan_files(model, path)
    return model


def plan_files(model: nn.Module, path: str | Path) -> LoadPlan:
    """Which tensor of ``path``'s safetensors files fills which tensor of ``model`` (built on the meta device from
    ``path``'s config), as transformers' ``from_pretrained`` matches them (:func:`~lightning_shard.hf.conversion.
    plan_load`: checked, nothing read).

    Example:
        >>> plan_files(meta_llama, "checkpoints/llama").renamed["lm_head.weight"]  # doctest: +SKIP
        'lm_head.weight'
    """
    return plan_load(model, str(path), stored_tensors(_reader(path).read_metadata()))


def planned_load(model: nn.Module) -> bool:
    """Whether ``model`` was built by :func:`from_pretrained` on the meta device and awaits its files."""
    return _PRETRAINED in model.__dict__


def planned_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s tensors (as :func:`from_pretrained` built it) that its planned load fills.

    Example:
        >>> planned_names(nn.Linear(2, 2))
        set()
    """
    plan: LoadPlan | None = model.__dict__.get(_PRETRAINED)
    return set() if plan is None else {*plan.renamed.values(), *plan.outputs}


def load_pretrained_shards(model: nn.Module) -> bool:
    """Load the files planned by :func:`from_pretrained` into ``model``'s shards; ``False`` if none were planned.

    The names are those ``model`` had when :func:`from_pretrained` built it: a wrapper that changed the model since
    (peft's ``lora.Linear`` holding ``q_proj`` as ``base_layer``) is undone around the load by the caller
    (:class:`lightning_shard.hf.init.AsBuilt`). Every tensor read is flagged ``_is_hf_initialized`` (as transformers
    flags loaded weights), so the init that follows leaves it alone. Call on every rank, after sharding and
    allocation. Fake tensors (``lightning-shard estimate --mode simulate``) are not read into.
    """
    plan: LoadPlan | None = model.__dict__.pop(_PRETRAINED, None)
    if plan is None:
        return False
    import torch.distributed.checkpoint as dcp

    tensors = model.state_dict(keep_vars=True)
    first_key: dict[int, str] = {}  # a weight stored under two tied names is read once
    for key, name in plan.renamed.items():
        if not tensors[name].is_meta:  # a module the wrapper dropped from the model (not sharded): nothing to fill
            first_key.setdefault(id(tensors[name]), key)
    targets = {key: tensors[plan.renamed[key]] for key in first_key.values()}
    if not all(holds_values(tensor) for tensor in targets.values()):
        # The memory simulation's fake tensors: no values to read; loaded as far as the init that follows knows.
        loaded = [*targets.values(), *(tensors[name] for name in plan.outputs)]
    else:
        if targets:
            dcp.load(targets, storage_reader=_reader(plan.path))
        loaded = [*targets.values(), *load_converted(model, plan)]
    for tensor in loaded:
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    note_loaded(model, {stored.file for stored in plan.stored.values() if stored.file}, loaded)
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if own and all(getattr(t, "_is_hf_initialized", False) for t in own):
            module._is_hf_initialized = True
    return True


def _reader(path: str | Path) -> Any:
    """torch.distributed.checkpoint's ``HuggingFaceStorageReader`` for ``path``, reading rows with plain reads."""
    import torch.distributed.checkpoint as dcp

    reader_class = getattr(dcp, "HuggingFaceStorageReader", None)
    if reader_class is None:  # torch < 2.8
        raise RuntimeError(
            f"Loading {path} shard by shard needs torch.distributed.checkpoint.HuggingFaceStorageReader "
            f"(torch >= 2.8; this is {torch.__version__}). Upgrade torch, or call transformers' `from_pretrained` "
            "in `__init__`."
        )
    return slice_reader_class(reader_class)(str(path))


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
