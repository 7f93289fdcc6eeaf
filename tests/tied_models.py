"""Models whose parameters are tied (one ``nn.Parameter`` held by two or more modules), each with its inputs and a
mean loss: nanoGPT (``tests/nanogpt.py``) and tiny configs of transformers families that tie their embeddings to the
output head (masked-LM heads of the BERT family, decoders with ``tie_word_embeddings=True``, and encoder-decoders
whose one ``shared`` embedding is both encoders' ``embed_tokens`` and ``lm_head``).

No dropout anywhere (its masks would differ between a sharded run and the reference); every loss is a mean over
tokens, all of them counted, so the mean of the ranks' losses is the one-process loss of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

VOCAB, SEQ = 64, 8
_ENCODER = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=32)  # fmt: skip
_ENCODER_DECODER = dict(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_position_embeddings=32)  # fmt: skip
_DECODER = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                tie_word_embeddings=True)  # fmt: skip
_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name -> (transformers model class, config class, config arguments); the masked-LM heads are the ones the default
# wrapping split before (embeddings a unit, the tied decoder in the root), the encoder-decoders the ones whose shared
# embedding a meta build initialised from other random numbers
TRANSFORMERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertForMaskedLM", "BertConfig", {**_ENCODER, **_SPECIAL}),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", {**_ENCODER, **_SPECIAL, "pad_token_id": 1, "bos_token_id": 0}),
    "modernbert": (
        "ModernBertForMaskedLM",
        "ModernBertConfig",
        {**_ENCODER, **_SPECIAL, "cls_token_id": 1, "sep_token_id": 2},
    ),
    "albert": ("AlbertForMaskedLM", "AlbertConfig", {**_ENCODER, **_SPECIAL, "embedding_size": 8}),
    "distilbert": (
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        dict(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=32),
    ),
    "t5": (
        "T5ForConditionalGeneration",
        "T5Config",
        dict(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0),
    ),
    "bart": ("BartForConditionalGeneration", "BartConfig", {**_ENCODER_DECODER, **_SPECIAL}),
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig", {**_ENCODER_DECODER, **_SPECIAL}),
    "marian": ("MarianMTModel", "MarianConfig", {**_ENCODER_DECODER, **_SPECIAL, "decoder_start_token_id": 0}),
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=1, eos_token_id=2),
    ),
    "llama": ("LlamaForCausalLM", "LlamaConfig", {**_DECODER, **_SPECIAL}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {**_DECODER, **_SPECIAL, "num_key_value_heads": 1}),
    "opt": (
        "OPTForCausalLM",
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            ffn_dim=32,
            word_embed_proj_dim=16,
            max_position_embeddings=32,
            **_SPECIAL,
        ),
    ),
    "bloom": (
        "BloomForCausalLM",
        "BloomConfig",
        dict(vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2, **_SPECIAL),
    ),
}
SEQ2SEQ = ("t5", "bart", "pegasus", "marian")


def build_transformers(name: str) -> nn.Module:
    """The tiny transformers model ``name`` of :data:`TRANSFORMERS`, every dropout probability 0."""
    import transformers

    model_class, config_class, arguments = TRANSFORMERS[name]
    config = getattr(transformers, config_class)(**arguments)
    for key, value in vars(config).items():
        if ("dropout" in key or "layerdrop" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    return getattr(transformers, model_class)(config)


def build_nanogpt() -> nn.Module:
    from nanogpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB))


def builder(name: str) -> Callable[[], nn.Module]:
    return build_nanogpt if name == "nanogpt" else lambda: build_transformers(name)


def inputs(name: str, n: int) -> dict[str, Tensor]:
    """``n`` samples of token ids (and labels for the encoder-decoders), the same in every process."""
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=generator)
    labels = torch.randint(3, VOCAB, (n, SEQ), generator=generator) if name in SEQ2SEQ else ids
    return {"input_ids": ids, "labels": labels}


def loss(name: str, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    if name == "nanogpt":
        ids = batch["input_ids"]
        return model(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())[1]
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names under which each shared parameter is held, one list per parameter held in two places or more.

    Example:
        >>> tied_names(build_nanogpt())
        [['transformer.wte.weight', 'lm_head.weight']]
    """
    holders: dict[int, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append(f"{prefix}.{name}" if prefix else name)
    return [names for names in holders.values() if len(names) > 1]
