"""LoRA runs for ``lightning-shard export-hf``: the model with its adapters merged, or the adapters alone.

A LoRA run's checkpoint holds peft's ``PeftModel`` (``get_peft_model(hf_model, LoraConfig(...))``) under the
LightningModule's attribute prefix, with peft's names: ``base_model.model.<hf name>`` for untouched weights,
``...q_proj.base_layer.weight`` for an adapted layer's frozen weight, ``...q_proj.lora_A.default.weight`` for its
adapters, ``...lm_head.modules_to_save.default.weight`` for a trained copy (``modules_to_save``).

* The LoRA configuration (``lora_config`` / ``--lora-config``): a peft ``adapter_config.json`` (what
  ``LoraConfig.save_pretrained`` writes), a directory holding one, or a JSON object of ``LoraConfig`` fields. Without
  it, the checkpoint's hyper-parameters are searched: the one value that is a peft config, or a mapping whose keys are
  all ``LoraConfig`` fields (a LightningModule taking ``lora: dict`` and calling ``save_hyperparameters()``).
* Names: the HF model built on the meta device from ``config.json`` is wrapped by peft's ``get_peft_model`` with that
  configuration, which gives the names the run saved; every tensor is matched by identity, so tied weights and peft's
  renaming come from peft itself.
* Merged (:class:`MergedLoRA`): a tensor of an adapted module is computed as peft's ``merge_and_unload`` computes it,
  module by module: a copy of the meta module gets the module's tensors from the checkpoint and is merged through its
  own ``unload_and_optionally_merge_module`` or ``merge(safe_merge=True)`` (NaNs refused); everything else is read as
  saved. The export then holds, besides its output shard, one adapted module and its merged copy.
* Adapter only (:func:`export_adapter`): the adapter tensors (what ``get_peft_model_state_dict`` selects, names
  without the adapter name) are read from the checkpoint and written by ``PeftModel.save_pretrained``:
  ``adapter_config.json``, ``adapter_model.safetensors`` (in the checkpoint's dtype, as peft saves the adapters of the
  trained model) and peft's ``README.md``; ``PeftModel.from_pretrained(base, out_dir)`` loads it.

peft is imported inside the functions that need it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The adapter name of a model built by `get_peft_model(model, config)` without one: the checkpoint's names carry it.
ADAPTER = "default"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ImportError(f"Exporting a LoRA run needs peft: pip install peft ({error})") from error
    return peft


def read_lora_config(lora_config: Any, hyper_parameters: Callable[[], Any], checkpoint: Path | str) -> Any:
    """The peft config of the run: ``lora_config`` (a peft config, a mapping of its fields, or the path of a JSON file
    or of a directory holding ``adapter_config.json``), else the one found in the checkpoint's hyper-parameters.

    Example:
        >>> read_lora_config({"r": 8, "target_modules": ["q_proj"]}, dict, "out/last.ckpt").r  # doctest: +SKIP
        8
    """
    peft = _peft()
    if isinstance(lora_config, peft.PeftConfig):
        return lora_config
    if isinstance(lora_config, Mapping):
        return _config_from_fields(lora_config)
    if lora_config is not None:
        path = Path(lora_config)
        file = path / "adapter_config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(
                f"`--lora-config {lora_config}`: no such file (a peft adapter_config.json, or a directory holding one)"
            )
        return _config_from_fields(json.loads(file.read_text()))
    found = _configs_in(hyper_parameters() or {})
    if len(found) == 1:
        return next(iter(found.values()))
    where = f"{len(found)} ({', '.join(sorted(found))})" if found else "none"
    raise ValueError(
        f"Which LoRA configuration did the run in {checkpoint} use? Its hyper-parameters hold {where}. Pass "
        "`--lora-config` "
        "(`lora_config=`): the adapter_config.json that peft's LoraConfig.save_pretrained writes, or a JSON object of "
        'LoraConfig fields such as {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}.'
    )


def _config_from_fields(fields: Mapping[str, Any]) -> Any:
    peft = _peft()
    fields = dict(fields)
    fields.setdefault("peft_type", "LORA")
    try:
        return peft.PeftConfig.from_peft_type(**fields)
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(f"Not a peft configuration: {fields} ({type(error).__name__}: {error})") from error


def _configs_in(hyper_parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The hyper-parameters that are peft configs, or mappings of LoraConfig fields only, by name."""
    peft = _peft()
    fields = set(peft.LoraConfig.__dataclass_fields__)
    found = {}
    for name, value in hyper_parameters.items():
        if isinstance(value, peft.PeftConfig):
            found[str(name)] = value
        elif isinstance(value, Mapping) and value and set(map(str, value)) <= fields:
            found[str(name)] = _config_from_fields(value)
    return found


@dataclass
class PeftLayout:
    """The HF model of ``config.json`` wrapped by peft as the run wrapped it (on the meta device): which checkpoint
    names (without the LightningModule prefix) hold each exported tensor, and the modules that merge adapters.

    ``aliases``: HF name (as ``save_pretrained`` writes it) -> the peft names it may be saved under (tied copies);
    ``owners``: HF name -> (peft name of its adapted module, the tensor's name inside that module once merged);
    ``module_inputs``: adapted module's peft name -> its tensors' peft names; ``shapes``: peft name -> shape.
    """

    model: nn.Module
    aliases: dict[str, list[str]]
    owners: dict[str, tuple[str, str]]
    module_inputs: dict[str, list[str]]
    shapes: dict[str, torch.Size]

    @classmethod
    def build(cls, hf_model: nn.Module, hf_aliases: Mapping[str, list[str]], peft_config: Any) -> PeftLayout:
        """Wrap ``hf_model`` (meta device; wrapped in place) with ``peft_config``; ``hf_aliases`` are its saved names
        (:func:`~lightning_shard.hf.weight_names.saved_names`), read before wrapping."""
        peft = _peft()
        tensors = {name: hf_model.get_parameter_or_buffer(name) for names in hf_aliases.values() for name in names}
        with torch.device("meta"):
            # A copy: get_peft_model fills in fields (the base's name) of the config it is given.
            model = peft.get_peft_model(hf_model, copy.deepcopy(peft_config), adapter_name=ADAPTER)
        named = dict(model.state_dict(keep_vars=True))
        peft_names: dict[int, list[str]] = {}
        for name, tensor in named.items():
            peft_names.setdefault(id(tensor), []).append(name)
        module_names = {id(module): name for name, module in model.named_modules()}
        aliases, owners, module_inputs = {}, {}, {}
        for name, names in hf_aliases.items():
            aliases[name] = list(dict.fromkeys(p for alias in names for p in peft_names[id(tensors[alias])]))
            found = _adapted_owner(hf_model, name)
            untied = [alias for alias in names[1:] if _adapted_owner(hf_model, alias) != found]
            if untied:
                # save_pretrained writes tied weights once: a merge that changes one copy only cannot be written so.
                raise ValueError(
                    f"The adapters change {name} and its tied copy {untied[0]} differently; the merged model cannot "
                    "keep them tied. Export the adapter alone (`--adapter-only`)."
                )
            if found is not None:
                owner, inner = found
                owner_name = module_names[id(owner)]
                owners[name] = (owner_name, inner)
                module_inputs[owner_name] = [f"{owner_name}.{key}" for key in owner.state_dict()]
        shapes = {name: tensor.shape for name, tensor in named.items()}
        return cls(model, aliases, owners, module_inputs, shapes)

    def inputs(self, name: str) -> list[str]:
        """The peft names whose tensors the merged tensor ``name`` needs besides its own (the module's adapters)."""
        return self.module_inputs[self.owners[name][0]] if name in self.owners else []

    def merged(self, name: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The merged model's tensor ``name`` from its module's tensors (``tensors``: peft name -> tensor)."""
        owner_name, inner = self.owners[name]
        module = copy.deepcopy(self.model.get_submodule(owner_name))  # meta: no memory
        start = len(owner_name) + 1
        module.load_state_dict({key[start:]: tensors[key] for key in self.module_inputs[owner_name]}, assign=True)
        with torch.no_grad():
            # What peft's merge_and_unload does with each adapted module (BaseTuner._unload_and_optionally_merge).
            if hasattr(module, "unload_and_optionally_merge_module"):
                merged = module.unload_and_optionally_merge_module(merge=True, safe_merge=True, adapter_names=None)
            else:
                module.merge(safe_merge=True)
                merged = module.get_base_layer()
        return merged.state_dict()[inner]


def _adapted_owner(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    """The outermost peft module (adapter layer or ``modules_to_save`` wrapper) on ``name``'s path in the wrapped HF
    model, and the name of the tensor inside what it unloads to; ``None`` when no adapter touches the tensor."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    parts = name.split(".")
    module = model
    for depth, part in enumerate(parts[:-1]):
        module = getattr(module, part)
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            return module, ".".join(parts[depth + 1 :])
    return None


def adapter_names(layout: PeftLayout) -> dict[str, str]:
    """What ``PeftModel.save_pretrained`` writes (peft's ``get_peft_model_state_dict``: adapter tensors, names without
    the adapter name) -> the peft name each is read from.

    Example:
        >>> adapter_names(layout)["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]  # doctest: +SKIP
        'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'
    """
    peft = _peft()
    state = layout.model.state_dict()
    name_of = {id(tensor): name for name, tensor in state.items()}
    saved = peft.get_peft_model_state_dict(layout.model, state_dict=state, adapter_name=ADAPTER)
    return {out: name_of[id(tensor)] for out, tensor in saved.items()}


def save_adapter(layout: PeftLayout, tensors: Mapping[str, torch.Tensor], out_dir: Path) -> None:
    """Write the adapter with peft's own ``save_pretrained``, from ``tensors`` (peft name -> tensor read)."""
    layout.model.save_pretrained(out_dir, state_dict=dict(tensors), selected_adapters=[ADAPTER])
