"""Tiny transformers models of many families for the architecture sweep: a config shrunk from the family's defaults,
the model class its task's auto mapping names, dummy inputs of its modality and a loss.

Nothing is written per model but the family's name and, where the generic shrinking breaks a family's own
constraint, a few config values: the sweep is about code nobody here wrote, so the models are the library's own
classes with the library's own defaults made small.

    >>> build(FAMILIES["llama"]).__class__.__name__
    'LlamaForCausalLM'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

VOCAB, SEQ, IMAGE, AUDIO = 99, 8, 32, 1600
# The generic shrinking: a config field of this name (in the family's defaults or a sub-config's) gets this value.
SIZES: dict[str, Any] = {
    **dict.fromkeys("hidden_size d_model n_embd embed_dim dim word_embed_proj_dim".split(), 32),
    **dict.fromkeys("num_hidden_layers num_layers n_layer n_layers encoder_layers decoder_layers".split(), 2),
    "num_decoder_layers": 2,
    **dict.fromkeys("num_attention_heads n_head n_heads encoder_attention_heads decoder_attention_heads".split(), 2),
    "num_key_value_heads": 2,
    **dict.fromkeys("intermediate_size ffn_dim encoder_ffn_dim decoder_ffn_dim d_ff n_inner".split(), 64),
    **dict.fromkeys("moe_intermediate_size shared_expert_intermediate_size projection_dim".split(), 16),
    **dict.fromkeys("num_experts num_local_experts n_routed_experts".split(), 4),
    "num_experts_per_tok": 2,
    "head_dim": 16,
    "d_kv": 16,
    "embedding_size": 16,
    "state_size": 8,
    "time_step_rank": 4,
    "image_size": IMAGE,
    "patch_size": 8,
    "num_mel_bins": 16,
    "classifier_proj_size": 16,
    "num_conv_pos_embeddings": 8,
    "num_conv_pos_embedding_groups": 2,
    "conv_dim": [16, 16],
    "conv_stride": [5, 4],
    "conv_kernel": [10, 8],
}
# Upper bounds: a field above its bound is lowered to it, one below is kept (e.g. a vocabulary already small).
CAPS = {
    **dict.fromkeys("max_position_embeddings n_positions max_target_positions n_ctx".split(), 64),
    "vocab_size": VOCAB,
    "max_source_positions": 32,
}
# Special token ids beyond the small vocabulary: these values instead.
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}
# Randomness in training mode that would differ between a sharded run and the reference (their masks are drawn
# from each process's own stream): dropout of every kind, layer drop, SpecAugment masking, router noise.
STOCHASTIC = "dropout drop_rate drop_prob pdrop layerdrop drop_path mask_time_prob mask_feature_prob jitter".split()
# The auto mappings a family's model class is picked from, in order (the first that names the family), per category.
TASKS = {
    "decoder": ("CAUSAL_LM",),
    "moe": ("CAUSAL_LM",),
    "state-space": ("CAUSAL_LM",),
    "encoder": ("MASKED_LM",),
    "encoder-decoder": ("SEQ_TO_SEQ_CAUSAL_LM",),
    "vision": ("IMAGE_CLASSIFICATION",),
    "speech": ("SPEECH_SEQ_2_SEQ", "AUDIO_CLASSIFICATION"),
    "multimodal": ("ZERO_SHOT_IMAGE_CLASSIFICATION",),
}


@dataclass(frozen=True)
class Family:
    """A transformers model type in the sweep: its category, and config values the generic shrinking gets wrong."""

    model_type: str
    category: str
    config: dict[str, Any] = field(default_factory=dict)


# The families by category: transformers' model types.
CATEGORIES = {
    "decoder": "llama mistral qwen2 qwen3 gemma gemma2 phi phi3 gpt2 gpt_neo gpt_neox gptj opt bloom falcon stablelm "
    "starcoder2 olmo2 cohere codegen persimmon mpt biogpt xglm granite glm gpt_bigcode nemotron",
    "moe": "mixtral qwen2_moe qwen3_moe olmoe granitemoe phimoe jetmoe deepseek_v2 hunyuan_v1_moe",
    "state-space": "mamba falcon_mamba mamba2 rwkv jamba bamba",
    "encoder": "bert roberta modernbert albert distilbert electra deberta deberta-v2 xlm-roberta mpnet convbert "
    "megatron-bert roformer ernie squeezebert fnet longformer big_bird",
    "encoder-decoder": "t5 bart pegasus mbart marian mt5 umt5 blenderbot m2m_100 plbart switch_transformers nllb-moe "
    "longt5 prophetnet",
    "vision": "vit deit beit resnet regnet dinov2 poolformer segformer pvt swin convnext convnextv2 swinv2 bit levit "
    "cvt ijepa",
    "speech": "wav2vec2 hubert wavlm data2vec-audio sew unispeech wav2vec2-conformer whisper",
    "multimodal": "clip siglip chinese_clip altclip blip clipseg",
}
# Where the generic shrinking breaks a family's own constraint (rotary dims, layer patterns, windows, T5's missing
# decoder start token): these values on top.
CONFIG_FIXES: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 4},
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    "deepseek_v2": {
        **dict.fromkeys(["q_lora_rank", "kv_lora_rank"], 16),
        **dict.fromkeys(["qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"], 8),
        **dict.fromkeys(["first_k_dense_replace", "n_shared_experts"], 1),
    },
    "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "distilbert": {"hidden_dim": 64},
    **dict.fromkeys(["t5", "mt5", "umt5", "switch_transformers", "longt5"], {"decoder_start_token_id": 0}),
    **dict.fromkeys(["swin", "swinv2"], {"depths": [1, 1], "num_heads": [2, 2], "window_size": 4, "patch_size": 4}),
    **dict.fromkeys(["convnext", "convnextv2"], {"patch_size": 2}),
    "bit": {"num_groups": 2},
    "levit": {"hidden_sizes": [32, 32, 32], "num_attention_heads": [2, 2, 2], "key_dim": [8, 8, 8], "patch_size": 16},
    "cvt": {"embed_dim": [16, 32, 32], "num_heads": [2, 2, 2]},
    "squeezebert": {"embedding_size": 32},
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 16, "attn_layer_indices": [1]},
    "longformer": {"attention_window": 4},
    "big_bird": {"attention_type": "original_full"},
}
FAMILIES: dict[str, Family] = {
    name: Family(name, category, CONFIG_FIXES.get(name, {}))
    for category, names in CATEGORIES.items()
    for name in names.split()
}


def shrink(config_class: type, overrides: dict[str, Any]) -> Any:
    """``config_class`` built from its defaults with every size field small, randomness off, sub-configs alike."""
    from transformers import PretrainedConfig

    defaults = config_class()
    values: dict[str, Any] = {}
    for key, default in defaults.to_dict().items():
        if key in SIZES and not isinstance(default, bool):
            value = SIZES[key]
            if isinstance(default, (list, tuple)) and not isinstance(value, list):
                value = [value] * len(default)  # per-stage heads
            if isinstance(value, list) == isinstance(default, (list, tuple)):  # wav2vec2's conv_kernel, not mamba's
                values[key] = value
        elif key in CAPS and isinstance(default, int) and default > CAPS[key]:
            values[key] = CAPS[key]
        elif key in TOKEN_IDS and isinstance(default, int) and default >= VOCAB:
            values[key] = TOKEN_IDS[key]
        elif any(word in key for word in STOCHASTIC) and isinstance(default, (float, list)):
            values[key] = [0.0] * len(default) if isinstance(default, list) else 0.0  # CvT: one rate per stage
        elif key == "hidden_sizes":
            values[key] = [16 * 2 ** min(i, 1) for i in range(len(default))]
        elif key == "depths":
            values[key] = [1] * len(default)
    for key, sub_class in getattr(defaults, "sub_configs", {}).items():
        if isinstance(getattr(defaults, key, None), PretrainedConfig):
            values[key] = shrink(sub_class, overrides.get(key, {})).to_dict()
    values.update({k: v for k, v in overrides.items() if not isinstance(v, dict) or k not in values})
    return config_class(**values)


def model_class(family: Family) -> tuple[str, type]:
    """The task and class the auto mappings name for the family (the first of its category's ``TASKS``)."""
    import transformers
    from transformers.models.auto import modeling_auto

    for task in TASKS[family.category]:
        names = getattr(modeling_auto, f"MODEL_FOR_{task}_MAPPING_NAMES")
        if family.model_type in names:
            name = names[family.model_type]
            return task.lower(), getattr(transformers, name if isinstance(name, str) else name[0])
    raise LookupError(f"{family.model_type}: no model class for the tasks {TASKS[family.category]}")


def tiny_config(family: Family) -> Any:
    from transformers import CONFIG_MAPPING

    return shrink(CONFIG_MAPPING[family.model_type], family.config)


def build(family: Family) -> nn.Module:
    """The family's model from its tiny config (transformers' own initialisation, the caller's random stream)."""
    _, cls = model_class(family)
    return cls(tiny_config(family))


def inputs(family: Family, generator: torch.Generator, n: int) -> dict[str, Tensor]:
    """``n`` samples of the family's task's inputs, labels included (first dimension: the sample)."""
    task, _ = model_class(family)
    config = tiny_config(family)
    text = getattr(config, "text_config", None) or config
    vocab = min(getattr(text, "vocab_size", VOCAB) or VOCAB, VOCAB)
    tokens = torch.randint(4, vocab, (n, SEQ), generator=generator)
    if task in ("causal_lm", "masked_lm", "seq_to_seq_causal_lm"):
        return {"input_ids": tokens, "labels": tokens.roll(1, dims=1)}
    if task == "sequence_classification":
        return {"input_ids": tokens, "labels": torch.randint(0, 2, (n,), generator=generator)}
    labels = torch.randint(0, 2, (n,), generator=generator)
    if task == "image_classification":
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn(n, channels, IMAGE, IMAGE, generator=generator), "labels": labels}
    if task == "audio_classification":
        return {"input_values": torch.randn(n, AUDIO, generator=generator), "labels": labels}
    if task == "speech_seq_2_seq":
        frames = 2 * config.max_source_positions
        features = torch.randn(n, config.num_mel_bins, frames, generator=generator)
        return {"input_features": features, "labels": tokens}
    if task == "zero_shot_image_classification":
        image = config.vision_config.image_size
        pixels = torch.randn(n, 3, image, image, generator=generator)
        return {"input_ids": tokens, "pixel_values": pixels, "return_loss": torch.ones(n, dtype=torch.bool)}
    raise LookupError(task)


def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The model's own loss (labels in the batch; CLIP-style models: ``return_loss``)."""
    batch = dict(batch)
    if "return_loss" in batch:
        batch["return_loss"] = True
    return model(**batch).loss
