"""Tiny models from libraries nobody on this project wrote, each with its inputs and a per-sample loss.

Chosen for the styles the default wrapping (``auto_wrap_policy="auto"``) met badly before (issue 27): layers kept in
a ``ModuleList`` of ``ModuleList`` s (x-transformers), ``nn.MultiheadAttention`` beside a stray ``Linear`` head
(MONAI's MIL model), 0-d parameters (transformers' CLIP, kornia's SigLIP 2: ``logit_scale``), a forward that reads
into its first block (diffusers' DiT), nested block lists (diffusers' UNet) and a model with no repeated block at all
(MONAI's recursive UNet). No dropout anywhere: its masks would differ between a sharded run and the reference.

Every loss is a mean over the batch's samples, so the mean of the ranks' losses on their halves of a batch is the
one-process loss of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812


@dataclass(frozen=True)
class LibraryCase:
    """A library model: ``build()`` makes it, ``inputs(generator, n)`` makes ``n`` samples (a dict of tensors whose
    first dimension is the sample), ``loss(model, batch)`` is the batch's mean loss."""

    library: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator, int], dict[str, Tensor]]
    loss: Callable[[nn.Module, dict[str, Tensor]], Tensor]


# ---------------------------------------------------------------------------------------------- transformers CLIP


def _clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=2, pad_token_id=1)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=8)  # fmt: skip
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))


def _image_text_inputs(generator: torch.Generator, n: int) -> dict[str, Tensor]:
    return {
        "input_ids": torch.randint(3, 64, (n, 8), generator=generator),
        "pixel_values": torch.randn(n, 3, 16, 16, generator=generator),
        "target": torch.randn(n, generator=generator),
    }


def _clip_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    # Each image against its own text: the diagonal of the similarity logits, scaled by `logit_scale.exp()`.
    out = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"])
    return F.mse_loss(out.logits_per_image.diagonal().float(), batch["target"].float())


# ---------------------------------------------------------------------------------------------- kornia SigLIP 2


def _siglip2() -> nn.Module:
    from kornia.models.siglip2 import SigLip2Config, SigLip2Model
    from kornia.models.siglip2.config import SigLip2TextConfig, SigLip2VisionConfig

    vision = SigLip2VisionConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32)  # fmt: skip
    text = SigLip2TextConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=32, max_position_embeddings=16)  # fmt: skip
    return SigLip2Model(SigLip2Config(vision_config=vision, text_config=text, projection_dim=8))


def _siglip2_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    # `logit_scale` and `logit_bias` (both 0-d) enter every logit.
    out = model(pixel_values=batch["pixel_values"], input_ids=batch["input_ids"])
    return F.mse_loss(out.logits_per_text.diagonal().float(), batch["target"].float())


# ---------------------------------------------------------------------------------------------- diffusers


def _unet2d() -> nn.Module:
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
                       norm_num_groups=4, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=4)  # fmt: skip


def _dit() -> nn.Module:
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                  num_layers=3, sample_size=8, patch_size=2, num_embeds_ada_norm=10)  # fmt: skip
    for module in model.modules():
        if hasattr(module, "dropout_prob"):  # the class-label dropout of classifier-free guidance
            module.dropout_prob = 0.0
    return model


def _noise_inputs(channels: int) -> Callable[[torch.Generator, int], dict[str, Tensor]]:
    def inputs(generator: torch.Generator, n: int) -> dict[str, Tensor]:
        return {
            "sample": torch.randn(n, channels, 8, 8, generator=generator),
            "timestep": torch.randint(0, 1000, (n,), generator=generator),
            "class_labels": torch.randint(0, 10, (n,), generator=generator),
            "noise": torch.randn(n, channels, 8, 8, generator=generator),
        }

    return inputs


def _unet2d_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.mse_loss(model(batch["sample"], batch["timestep"]).sample.float(), batch["noise"].float())


def _dit_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    out = model(batch["sample"], timestep=batch["timestep"], class_labels=batch["class_labels"]).sample
    return F.mse_loss(out.float(), batch["noise"].float())


# ---------------------------------------------------------------------------------------------- x-transformers


def _x_transformer() -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=Decoder(dim=16, depth=2, heads=2))


def _token_inputs(generator: torch.Generator, n: int) -> dict[str, Tensor]:
    return {"tokens": torch.randint(0, 64, (n, 9), generator=generator)}


def _next_token_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


# ---------------------------------------------------------------------------------------------- MONAI


def _mil() -> nn.Module:
    from monai.networks.nets import MILModel

    # A user's small CNN as the backbone (MONAI's default is a torchvision ResNet-50).
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 16))  # fmt: skip
    return MILModel(num_classes=3, mil_mode="att_trans", backbone=backbone, backbone_num_features=16, trans_blocks=2)


def _mil_inputs(generator: torch.Generator, n: int) -> dict[str, Tensor]:
    return {
        "bags": torch.randn(n, 3, 3, 8, 8, generator=generator),
        "label": torch.randint(0, 3, (n,), generator=generator),
    }


def _mil_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["bags"]).float(), batch["label"])


def _monai_unet() -> nn.Module:
    from monai.networks.nets import UNet

    return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1)


def _segmentation_inputs(generator: torch.Generator, n: int) -> dict[str, Tensor]:
    return {
        "image": torch.randn(n, 1, 16, 16, generator=generator),
        "mask": torch.randn(n, 2, 16, 16, generator=generator),
    }


def _segmentation_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.mse_loss(model(batch["image"]).float(), batch["mask"].float())


CASES: dict[str, LibraryCase] = {
    "clip": LibraryCase("transformers", _clip, _image_text_inputs, _clip_loss),
    "siglip2": LibraryCase("kornia", _siglip2, _image_text_inputs, _siglip2_loss),
    "unet2d": LibraryCase("diffusers", _unet2d, _noise_inputs(3), _unet2d_loss),
    "dit": LibraryCase("diffusers", _dit, _noise_inputs(4), _dit_loss),
    "x_transformer": LibraryCase("x_transformers", _x_transformer, _token_inputs, _next_token_loss),
    "mil": LibraryCase("monai", _mil, _mil_inputs, _mil_loss),
    "monai_unet": LibraryCase("monai", _monai_unet, _segmentation_inputs, _segmentation_loss),
}


def case_inputs(name: str, n: int) -> dict[str, Any]:
    """``n`` samples of case ``name``'s inputs, the same in every process."""
    return CASES[name].inputs(torch.Generator().manual_seed(1234), n)
