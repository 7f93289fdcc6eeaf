"""A LightningModule around a Hugging Face causal LM, loaded shard by shard with ``lightning_shard.hf.from_pretrained``.

The HF model is created in ``configure_model()``: under the sharded strategy Lightning calls it on the meta device,
the strategy shards the model, and each rank then reads only its slices of the pretrained safetensors, so no
process ever holds the whole model. With no model at ``pretrained_path`` and a ``random_init`` config, the
module first writes a randomly initialised model there (``prepare_data``: once per node, before any rank loads it),
so the example runs without downloading anything. With ``lora`` (peft's ``LoraConfig`` arguments) the model is
wrapped by ``peft.get_peft_model`` there too: only the adapters train, the base stays frozen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torchmetrics

import lightning_shard.hf
from examples.causal_lm import CausalLM


def write_random_model(path: str | Path, config: dict[str, Any], seed: int = 0) -> int:
    """Write a randomly initialised HF causal LM built from ``config`` (``model_type`` plus its config fields) to
    ``path`` with ``save_pretrained``; return its parameter count.

    Example:
        >>> write_random_model("out/tiny", {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})  # doctest: +SKIP
        214080
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    model_type = config.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    model.save_pretrained(path)
    return model.num_parameters()


class HFCausalLM(CausalLM):
    """Next-token fine-tuning of a Hugging Face causal LM (``AutoModelForCausalLM``).

    Batches are ``(x, y)`` token windows with ``y`` the window shifted by one (``examples.gpt.data``), so the loss
    is computed here rather than by the HF model's own ``labels`` shift.

    Example:
        >>> module = HFCausalLM("out/hf_llama_tiny/pretrained")
        >>> trainer = L.Trainer(strategy="fully_sharded", accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    def __init__(
        self,
        pretrained_path: str,
        random_init: dict[str, Any] | None = None,
        learning_rate: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        lora: dict[str, Any] | None = None,
    ) -> None:
        """
        Args:
            pretrained_path: a local HF model directory (``config.json`` + safetensors), e.g. a snapshot you
                downloaded once, or where ``random_init`` writes one.
            random_init: HF config fields (with ``model_type``) of a random model to write to ``pretrained_path``
                when it holds no ``config.json``; ``None``: a missing model is an error.
            learning_rate: peak AdamW learning rate.
            weight_decay: AdamW weight decay for matrices (not biases or norms).
            warmup_steps: linear warm-up steps.
            max_steps: end of the cosine decay; ``None`` uses the Trainer's estimated total steps.
            min_lr_ratio: final learning rate as a fraction of the peak.
            lora: ``peft.LoraConfig`` arguments (``{"r": 8, "target_modules": ["q_proj", "v_proj"]}``): train LoRA
                adapters of a frozen base (``pip install peft``, in the ``[hf]`` extra); ``None``: the whole model.
        """
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None
        self.val_loss = torchmetrics.aggregation.MeanMetric()

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node, before configure_model() on any rank: the place to write
        # files that every rank then reads.
        path = Path(self.hparams.pretrained_path)
        if (path / "config.json").is_file():
            return
        if self.hparams.random_init is None:
            raise FileNotFoundError(
                f"No HF model at pretrained_path={str(path)!r} (no config.json). Point it at a local model directory, "
                "or set `random_init` to write a random model there."
            )
        n_params = write_random_model(path, self.hparams.random_init)
        print(
            f"No model at {path}: wrote a random {self.hparams.random_init['model_type']} model with {n_params:,} "
            "parameters there (model.random_init). Later runs load it.",
            flush=True,
        )

    def configure_model(self) -> None:
        # Lightning may call this more than once (e.g. fit, then validate): build only once.
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        model = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, self.hparams.pretrained_path)
        if self.hparams.lora is not None:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(**self.hparams.lora))
        self.model = model.train()  # from_pretrained hands models over in eval mode (dropout off); this one is trained

    def on_fit_start(self) -> None:
        data_vocab = getattr(self.trainer.datamodule, "vocab_size", None)
        model_vocab = self.model.config.vocab_size  # peft's model hands on its base model's config
        if data_vocab is not None and data_vocab > model_vocab:
            raise ValueError(
                f"The data has {data_vocab} token ids but the model's vocabulary is {model_vocab}: tokenise with the "
                "model's own tokenizer (`data.tokenizer_path`, usually the same directory as model.pretrained_path)."
            )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> next-token logits ``(B, T, vocab_size)``."""
        return self.model(input_ids=input_ids).logits

    def configure_optimizers(self) -> dict[str, Any]:
        # Only what trains (under LoRA: the adapters; the frozen base gets no optimizer state), decaying only the
        # weight matrices, not biases or norms.
        params = [p for p in self.parameters() if p.requires_grad]
        return self.adamw_warmup_cosine([p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2])
