"""Hugging Face models under the sharded strategy: transformers' own initialisation for models built on the meta
device (:mod:`lightning_shard.hf.init`), pretrained weights loaded shard by shard (:func:`from_pretrained`), and the
model's own tensor-parallel plan applied by transformers' code (:mod:`lightning_shard.hf.tensor_parallel`), and the
way back, a checkpoint's model exported as a ``from_pretrained`` directory (:func:`export_hf`; a LoRA run's adapter
for ``PeftModel.from_pretrained``: :func:`export_adapter`).

transformers, huggingface_hub and safetensors (``pip install 'lightning-shard[hf]'``) are imported only when used.
"""

from lightning_shard.hf import init as _init  # noqa: F401  (registers transformers' init with the materialiser)
from lightning_shard.hf import tensor_parallel as _tensor_parallel  # noqa: F401  (registers transformers' TP plans)
from lightning_shard.hf.export import HFExport, export_adapter, export_hf
from lightning_shard.hf.pretrained import from_pretrained

__all__ = ["HFExport", "export_adapter", "export_hf", "from_pretrained"]
