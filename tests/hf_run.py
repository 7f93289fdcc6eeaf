"""Train tiny Hugging Face (Llama, tied GPT-2) and litgpt models under one or more scenarios; save per-step global
losses, the weights and buffers when training starts and ends, the FSDP units, and what the model generates after
fit when called directly (outside the step methods).

    python tests/hf_run.py --devices 2 --out OUT --pretrained DIR llama gpt2 pretrained litgpt
``--devices 1 --reference`` trains with Lightning's single-device strategy: the one-process reference. ``DIR`` is a
tiny Llama written with ``save_pretrained`` (safetensors) by the test.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.fsdp import CPUOffload, FSDPModule, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import N_SAMPLES, QUIET, GlobalLossRecorder, RankSliceBatchSampler, StateRecorder  # noqa: E402

import lightning_shard  # noqa: E402
import lightning_shard.hf  # noqa: E402
from lightning_shard.hf.pretrained import _slice_reader_class  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, MAX_STEPS = 128, 16, 8, 4
PROMPT = [[1, 5, 9, 13, 17]]


def llama_config(layers: int = 2) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def gpt2_config() -> Any:
    from transformers import GPT2Config

    # no dropout: its masks would differ between the sharded run and the reference
    return GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def litgpt_config() -> Any:
    from litgpt import Config

    return Config(
        block_size=32,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_query_groups=2,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=128,
    )


class CausalLM(L.LightningModule):
    """A language model held as ``self.model``, built in ``configure_model()`` (on the meta device under the
    sharded strategy): ``family`` "llama" / "gpt2" (transformers ``from_config``), "pretrained" (a Llama from
    ``lightning_shard.hf.from_pretrained``) or "litgpt" (litgpt's ``GPT``)."""

    def __init__(self, family: str, pretrained: str | None = None) -> None:
        super().__init__()
        self.family, self.pretrained = family, pretrained
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.family == "litgpt":
            from litgpt import GPT

            self.model = GPT(litgpt_config())
            return
        from transformers import AutoModelForCausalLM

        if self.family == "pretrained":
            self.model = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, self.pretrained)
        else:
            self.model = AutoModelForCausalLM.from_config(llama_config() if self.family == "llama" else gpt2_config())

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        if self.family == "litgpt":
            logits = self.model(tokens)
            return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD, not AdamW: Adam's step is about lr for any non-zero gradient, so an element whose gradient is near
        # zero moves by a rounding-dependent amount (the toy parity tests cover AdamW under sharding).
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def token_loader() -> DataLoader:
    # a learnable sequence (each token determines the next) from a random first token
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(3, VOCAB, (N_SAMPLES, SEQ), generator=generator)
    for position in range(1, SEQ):
        tokens[:, position] = (tokens[:, position - 1] * 5 + 3) % VOCAB
    return DataLoader(TensorDataset(tokens), batch_sampler=RankSliceBatchSampler(GLOBAL_BATCH))


def strategy_arguments(name: str) -> dict[str, Any]:
    """GPT-2 trains under Lightning FSDPStrategy / FSDP1 spellings, which the strategy translates; the pretrained
    Llama with its decoder layers checkpointed ("auto": `_no_split_modules`), so loading sees checkpoint wrappers."""
    if name == "pretrained":
        return {"activation_checkpointing": "auto"}
    if name != "gpt2":
        return {}
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return {
        "sharding_strategy": ShardingStrategy.FULL_SHARD,
        "auto_wrap_policy": ModuleWrapPolicy({GPT2Block}),
        "activation_checkpointing_policy": {GPT2Block},
        "cpu_offload": CPUOffload(offload_params=False),
    }


def fit(
    model: CausalLM, devices: int, reference: bool, max_steps: int, ckpt_path: str | None = None, **strategy: Any
) -> tuple[L.Trainer, GlobalLossRecorder, StateRecorder]:
    losses, states = GlobalLossRecorder(), StateRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="auto" if reference else lightning_shard.ShardedStrategy(**strategy),
        max_steps=max_steps,
        callbacks=[losses, states],
        **QUIET,
    )
    trainer.fit(model, train_dataloaders=token_loader(), ckpt_path=ckpt_path)
    return trainer, losses, states


def run(name: str, devices: int, reference: bool, pretrained: str, out: Path) -> None:
    L.seed_everything(0, verbose=False)
    model = CausalLM(name, pretrained)
    read = _count_elements_read() if name == "pretrained" else None
    strategy = {} if reference else strategy_arguments(name)
    trainer, losses, states = fit(model, devices, reference, MAX_STEPS, **strategy)
    result: dict[str, Any] = {
        "losses": losses.losses,
        "start": states.states["start"]["weights"],
        "end": states.states["end"]["weights"],
        "buffers": {key: buffer.clone() for key, buffer in model.model.named_buffers()},
        "units": _unit_classes(model),
    }
    if name == "gpt2":
        result["tied"] = model.model.lm_head.weight is model.model.transformer.wte.weight
    result.update(_call_after_fit(name, model.model))
    if read is not None:
        result["elements_read"] = _per_rank(read["elements"])
        result["resumed"] = _resume(model, trainer, devices, reference, pretrained, out)
    if trainer.is_global_zero:
        torch.save(result, out / f"{name}.pt")


def _call_after_fit(name: str, inner: nn.Module) -> dict[str, Any]:
    """Outside the step methods, on every rank: a plain forward, and greedy generation (transformers)."""
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        if name == "litgpt":
            return {"logits": inner(prompt).clone()}
        logits = inner(prompt).logits.clone()
        generated = inner.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return {"logits": logits, "generated": generated.tolist()}


def _resume(model: CausalLM, trainer: L.Trainer, devices: int, reference: bool, pretrained: str, out: Path) -> dict:
    """Save a checkpoint after fit, then fit a fresh ``from_pretrained`` model from it: the checkpoint must win."""
    path = out / f"pretrained-{devices}.ckpt"
    trainer.save_checkpoint(path)
    L.seed_everything(0, verbose=False)
    _, losses, states = fit(CausalLM("pretrained", pretrained), devices, reference, MAX_STEPS + 2, ckpt_path=str(path))
    return {"start": states.states["start"]["weights"], "losses": losses.losses}


def _unit_classes(root: nn.Module) -> list[str]:
    """The classes of the FSDP units below the root (a checkpoint wrapper's: the block it wraps)."""
    units = [m for m in root.modules() if isinstance(m, FSDPModule) and m is not root]
    return sorted({type(getattr(m, "_checkpoint_wrapped_module", m)).__name__.removeprefix("FSDP") for m in units})


def _count_elements_read() -> dict[str, int]:
    """Count the tensor elements this rank reads from the safetensors files."""
    read = {"elements": 0}
    reader = _slice_reader_class(HuggingFaceStorageReader)
    original = reader._process_read_request

    @functools.wraps(original)
    def counting(self: Any, f: Any, req: Any, planner: Any) -> None:
        read["elements"] += int(torch.Size(req.lengths).numel())
        original(self, f, req, planner)

    reader._process_read_request = counting  # type: ignore[method-assign]
    return read


def _per_rank(value: int) -> list[int]:
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=["llama", "gpt2", "pretrained", "litgpt"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        run(name, args.devices, args.reference, args.pretrained, args.out)


if __name__ == "__main__":
    main()
