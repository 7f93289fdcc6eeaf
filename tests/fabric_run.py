"""Lightning Fabric training loops on ``lightning_shard.fabric.ShardedStrategy``; results are saved per scenario.

    python tests/fabric_run.py --devices 2 --out TWO                 # the sharded runs: every scenario, one launch
    python tests/fabric_run.py --devices 1 --reference --out REF     # plain Fabric on one process: the reference
    python tests/fabric_run.py --devices 1 --resume TWO --out ONE    # the strategy on one process, from TWO's files

Fabric's own launcher re-runs this script for rank 1. Each rank sees its slice of every global batch
(``toy.RankSliceBatchSampler``), so the mean of the ranks' losses is the one-process loss. Scenarios:

* ``gpt``: the tiny GPT of ``examples/gpt`` built by ``fabric.init_module(empty_init=True)`` (meta, then the init
  rule), its optimizer created before ``fabric.setup(model, optimizer)``, 2 accumulation micro-batches under
  ``no_backward_sync`` with ``gradient_accumulation="unsharded"``, clipping, then ``generate``.
* ``llama``: a transformers Llama from its config, ``setup_module`` + ``setup_optimizers``, then ``generate``.
* ``litgpt_sharded`` / ``litgpt_full``: litgpt's ``GPT`` in a loop shaped like ``litgpt/finetune/full.py``: weights
  from ``fabric.load_raw``, accumulation under ``no_backward_sync``, clipping, ``fabric.save`` half-way, then a fresh
  model and optimizer ``fabric.load`` it and train on.
* ``bf16_mixed`` / ``bf16_true`` / ``fp16_mixed``: Fabric's precision strings (fp16 through the plugin: Fabric turns
  "16-mixed" into bf16 on a CPU), the dtypes seen inside a block.
* ``compile``: ``compile=`` per block under a user's ``torch.compile(model)``, which Fabric re-applies after setup.
* ``interop``: a Trainer checkpoint (both formats) loads into a Fabric loop that trains on; its checkpoint loads back.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_run import PROMPT, litgpt_config, llama_config, token_loader  # noqa: E402
from toy import FULL, QUIET, GlobalLossRecorder, RankSliceBatchSampler, raise_if_peer_gone  # noqa: E402

import lightning_shard  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_shard.fabric import ShardedPrecision, ShardedStrategy  # noqa: E402
from lightning_shard.memory.accounting import held_bytes, unsharded_gradients  # noqa: E402

TINY_GPT = {
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 32,
    "vocab_size": 128,
    "block_size": 16,
    "max_steps": 4,
    "warmup_steps": 1,
}
STEPS, ACCUMULATE, SAVE_AT, MAX_NORM = 4, 2, 2, 0.5
PRECISIONS = {"bf16_mixed": "bf16-mixed", "bf16_true": "bf16-true", "fp16_mixed": "16-mixed"}


# ---------------------------------------------------------------- helpers


def make_fabric(args: argparse.Namespace, precision: str = "32-true", **strategy: Any) -> L.Fabric:
    if args.reference:
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    else:
        plugins = [ShardedPrecision(precision)] if precision == "16-mixed" else None
        fabric = L.Fabric(
            accelerator="cpu",
            devices=args.devices,
            strategy=ShardedStrategy(**strategy),
            precision=None if plugins else precision,
            plugins=plugins,
        )
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    return fabric


def global_mean(fabric: L.Fabric, loss: torch.Tensor) -> float:
    return float(fabric.all_reduce(loss.detach().float().clone(), reduce_op="mean"))


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole weights, on every rank (gathered from the shards; a plain model's own, copied)."""
    inner = getattr(model, "module", model)
    sharded = any(isinstance(p, DTensor) for p in inner.parameters())
    state = get_model_state_dict(inner, options=FULL) if sharded else inner.state_dict()
    return tree_map(lambda t: t.detach().float().cpu().clone() if isinstance(t, torch.Tensor) else t, state)


def batches(loader: DataLoader, count: int) -> list[Any]:
    """The first ``count`` batches, cycling through the loader."""
    out: list[Any] = []
    while len(out) < count:
        out.extend(itertools.islice(loader, count - len(out)))
    return out


def save(fabric: L.Fabric, out: Path, name: str, result: dict[str, Any]) -> None:
    if fabric.global_rank == 0:
        torch.save(result, out / f"{name}.pt")


# ---------------------------------------------------------------- scenarios


def run_gpt(args: argparse.Namespace, name: str = "gpt") -> None:
    """The tiny GPT; also serves the precision and compile scenarios (``name``)."""
    precision = PRECISIONS.get(name, "32-true")
    strategy: dict[str, Any] = {"auto_wrap_policy": ["Block"], "gradient_accumulation": "unsharded"}
    outer_graphs, unit_graphs = [], []
    if name == "compile":
        strategy["compile"] = {"backend": _counting_backend(unit_graphs)}
    fabric = make_fabric(args, precision, **strategy)
    model = GPT(**TINY_GPT)
    with fabric.init_module(empty_init=not args.reference):
        model.configure_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # before setup: the strategy re-points it
    if name == "compile":
        model = torch.compile(model, backend=_counting_backend(outer_graphs))
    model, optimizer = fabric.setup(model, optimizer)
    seen: dict[str, str] = {}
    if name in PRECISIONS:
        # FSDP's pre-forward hook (prepended) has gathered and cast the block's parameters when this one runs
        block = model.module.transformer["h"][0]
        block.register_forward_pre_hook(
            lambda m, a: seen.update(input=str(a[0].dtype), weight=str(m.ln_1.weight.dtype))
        )
    losses, norms, held = [], [], []
    data = batches(token_loader(), STEPS * ACCUMULATE)
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            (tokens,) = data[step * ACCUMULATE + micro]
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
                fabric.backward(loss / ACCUMULATE)
            losses.append(global_mean(fabric, loss))
            if not args.reference:
                held.append(held_bytes(unsharded_gradients(model.module)))
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    graphs = {"outer_graphs": len(outer_graphs), "unit_graphs": len(unit_graphs)}  # before generate runs
    prompt = torch.tensor(PROMPT) % TINY_GPT["vocab_size"]
    generated = None if name == "compile" else model.generate(prompt, max_new_tokens=6, top_k=1)
    result = {
        "losses": losses,
        "norms": norms,
        "weights": full_weights(model),
        "generated": None if generated is None else generated.tolist(),
        "held_unsharded_gradient_bytes": held,
        "forward_dtypes": seen,
        "stored_dtype": str(next(model.parameters()).dtype),
        **graphs,
        "collectives": _collectives(fabric),
    }
    save(fabric, args.out, name, result)


def run_llama(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    fabric = make_fabric(args)
    with fabric.init_module(empty_init=not args.reference):
        model = AutoModelForCausalLM.from_config(llama_config())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = []
    for (tokens,) in batches(token_loader(), STEPS):
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_mean(fabric, loss))
    with torch.no_grad():
        generated = model.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, pad_token_id=0)
    save(fabric, args.out, "llama", {"losses": losses, "weights": full_weights(model), "generated": generated.tolist()})


def run_litgpt(args: argparse.Namespace, state_dict_type: str) -> None:
    """A loop shaped like litgpt's ``finetune/full.py``; the sharded runs save half-way and resume a fresh model."""
    fabric = make_fabric(args, state_dict_type=state_dict_type)
    initial = args.out.parent / "lit_model.pth"  # the runs' common starting weights, as litgpt loads them
    checkpoint = args.out / f"litgpt-{state_dict_type}.ckpt"
    losses, weights, start = _litgpt_train(fabric, initial, checkpoint, resume=None if args.reference else False)
    result: dict[str, Any] = {"losses": losses, "weights": weights, "start": start}
    if not args.reference:
        # a fresh model and optimizer load the half-way checkpoint and train to the end
        fabric.seed_everything(1, verbose=False)
        losses, weights, start = _litgpt_train(fabric, initial, checkpoint, resume=True)
        result["resumed"] = {"losses": losses, "weights": weights, "start": start}
    save(fabric, args.out, f"litgpt_{state_dict_type}", result)


def _litgpt_train(
    fabric: L.Fabric, initial: Path, checkpoint: Path, resume: bool | None
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    from litgpt import GPT as LitGPT
    from litgpt.finetune.full import get_lr_scheduler
    from litgpt.utils import chunked_cross_entropy

    if not initial.exists() and fabric.global_rank == 0:
        # written once, by the first run: weights from another seed than the runs' own init (before the meta build:
        # rank 0 alone reseeding inside its recording would make the ranks' recordings differ)
        with torch.random.fork_rng():
            torch.manual_seed(123)
            torch.save(LitGPT(litgpt_config()).state_dict(), initial)
    fabric.barrier()
    with fabric.init_module(empty_init=fabric.world_size > 1):
        model = LitGPT(litgpt_config())
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.02))
    scheduler = get_lr_scheduler(optimizer, warmup_steps=1, max_steps=STEPS)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0, "step_count": 0}
    if resume:
        fabric.load(checkpoint, state)
    else:
        fabric.load_raw(initial, model)
    start_weights = full_weights(model)
    data = batches(token_loader(), STEPS * ACCUMULATE)
    losses = []
    while state["step_count"] < STEPS:
        (tokens,) = data[state["iter_num"]]
        state["iter_num"] += 1
        is_accumulating = state["iter_num"] % ACCUMULATE != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(tokens)
            loss = chunked_cross_entropy(logits[..., :-1, :], tokens[..., 1:])
            fabric.backward(loss / ACCUMULATE)
        losses.append(global_mean(fabric, loss))
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            state["step_count"] += 1
            if state["step_count"] == SAVE_AT and resume is not None and not resume:
                fabric.save(checkpoint, state)
    return losses, full_weights(model), start_weights


def run_interop(args: argparse.Namespace) -> None:
    """Trainer -> Fabric -> Trainer: a Trainer run saves at step 2 and trains on to step 4 (the reference); a Fabric
    loop loads the step-2 checkpoint and trains to step 4, then saves; a Trainer loads that checkpoint back."""
    result: dict[str, Any] = {}
    for state_dict_type in ("sharded", "full"):
        trainer_ckpt = args.out / f"trainer-{state_dict_type}.ckpt"
        fabric_ckpt = args.out / f"fabric-{state_dict_type}.ckpt"
        reference = _trainer_fit(args, state_dict_type, trainer_ckpt)
        fabric = make_fabric(args, state_dict_type=state_dict_type)
        model = GPT(**TINY_GPT)
        with fabric.init_module(empty_init=True):
            model.configure_model()
        model = fabric.setup(model)
        configured = model.configure_optimizers()
        optimizer = fabric.setup_optimizers(configured["optimizer"])
        scheduler = configured["lr_scheduler"]["scheduler"]
        state = {"model": model, "optimizer": optimizer}
        rest = fabric.load(trainer_ckpt, state)
        scheduler.load_state_dict(rest["lr_schedulers"][0])
        losses = []
        for batch in batches(_interop_loader(), STEPS - SAVE_AT):
            loss = model._loss(batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            losses.append(global_mean(fabric, loss))
        fabric.save(fabric_ckpt, {**state, "step": rest["global_step"] + len(losses)})
        back = _trainer_validate(args, state_dict_type, fabric_ckpt)
        result[state_dict_type] = {
            "trainer_losses": reference["losses"],
            "fabric_losses": losses,
            "trainer_weights": reference["weights"],
            "fabric_weights": full_weights(model),
            "restored_rest": sorted(rest),
            "back_weights": back,
        }
    save(fabric, args.out, "interop", result)


def _interop_loader() -> DataLoader:
    """Two global batches an epoch (the Trainer's step-2 checkpoint falls on an epoch boundary), as (x, y)."""
    (tokens,) = token_loader().dataset.tensors
    dataset = TensorDataset(tokens[:16, :-1], tokens[:16, 1:])
    return DataLoader(dataset, batch_sampler=_Slices(8, 16))


class _Slices(RankSliceBatchSampler):
    def __init__(self, global_batch: int, samples: int) -> None:
        super().__init__(global_batch)
        self.samples = samples

    def __iter__(self) -> Any:
        return (batch for batch in super().__iter__() if batch[-1] < self.samples)


def _trainer_fit(args: argparse.Namespace, state_dict_type: str, checkpoint: Path) -> dict[str, Any]:
    def fit(max_steps: int, ckpt_path: Path | None) -> tuple[L.Trainer, GlobalLossRecorder, GPT]:
        L.seed_everything(0, verbose=False)
        model, losses = GPT(**TINY_GPT), GlobalLossRecorder()
        strategy = lightning_shard.ShardedStrategy(state_dict_type=state_dict_type)
        trainer = L.Trainer(
            accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=max_steps, callbacks=[losses], **QUIET
        )
        trainer.fit(model, _interop_loader(), ckpt_path=ckpt_path)
        return trainer, losses, model

    trainer, _, _ = fit(SAVE_AT, None)
    trainer.save_checkpoint(checkpoint)
    _, losses, model = fit(STEPS, checkpoint)
    return {"losses": losses.losses, "weights": full_weights(model)}


def _trainer_validate(args: argparse.Namespace, state_dict_type: str, checkpoint: Path) -> dict[str, torch.Tensor]:
    model = GPT(**TINY_GPT)
    strategy = lightning_shard.ShardedStrategy(state_dict_type=state_dict_type)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, **QUIET)
    trainer.validate(model, _interop_loader(), ckpt_path=checkpoint, verbose=False)
    return full_weights(model)


def run_resume(args: argparse.Namespace) -> None:
    """One process on the strategy, from the two-rank run's files: its litgpt checkpoints train on to the end; its
    Fabric checkpoint loads into a Trainer; damaged copies raise."""
    result: dict[str, Any] = {}
    for state_dict_type in ("sharded", "full"):
        fabric = make_fabric(args, state_dict_type=state_dict_type)
        fabric.seed_everything(1, verbose=False)
        initial = args.resume.parent / "lit_model.pth"
        losses, weights, start = _litgpt_train(fabric, initial, args.resume / f"litgpt-{state_dict_type}.ckpt", True)
        result[f"litgpt_{state_dict_type}"] = {"losses": losses, "weights": weights, "start": start}
        result[f"back_{state_dict_type}"] = _trainer_validate(
            args, state_dict_type, args.resume / f"fabric-{state_dict_type}.ckpt"
        )
    result["filtered"] = _filtered_save(args)
    result["errors"] = _load_errors(args)
    save(fabric, args.out, "resume", result)


def _filtered_save(args: argparse.Namespace) -> dict[str, Any]:
    """``fabric.save(..., filter=...)`` leaves out the first block's weights; a non-strict load keeps the target's."""
    models = {}
    for seed in (0, 5):
        fabric = make_fabric(args)
        fabric.seed_everything(seed, verbose=False)
        model = GPT(**TINY_GPT)
        with fabric.init_module(empty_init=True):
            model.configure_model()
        models[seed] = fabric.setup(model)
    before = {seed: full_weights(model) for seed, model in models.items()}
    path = args.out / "filtered.ckpt"
    fabric.save(path, {"model": models[0]}, filter={"model": lambda name, value: ".h.0." not in name})
    fabric.load(path, {"model": models[5]}, strict=False)
    try:
        fabric.load(path, {"model": models[5]})
        strict_error = ""
    except Exception as error:  # recorded for the test
        raise_if_peer_gone(error)
        strict_error = f"{type(error).__name__}: {error}"
    return {"saved": before[0], "target": before[5], "loaded": full_weights(models[5]), "strict_error": strict_error}


def _load_errors(args: argparse.Namespace) -> dict[str, str]:
    """What loading damaged or mismatched checkpoints raises, and `fit` from a Fabric checkpoint."""
    import shutil

    errors: dict[str, str] = {}
    sharded = args.out / "damaged-sharded.ckpt"
    shutil.copytree(args.resume / "fabric-sharded.ckpt", sharded)
    shard = next(sharded.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    full = args.out / "damaged-full.ckpt"
    full.write_bytes((args.resume / "fabric-full.ckpt").read_bytes()[:1000])
    cases = {"truncated_shard": sharded, "damaged_file": full, "other_model": args.resume / "litgpt-sharded.ckpt"}
    for case, path in cases.items():
        fabric = make_fabric(args)
        model = GPT(**TINY_GPT)
        with fabric.init_module(empty_init=True):
            model.configure_model()
        model = fabric.setup(model)
        try:
            fabric.load(path, {"model": model})
        except Exception as error:  # recorded for the test to compare
            raise_if_peer_gone(error)
            errors[case] = f"{type(error).__name__}: {error}"
    model = GPT(**TINY_GPT)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=lightning_shard.ShardedStrategy(), max_steps=1, **QUIET)
    try:
        trainer.fit(model, _interop_loader(), ckpt_path=args.resume / "fabric-sharded.ckpt")
    except Exception as error:
        raise_if_peer_gone(error)
        errors["fit_from_fabric"] = f"{type(error).__name__}: {error}"
    return errors


def _counting_backend(graphs: list[Any]) -> Any:
    """A torch.compile backend that runs each captured graph as it is and records it."""

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(len(graph_module.graph.nodes))
        return graph_module.forward

    return backend


def _collectives(fabric: L.Fabric) -> list[Any]:
    """``fabric.broadcast`` / ``all_reduce`` / ``barrier`` as each rank saw them."""
    fabric.barrier()
    seen = (
        fabric.broadcast(fabric.global_rank + 7),
        float(fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum")),
    )
    if not dist.is_initialized():
        return [seen]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    return everyone


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume is not None:
        run_resume(args)
        return
    run_gpt(args)
    run_llama(args)
    for state_dict_type in ("sharded", "full"):
        run_litgpt(args, state_dict_type)
    if args.reference:
        return
    for name in (*PRECISIONS, "compile"):
        run_gpt(args, name)
    run_interop(args)


if __name__ == "__main__":
    main()
