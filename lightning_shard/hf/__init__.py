"""Hugging Face models: export a checkpoint's model as a ``from_pretrained`` directory.

transformers, huggingface_hub and safetensors (``pip install 'lightning-shard[hf]'``) are imported only when used.
"""

from lightning_shard.hf.export import HFExport, export_hf

__all__ = ["HFExport", "export_hf"]
