"""LoRA (peft) on tiny Hugging Face models under the sharded strategy: train, measure what frozen parameters cost,
save small checkpoints and resume from them; save per-step global losses, the weights when training starts and ends,
and per-rank gradient and optimizer-state bytes.

    python tests/lora_run.py --devices 2 --out OUT --checkpoints DIR
    python tests/lora_run.py --devices 1 --reference --out OUT --checkpoints DIR --refuse OUT2

Scenarios: ``{llama, gpt2} x {config, pretrained} x {meta, eager}``: a tiny Llama or a tied GPT-2, from a config or
from ``DIR``'s ``save_pretrained`` files, wrapped by ``get_peft_model(..., LoraConfig(r=8, ...))`` in
``configure_model()`` (meta: the strategy builds it on the meta device) or in ``__init__`` (eager: every rank builds
it whole). ``--reference`` runs one process (Lightning's single-device strategy) building each model eagerly with
transformers' own ``from_config`` / ``from_pretrained`` and peft. The pretrained meta scenarios run with
``save_frozen_pretrained_weights=False`` and save a checkpoint at the end of the first epoch (Llama sharded, GPT-2
full), then resume a fresh model from it. ``--refuse OUT2``: resume the 2-rank run's small checkpoints from pretrained
files that are missing or changed, or without pretrained files; record the errors.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_run import gpt2_config, llama_config, per_rank, token_loader  # noqa: E402
from toy import QUIET, GlobalLossRecorder, StateRecorder, raise_if_peer_gone  # noqa: E402

import lightning_shard  # noqa: E402
import lightning_shard.hf  # noqa: E402

FAMILIES = ("llama", "gpt2")
EPOCH_STEPS = 8  # 64 samples, global batch 8 (hf_run.token_loader)
MAX_STEPS = EPOCH_STEPS + 2
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
# The pretrained meta scenarios' small checkpoints: sharded for Llama, one full file for GPT-2.
SMALL_CHECKPOINT = {"llama": "sharded", "gpt2": "full"}


def write_checkpoints(root: Path) -> None:
    """The pretrained bases (``save_pretrained``), and the variants a resume must refuse: the Llama re-saved in bf16
    (same file name, another size and header), re-saved in two files (``model.safetensors`` missing), and another
    fine-tune of it (every weight moved a little: the same file name, size and header, other values)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    llama = AutoModelForCausalLM.from_config(llama_config())
    llama.save_pretrained(root / "llama")
    AutoModelForCausalLM.from_config(gpt2_config()).save_pretrained(root / "gpt2")
    llama.save_pretrained(root / "llama-resharded", max_shard_size="150KB")
    with torch.no_grad():
        other = copy.deepcopy(llama)
        for param in other.parameters():
            param.add_(0.01 * torch.randn_like(param))
    other.save_pretrained(root / "llama-finetuned")
    llama.to(torch.bfloat16).save_pretrained(root / "llama-changed")


def lora_fields(family: str) -> dict[str, Any]:
    """The ``LoraConfig`` arguments of ``family``'s adapters (GPT-2's ``Conv1D`` stores its weights transposed)."""
    return {"r": 8, "lora_alpha": 16, "target_modules": TARGETS[family], "fan_in_fan_out": family == "gpt2"}


class LoraModule(L.LightningModule):
    """``self.model = get_peft_model(base, LoraConfig(r=8, target_modules=TARGETS[family]))``, the base from a config
    or ``pretrained`` (``lightning_shard.hf.from_pretrained``: shard by shard on the meta device, transformers'
    ``from_pretrained`` elsewhere), built in ``__init__`` (``build="eager"``) or ``configure_model()``."""

    def __init__(self, family: str, pretrained: str | None = None, build: str = "meta") -> None:
        super().__init__()
        self.family, self.pretrained = family, pretrained
        self.model = self._build() if build == "eager" else None

    def _build(self) -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if self.pretrained is not None:
            base = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, self.pretrained, dtype=torch.float32)
        else:
            base = AutoModelForCausalLM.from_config(llama_config() if self.family == "llama" else gpt2_config())
        return get_peft_model(base, LoraConfig(**lora_fields(self.family)))

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._build()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # every parameter, frozen ones too: AdamW must keep state for the trainable ones only
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class CostRecorder(L.Callback):
    """Per rank, at the first optimizer step: bytes of the gradients and which parameters have one; after fit:
    bytes of the optimizer states and which parameters have them, and the local bytes of trainable and frozen
    parameters."""

    def __init__(self) -> None:
        self.costs: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if "grad_bytes" in self.costs:
            return
        grads = {name: p.grad for name, p in pl_module.named_parameters() if p.grad is not None}
        self.costs["with_grad"] = sorted(grads)
        self.costs["grad_bytes"] = sum(_local_bytes(grad) for grad in grads.values())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        names = {id(p): name for name, p in pl_module.named_parameters()}
        states = {names[id(p)]: state for p, state in optimizer.state.items() if state}
        self.costs["with_state"] = sorted(states)
        self.costs["state_bytes"] = sum(
            _local_bytes(value) for state in states.values() for value in state.values() if value.ndim
        )
        for kind, trainable in (("trainable", True), ("frozen", False)):
            self.costs[f"{kind}_bytes"] = sum(
                _local_bytes(p) for p in pl_module.parameters() if p.requires_grad == trainable
            )


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def fit(module: LoraModule, devices: int, strategy: Any, callbacks: list[L.Callback], ckpt_path: str | None = None):
    losses, states, costs = GlobalLossRecorder(), StateRecorder(), CostRecorder()
    checkpointing = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=MAX_STEPS,
        callbacks=[losses, states, costs, *callbacks],
        **{**QUIET, "enable_checkpointing": checkpointing},
    )
    trainer.fit(module, train_dataloaders=token_loader(), ckpt_path=ckpt_path)
    return trainer, losses, states, costs


def run(family: str, source: str, build: str, devices: int, reference: bool, checkpoints: Path, out: Path) -> None:
    pretrained = str(checkpoints / family) if source == "pretrained" else None
    # the pretrained meta scenarios (2 ranks) save small checkpoints; the reference saves Lightning's own
    resumes = source == "pretrained" and (build == "meta" or reference)
    small = resumes and not reference
    # every epoch end: the first one's (step 8) is resumed; fit also ends an epoch at max_steps (step 10)
    saver = ModelCheckpoint(out, f"{family}-small-{{step}}", save_top_k=-1, save_on_train_epoch_end=True)

    def strategy() -> Any:
        if reference:
            return "auto"
        return lightning_shard.ShardedStrategy(
            save_frozen_pretrained_weights=not small, state_dict_type=SMALL_CHECKPOINT[family] if small else None
        )

    L.seed_everything(0, verbose=False)
    module = LoraModule(family, pretrained, "eager" if reference else build)
    trainer, losses, states, costs = fit(module, devices, strategy(), [saver] if resumes else [])
    result: dict[str, Any] = {
        "losses": losses.losses,
        "start": states.states["start"]["weights"],
        "end": states.states["end"]["weights"],
        "costs": per_rank(costs.costs),
    }
    if family == "gpt2":
        inner = module.model.base_model.model
        result["tied"] = inner.lm_head.weight is inner.transformer.wte.weight
    if resumes:
        path = out / f"{family}-small-step={EPOCH_STEPS}.ckpt"
        result["checkpoint"] = str(path)
        L.seed_everything(0, verbose=False)
        _, resumed_losses, resumed_states, _ = fit(
            LoraModule(family, pretrained, build), devices, strategy(), [], ckpt_path=str(path)
        )
        result["resumed"] = {"losses": resumed_losses.losses, "start": resumed_states.states["start"]["weights"]}
    if trainer.is_global_zero:
        torch.save(result, out / f"{family}-{source}-{build}.pt")


def refuse(checkpoints: Path, two: Path, out: Path) -> None:
    """Resume the 2-rank run's small Llama checkpoint (one process) from files that differ from the recorded ones,
    and from a model that did not read its base from files; record each error."""
    checkpoint = torch.load(two / "llama-pretrained-meta.pt", weights_only=False)["checkpoint"]
    cases = {
        "changed": LoraModule("llama", str(checkpoints / "llama-changed")),
        "finetuned": LoraModule("llama", str(checkpoints / "llama-finetuned")),
        "missing": LoraModule("llama", str(checkpoints / "llama-resharded")),
        "not_pretrained": LoraModule("llama"),
    }
    errors = {}
    for name, module in cases.items():
        try:
            fit(module, 1, lightning_shard.ShardedStrategy(), [], ckpt_path=checkpoint)
            errors[name] = None
        except Exception as error:  # recorded for the test to match
            raise_if_peer_gone(error)
            errors[name] = f"{type(error).__name__}: {error}"
    torch.save(errors, out / "refusals.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--refuse", type=Path, help="the 2-rank run's output directory: resume its checkpoints")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    builds = ["eager"] if args.reference else ["meta", "eager"]
    for family in FAMILIES:
        for source in ("config", "pretrained"):
            for build in builds:
                run(family, source, build, args.devices, args.reference, args.checkpoints, args.out)
    if args.refuse is not None:
        refuse(args.checkpoints, args.refuse, args.out)


if __name__ == "__main__":
    main()
