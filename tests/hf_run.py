"""Train tiny Hugging Face (Llama, tied GPT-2, Mixtral) and litgpt models under one or more scenarios; save per-step
global losses, the weights and buffers when training starts and ends, the FSDP units, and what the model generates
after fit when called directly (outside the step methods).

    python tests/hf_run.py --devices 2 --out OUT --checkpoints DIR llama gpt2 pretrained litgpt mixtral bf16_mixed
``--devices 1 --reference`` runs the one-process reference: Lightning's single-device strategy, pretrained models
loaded by transformers' own ``from_pretrained``. ``DIR`` holds the tiny checkpoints :func:`write_checkpoints` writes
with ``save_pretrained`` (safetensors).
"""

from __future__ import annotations

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
from toy import N_SAMPLES, QUIET, GlobalLossRecorder, RankSliceBatchSampler, StateRecorder, scenario_parser  # noqa: E402

import lightning_shard  # noqa: E402
import lightning_shard.hf  # noqa: E402
from lightning_shard.hf.safetensors_files import StoredTensor, slice_reader_class  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, MAX_STEPS = 128, 16, 8, 4
PROMPT = [[1, 5, 9, 13, 17]]
# Scenarios that train a pretrained checkpoint: its directory under --checkpoints, and the Trainer precision.
PRETRAINED = {
    "pretrained": ("llama", "32-true"),
    "mixtral": ("mixtral", "32-true"),
    "fused_qkv": ("llama-fused-qkv", "32-true"),
    "bf16_mixed": ("llama-bf16", "bf16-mixed"),
    "bf16_true": ("llama-bf16", "bf16-true"),
}
# Trained with AdamW, whose states must follow the parameters' dtype.
PRECISION_SCENARIOS = ("bf16_mixed", "bf16_true")


# The Llama-style decoders (Llama, Mixtral): what their tiny configs share.
DECODER = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{**DECODER, "intermediate_size": 128, **overrides})


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


def mixtral_config() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(**DECODER, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)


@functools.cache
def fused_qkv_llama() -> type:
    """A Llama whose checkpoints hold each layer's q, k and v projections as one ``qkv_proj`` tensor (as gte's or
    nomic-bert's do): a conversion registered with transformers' ``register_checkpoint_conversion_mapping``, whose
    ``Chunk`` needs the whole fused tensor before a rank can take its rows of q, k and v."""
    from transformers import LlamaForCausalLM
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Chunk, WeightConverter

    class FusedQKVLlama(LlamaForCausalLM):
        pass

    targets = [f"self_attn.{name}_proj.weight" for name in "qkv"]
    fuse = WeightConverter("self_attn.qkv_proj.weight", targets, operations=[Chunk(dim=0)])
    register_checkpoint_conversion_mapping("FusedQKVLlama", [fuse], overwrite=True)
    return FusedQKVLlama


def write_checkpoints(root: Path) -> None:
    """The tiny pretrained checkpoints, as ``save_pretrained`` writes them: a Llama in fp32 ("llama") and in bf16
    ("llama-bf16", config ``dtype: bfloat16`` as most Hub configs), and in layouts that transformers converts on load
    (``save_pretrained`` writes them back): a Mixtral in the Hub's per-expert layout (``block_sparse_moe.experts.N.w1``,
    fused into ``mlp.experts.gate_up_proj``) and a Llama with fused ``qkv_proj`` tensors (:func:`fused_qkv_llama`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    llama = AutoModelForCausalLM.from_config(llama_config())
    llama.save_pretrained(root / "llama")
    llama.to(torch.bfloat16).save_pretrained(root / "llama-bf16")
    AutoModelForCausalLM.from_config(mixtral_config()).save_pretrained(root / "mixtral")
    fused_qkv_llama()(llama_config(num_key_value_heads=4)).save_pretrained(root / "llama-fused-qkv")  # equal chunks


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
    sharded strategy): ``family`` "llama" / "gpt2" (transformers ``from_config``), one of ``PRETRAINED`` (from
    ``lightning_shard.hf.from_pretrained``) or "litgpt" (litgpt's ``GPT``). ``model``: built by the caller instead."""

    def __init__(self, family: str, pretrained: str | None = None, model: nn.Module | None = None) -> None:
        super().__init__()
        self.family, self.pretrained = family, pretrained
        self.model = model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.family == "litgpt":
            from litgpt import GPT

            self.model = GPT(litgpt_config())
            return
        from transformers import AutoModelForCausalLM

        if self.family in PRETRAINED:
            model_class = fused_qkv_llama() if self.family == "fused_qkv" else AutoModelForCausalLM
            self.model = lightning_shard.hf.from_pretrained(model_class, self.pretrained)
        else:
            self.model = AutoModelForCausalLM.from_config(llama_config() if self.family == "llama" else gpt2_config())

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        if self.family == "litgpt":
            logits = self.model(tokens)
            return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.family in PRECISION_SCENARIOS:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
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
    model: CausalLM,
    devices: int,
    strategy: Any,
    max_steps: int,
    precision: str = "32-true",
    ckpt_path: str | None = None,
) -> tuple[L.Trainer, GlobalLossRecorder, StateRecorder]:
    losses, states = GlobalLossRecorder(), StateRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=max_steps,
        callbacks=[losses, states],
        **QUIET,
    )
    trainer.fit(model, train_dataloaders=token_loader(), ckpt_path=ckpt_path)
    return trainer, losses, states


def run(name: str, devices: int, reference: bool, checkpoints: Path, out: Path) -> None:
    directory, precision = PRETRAINED.get(name, (None, "32-true"))
    pretrained = str(checkpoints / directory) if directory else None
    L.seed_everything(0, verbose=False)
    if reference and name in PRECISION_SCENARIOS:
        # One process under the same strategy and precision, the model loaded by transformers' own `from_pretrained`
        # with fp32 weights asked for explicitly: what "bf16-mixed" must give without being asked.
        from transformers import AutoModelForCausalLM

        eager = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
        model, strategy = CausalLM(name, pretrained, model=eager), lightning_shard.ShardedStrategy()
    else:
        model = CausalLM(name, pretrained)
        strategy = "auto" if reference else lightning_shard.ShardedStrategy(**strategy_arguments(name))
    read = count_elements_read() if name == "pretrained" else None
    converted = _record_converted_reads() if name == "mixtral" else None
    trainer, losses, states = fit(model, devices, strategy, MAX_STEPS, precision)
    result: dict[str, Any] = {
        "losses": losses.losses,
        "start": states.states["start"]["weights"],
        "end": states.states["end"]["weights"],
        "buffers": {key: buffer.clone() for key, buffer in model.model.named_buffers()},
        "units": _unit_classes(model),
    }
    if name == "gpt2":
        result["tied"] = model.model.lm_head.weight is model.model.transformer.wte.weight
    if name in PRECISION_SCENARIOS:
        states = [value for state in trainer.optimizers[0].state.values() for key, value in state.items()]
        result["stored_dtypes"] = sorted({str(param.to_local().dtype) for param in model.model.parameters()})
        result["adamw_dtypes"] = sorted({str(value.dtype) for value in states if value.ndim})  # not the step counts
    else:
        result.update(_call_after_fit(name, model.model))
    if read is not None:
        result["elements_read"] = per_rank(read["elements"])
        result["resumed"] = _resume(trainer, devices, reference, pretrained, out)
    if converted is not None:
        result["converted_reads"] = per_rank(converted)
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


def _resume(trainer: L.Trainer, devices: int, reference: bool, pretrained: str, out: Path) -> dict:
    """Save a checkpoint after fit, then fit a fresh ``from_pretrained`` model from it: the checkpoint must win."""
    path = out / f"pretrained-{devices}.ckpt"
    trainer.save_checkpoint(path)
    L.seed_everything(0, verbose=False)
    strategy = "auto" if reference else lightning_shard.ShardedStrategy(**strategy_arguments("pretrained"))
    _, losses, states = fit(CausalLM("pretrained", pretrained), devices, strategy, MAX_STEPS + 2, ckpt_path=str(path))
    return {"start": states.states["start"]["weights"], "losses": losses.losses}


def _unit_classes(root: nn.Module) -> list[str]:
    """The classes of the FSDP units below the root (a checkpoint wrapper's: the block it wraps)."""
    units = [m for m in root.modules() if isinstance(m, FSDPModule) and m is not root]
    return sorted({type(getattr(m, "_checkpoint_wrapped_module", m)).__name__.removeprefix("FSDP") for m in units})


def count_elements_read() -> dict[str, int]:
    """Count the tensor elements this rank reads from the safetensors files."""
    read = {"elements": 0}
    reader = slice_reader_class(HuggingFaceStorageReader)
    original = reader._process_read_request

    @functools.wraps(original)
    def counting(self: Any, f: Any, req: Any, planner: Any) -> None:
        read["elements"] += int(torch.Size(req.lengths).numel())
        original(self, f, req, planner)

    reader._process_read_request = counting  # type: ignore[method-assign]
    return read


def _record_converted_reads() -> list[str]:
    """Record the names of the file tensors this rank reads whole for a conversion (MoE experts)."""
    names: list[str] = []
    original = StoredTensor.read

    @functools.wraps(original)
    def recording(self: StoredTensor) -> torch.Tensor:
        names.append(self.name)
        return original(self)

    StoredTensor.read = recording  # type: ignore[method-assign]
    return names


def per_rank(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main() -> None:
    parser = scenario_parser(["llama", "gpt2", "litgpt", *PRETRAINED])
    parser.add_argument("--checkpoints", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        run(name, args.devices, args.reference, args.checkpoints, args.out)


if __name__ == "__main__":
    main()
