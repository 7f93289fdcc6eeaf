"""Train the GPT example and a tiny transformers Llama with tensor parallelism (``ShardedStrategy(
tensor_parallel_size=...)``) under one or more scenarios; save per-step global losses, the weights when training
starts (the initialisation rule) and ends, each rank's parameter bytes and what the model generates after fit.

    python tests/tensor_parallel_run.py --devices 4 --tp 2 --out OUT --checkpoints DIR gpt llama ...
``--devices 1 --reference``: the one-process reference (Lightning's single-device strategy; the sharded strategy on
one process where a scenario says so: precision and resharding). ``--model-parallel``: Lightning's own
``ModelParallelStrategy``, the same plan applied by hand in ``configure_model()`` with torch's ``parallelize_module``
and ``fully_shard``, as its users write it. ``DIR`` holds the pretrained Llama (``write_pretrained``) and the
checkpoints the scenarios save and resume from.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_run import count_elements_read, litgpt_config, llama_config, per_rank  # noqa: E402
from toy import FULL, N_SAMPLES, QUIET, GlobalLossRecorder, RankSliceBatchSampler  # noqa: E402

import lightning_shard  # noqa: E402
import lightning_shard.fabric  # noqa: E402
import lightning_shard.hf  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_shard.core.fused_optimizer import use_fused_kernels  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, MAX_STEPS, SAVE_STEP = 128, 16, 8, 6, 3
PROMPT = [[1, 5, 9, 13, 17]]
LORA_TARGETS = ["q_proj", "v_proj", "o_proj"]  # column-wise and row-wise bases


class FusedOptimizer(L.Callback):
    """Steps Lightning's ModelParallelStrategy's optimizer with the kernel the sharded strategy switches AdamW to."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        use_fused_kernels(trainer.optimizers)


@dataclass(frozen=True)
class Scenario:
    """``family``: "gpt" or "llama"; ``source``: a Llama from its config or the pretrained files; ``resume``: the
    checkpoint (in DIR) to fit from; ``save``: write ``DIR/{name}-{devices}[-mp].ckpt`` at step ``SAVE_STEP`` (sharded
    checkpoints) or after fit (full ones); ``reference_sharded``: the reference runs the sharded strategy on one
    process (precision, resharding to one process); ``by_hand``: ``configure_model()`` splits and shards the model
    itself, as for Lightning's ModelParallelStrategy (under the sharded strategy too); ``fabric``: a Fabric loop
    (``lightning_shard.fabric.ShardedStrategy``; the reference: Fabric on one process)."""

    family: str
    strategy: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    source: str = "config"
    lora: bool = False
    resume: str | None = None
    save: bool = False
    reference_sharded: bool = False
    by_hand: bool = False
    fabric: bool = False


# The tiny Llama's plan written as a dict (its own `tp_plan` gathers the logits), the output layer vocabulary-parallel.
_LAYER = "model.model.layers.*."
LLAMA_LOSS_PARALLEL_PLAN = {
    "model.model.embed_tokens": "rowwise",
    **{f"{_LAYER}self_attn.{name}_proj": "colwise" for name in "qkv"},
    f"{_LAYER}self_attn.o_proj": "rowwise",
    **{f"{_LAYER}mlp.{name}_proj": "colwise" for name in ("gate", "up")},
    f"{_LAYER}mlp.down_proj": "rowwise",
    "model.lm_head": "loss_parallel",
}

SCENARIOS = {
    "gpt": Scenario("gpt", save=True),
    "llama": Scenario("llama", {"state_dict_type": "full"}, save=True),
    # clipped over both mesh dimensions (the clip is active at 0.05), 2 micro-batches per step, selective activation
    # checkpointing of the split blocks
    "gpt_clip_accumulate": Scenario(
        "gpt", {"activation_checkpointing": "selective"}, {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
    ),
    "gpt_bf16": Scenario("gpt", trainer={"precision": "bf16-mixed"}, reference_sharded=True),
    # the 2x2 run's sharded checkpoint of "gpt" at step 3, resumed at any (dp, tp) shape and by one process
    "gpt_resume": Scenario("gpt", resume="gpt-4.ckpt", reference_sharded=True),
    # the same checkpoint converted to a full file (`lightning-shard convert`); the reference: Lightning's own resume
    "gpt_resume_full": Scenario("gpt", resume="gpt-4-full.ckpt"),
    "gpt_auto": Scenario("gpt", {"sharding_strategy": "auto"}),
    # Lightning ModelParallelStrategy's sharded checkpoint of "gpt" at step 3, resumed by the sharded strategy
    "gpt_resume_mp": Scenario("gpt", resume="gpt-4-mp.ckpt", reference_sharded=True),
    # a configure_model() written for ModelParallelStrategy (parallelize_module + fully_shard by hand): kept
    "gpt_by_hand": Scenario("gpt", by_hand=True),
    "fabric_gpt": Scenario("gpt", fabric=True),
    "litgpt": Scenario("litgpt"),
    "pretrained": Scenario("llama", source="pretrained"),
    "lora": Scenario("llama", lora=True),
    # a dict plan whose output layer keeps the logits split over the vocabulary: the loss computed vocabulary-parallel
    "llama_loss_parallel": Scenario("llama_loss_parallel", {"tensor_parallel_plan": LLAMA_LOSS_PARALLEL_PLAN}),
}


class Llama(L.LightningModule):
    """A tiny transformers Llama (untied head) built in ``configure_model()``, from its config or from pretrained
    files, with peft LoRA adapters if asked; ``by_hand``: split and sharded there with torch's tensor parallel API, as
    a user of Lightning's ModelParallelStrategy writes it."""

    def __init__(self, source: str = "config", pretrained: str | None = None, lora: bool = False) -> None:
        super().__init__()
        self.source, self.pretrained, self.lora = source, pretrained, lora
        self.by_hand = False
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        if self.source == "pretrained":
            self.model = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, self.pretrained)
        else:
            self.model = AutoModelForCausalLM.from_config(llama_config())
        if self.lora:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(r=4, target_modules=LORA_TARGETS, lora_dropout=0.0))
        if self.by_hand:
            tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            layer = {f"self_attn.{name}_proj": ColwiseParallel() for name in "qkv"}
            layer |= {f"mlp.{name}_proj": ColwiseParallel() for name in ("gate", "up")}
            layer |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
            body = self.model.model
            parallelize_module(body.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
            parallelize_module(self.model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
            for block in body.layers:
                parallelize_module(block, tp_mesh, layer)
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)  # the module `training_step` calls

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)

    def generate_after_fit(self) -> list[list[int]]:
        with torch.no_grad():
            return self.model.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()


class LlamaLossParallel(Llama):
    """The tiny Llama whose training step logs its loss as users do; under a "loss_parallel" plan entry the logits
    and the loss inside the step are DTensors (the strategy hands Lightning the loss as a plain tensor)."""

    loss_collectives: dict[str, int] | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        with CommDebugMode() as comm:  # what computing the loss communicates
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        if self.loss_collectives is None:
            self.logits_placements = str(getattr(logits, "placements", None))
            self.loss_collectives = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        self.log("train_loss", loss)
        return loss

    def generate_after_fit(self) -> None:
        return None  # transformers' generate samples from plain logits


class LitGPT(L.LightningModule):
    """litgpt's ``GPT`` (a tiny Llama-style config) built in ``configure_model()``: its plan is the one lightning-shard
    ships for it (MLP and vocabulary split, attention whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_hand = False
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            from litgpt import GPT as LitgptGPT

            self.model = LitgptGPT(litgpt_config())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)

    def generate_after_fit(self) -> list[list[int]]:
        with torch.no_grad():
            return self.model(torch.tensor(PROMPT)).argmax(-1).tolist()


class TinyGPT(GPT):
    """The GPT example, small; ``by_hand``: its plan applied by hand in ``configure_model()``."""

    def __init__(self) -> None:
        super().__init__(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ, learning_rate=1e-3,
                         warmup_steps=1, max_steps=100)  # fmt: skip
        self.by_hand = False

    def configure_model(self) -> None:
        if self.transformer is not None:
            return
        super().configure_model()
        if self.by_hand:
            tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            parallelize_module(self.transformer.wte, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
            for block in self.transformer.h:
                plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()}
                plan |= {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
                parallelize_module(block, tp_mesh, plan)
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self, mesh=dp_mesh)

    def generate_after_fit(self) -> list[list[int]]:
        # top_k=1: the most likely token, whatever each rank's random stream
        return self.generate(torch.tensor(PROMPT), max_new_tokens=6, top_k=1).tolist()


def write_pretrained(root: Path) -> None:
    """The tiny Llama as ``save_pretrained`` writes it, for the "pretrained" scenario."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(llama_config()).save_pretrained(root / "llama-pretrained")


def token_loader(tensor_parallel_size: int) -> DataLoader:
    """A learnable sequence (each token determines the next) from a random first token, as ``(x, y)`` windows."""
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(3, VOCAB, (N_SAMPLES, SEQ + 1), generator=generator)
    for position in range(1, SEQ + 1):
        tokens[:, position] = (tokens[:, position - 1] * 5 + 3) % VOCAB
    dataset = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return DataLoader(dataset, batch_sampler=RankSliceBatchSampler(GLOBAL_BATCH, None, tensor_parallel_size))


class WeightsAtStart(L.Callback):
    """The full weights when training starts: the initialisation (or what a resume loaded)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        weights = get_model_state_dict(pl_module, options=FULL)
        self.weights = {name: value.clone() for name, value in weights.items()}


class SaveAt(L.Callback):
    """``trainer.save_checkpoint(path)`` after optimizer step ``step``, every rank taking part."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path, self.saved = step, path, False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not self.saved:
            trainer.save_checkpoint(self.path)
            self.saved = True


def run(name: str, devices: int, tp: int, mode: str, checkpoints: Path, out: Path) -> None:
    scenario = SCENARIOS[name]
    L.seed_everything(0, verbose=False)
    if scenario.fabric:
        run_fabric(name, devices, tp if mode == "sharded" else 1, out)
        return
    model = _model(scenario, checkpoints)
    model.by_hand = mode == "model_parallel" or (scenario.by_hand and mode == "sharded")
    read = count_elements_read() if scenario.source == "pretrained" else None
    sharded = mode == "sharded" or (mode == "reference" and scenario.reference_sharded)
    tensor_parallel = tp if mode != "reference" else 1
    if mode == "model_parallel":
        strategy: Any = ModelParallelStrategy(data_parallel_size=devices // tp, tensor_parallel_size=tp)
    elif sharded:
        strategy = lightning_shard.ShardedStrategy(tensor_parallel_size=tensor_parallel, **scenario.strategy)
    else:
        strategy = "auto"
    recorder, start = GlobalLossRecorder(), WeightsAtStart()
    callbacks: list[L.Callback] = [recorder, start]
    if mode == "model_parallel":  # the optimizer kernel the sharded strategy picks (fused AdamW), for equal bits
        callbacks.append(FusedOptimizer())
    full_save = scenario.strategy.get("state_dict_type") == "full"
    checkpoint = checkpoints / f"{name}-{devices}{'-mp' if mode == 'model_parallel' else ''}.ckpt"
    if scenario.save and not full_save:
        callbacks.append(SaveAt(SAVE_STEP, checkpoint))
    where = {"accelerator": "cpu", "devices": devices, "strategy": strategy}
    trainer = L.Trainer(**where, max_steps=MAX_STEPS, callbacks=callbacks, **QUIET, **scenario.trainer)
    resume = str(checkpoints / scenario.resume) if scenario.resume else None
    trainer.fit(model, train_dataloaders=token_loader(tensor_parallel), ckpt_path=resume)
    if scenario.save and full_save:
        trainer.save_checkpoint(checkpoint)
    result: dict[str, Any] = {
        "losses": recorder.losses,
        "start": start.weights,
        "weights": get_model_state_dict(model, options=FULL),
        "parameter_bytes": per_rank(_parameter_bytes(model)),
        "generated": model.generate_after_fit(),
        "sharding_strategy": getattr(getattr(trainer.strategy, "config", None), "sharding_strategy", None),
        "tensor_parallel_placements": _tensor_parallel_placements(model),
    }
    if read is not None:
        result["elements_read"] = per_rank(read["elements"])
    if isinstance(model, LlamaLossParallel):
        result["loss_collectives"], result["logits_placements"] = model.loss_collectives, model.logits_placements
        result["logged_loss"] = float(trainer.callback_metrics["train_loss"])
    if trainer.is_global_zero:
        torch.save(result, out / f"{name}.pt")


def run_fabric(name: str, devices: int, tp: int, out: Path) -> None:
    """The tiny GPT in a Fabric loop: built on the meta device under the sharded strategy, AdamW, ``MAX_STEPS``."""
    sharded = tp > 1
    strategy = lightning_shard.fabric.ShardedStrategy(tensor_parallel_size=tp) if sharded else "auto"
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    model = TinyGPT()  # its validation metric on the real device; the layers on the meta device
    with fabric.init_module(empty_init=sharded):
        model.configure_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(token_loader(tp), use_distributed_sampler=False)
    start = {name: value.clone() for name, value in get_model_state_dict(model, options=FULL).items()}
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == MAX_STEPS:
            break
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    result = {"losses": losses, "start": start, "weights": get_model_state_dict(model, options=FULL)}
    if fabric.global_rank == 0:
        torch.save(result, out / f"{name}.pt")


def _model(scenario: Scenario, checkpoints: Path) -> L.LightningModule:
    if scenario.family == "gpt":
        return TinyGPT()
    if scenario.family == "litgpt":
        return LitGPT()
    if scenario.family == "llama_loss_parallel":
        return LlamaLossParallel()
    return Llama(scenario.source, str(checkpoints / "llama-pretrained"), lora=scenario.lora)


def _tensor_parallel_placements(model: nn.Module) -> dict[str, str | None]:
    """How each parameter is split over the tensor-parallel ranks (None: not split, replicated over them)."""
    placements = {}
    for name, param in model.named_parameters():
        names = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ()
        placements[name] = str(param.placements[names.index("tensor_parallel")]) if "tensor_parallel" in names else None
    return placements


def _parameter_bytes(model: nn.Module) -> int:
    """The bytes of this rank's parameters (their TP-split and FSDP-sharded pieces, or whole ones)."""
    local = [getattr(param, "_local_tensor", param) for param in model.parameters()]
    return sum(tensor.numel() * tensor.element_size() for tensor in local)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--model-parallel", action="store_true")
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "reference" if args.reference else "model_parallel" if args.model_parallel else "sharded"
    for name in args.scenarios:
        run(name, args.devices, args.tp, mode, args.checkpoints, args.out)


if __name__ == "__main__":
    main()
