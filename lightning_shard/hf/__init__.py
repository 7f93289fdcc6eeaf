"""Hugging Face models under the sharded strategy: transformers' own initialisation for models built on the meta
device (:mod:`lightning_shard.hf.init`) and pretrained weights loaded shard by shard
(:func:`from_pretrained`). transformers stays optional: importing this package does not import it."""

from lightning_shard.hf.pretrained import from_pretrained

__all__ = ["from_pretrained"]
