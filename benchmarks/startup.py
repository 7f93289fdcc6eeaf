"""From ``trainer.fit`` to the first step, and its setup part, for the GPT-3 family (``examples/gpt``), fresh and
resumed, on 2 CPU ranks.

    python benchmarks/startup.py                     # 125M to 2.7B -> benchmarks/results/startup.json (about 20 min)
    python benchmarks/startup.py --repeats 3         # each row launched 3 times, its quickest setup kept
    python benchmarks/startup.py --sizes small medium --paths default anchor

Paths:

* ``default``: ``Trainer(strategy="fully_sharded")``, the model built in ``configure_model()`` (the meta device, then
  the initialisation rule: every tensor equal to the eager build).
* ``anchor``: Lightning's ``ModelParallelStrategy`` with ``fully_shard`` by hand on each block and the root in
  ``configure_model()`` (built on the meta device); Lightning then materialises with ``to_empty`` + each module's
  ``reset_parameters()`` on the shards (each rank draws its shards from its own generator: not the eager values).
* ``floor``: the anchor with Lightning's materialisation cut to ``to_empty`` (no ``reset_parameters()``): the meta
  build, ``fully_shard``, the allocation and the optimizer, what no setup that keeps them goes below.
* ``eager``: the whole model built in one process (``configure_model()`` on the CPU), for scale.
* ``resume`` (``default`` only, up to 1.3B: the restore of a larger model's AdamW states does not fit in this
  machine's memory): a fresh run saves a sharded checkpoint; a new Trainer resumes it. Up to 760M the fresh run takes
  one step first; at 1.3B, whose gradients do not fit here beside the second rank, it saves before any step and the
  resumed run ends at its first batch too (the checkpoint holds the weights and AdamW's states all the same).

Times in seconds: ``setup`` from the last rank's arrival at the callbacks' ``setup`` to rank 0's ``on_fit_start``
(configure_model, sharding, materialisation, optimizer); ``to_first_step`` from ``fit`` to the first
``on_train_batch_start`` on rank 0 (process group, setup, the checkpoint restore on resume). The step itself is one
batch of 1 x 16 tokens (not measured; skipped where no checkpoint is saved after it, so that the largest size fits).
fp32, one thread per rank; the machine is shared, so its load is recorded with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.results_files import result_path, write_result  # noqa: E402
from examples.gpt.model import GPT, GPT3_SIZES  # noqa: E402

NAMES = {"small": "125M", "medium": "350M", "large": "760M", "xl": "1.3B", "2.7b": "2.7B"}
# Sizes whose training step (gradients, AdamW states) fits on this machine beside the second rank; those resumed
TRAINED = {"small", "medium", "large"}
RESUMED = {*TRAINED, "xl"}
LABELS = {
    "default": "ours, fresh",
    "resume": "ours, resumed (`fit(ckpt_path=...)`)",
    "anchor": "anchor (ModelParallelStrategy by hand)",
    "floor": "floor: the anchor without initialisation",
    "eager": "eager, one process",
}
# Seconds per billion parameters each rank spent before the split (every rank replayed the whole model; issue 37)
BEFORE_S_PER_B = 10.9
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}


class Clock(Callback):
    """The moments the startup passes on this rank (wall clock: the ranks share the host's), and when the last rank
    reached setup (``setup_all``): rank 0 waits there for a rank launched after it at its first collective, which is
    launch time, not setup work."""

    def __init__(self, start: float) -> None:
        self.times = {"fit": start}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.times.setdefault("setup", time.time())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.times["fit_start"] = time.time()
        arrivals: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(arrivals, self.times["setup"])
        self.times["setup_all"] = max(arrivals)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        self.times.setdefault("first_step", time.time())


class AnchorGPT(GPT):
    """The GPT as a user of Lightning's ModelParallelStrategy shards it by hand."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.transformer is not None:
            return
        with torch.device("meta"):
            super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.transformer["h"]:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def gpt(size: str, anchor: bool = False) -> GPT:
    n_layer, n_embd, n_head = GPT3_SIZES[size]
    return (AnchorGPT if anchor else GPT)(n_layer=n_layer, n_head=n_head, n_embd=n_embd, max_steps=10, warmup_steps=1)


def tokens() -> DataLoader:
    ids = torch.randint(0, 50272, (64, 17), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=1)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    start = time.time()
    clock = Clock(start)
    if args.path == "floor":  # `to_empty` alone: what any setup that keeps a meta build and FSDP2 cannot go below
        import lightning.pytorch.strategies.model_parallel as model_parallel

        model_parallel._materialize_distributed_module = lambda module, device: module.to_empty(device=device)
    if args.path in ("anchor", "floor"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        import lightning_shard  # noqa: F401

        strategy = "fully_sharded"
    steps = 2 if args.resume else 1
    # the first step is where the measurement ends: skipped (-1 ends the epoch) where no checkpoint follows it, or
    # where it does not fit, so that its gradients and AdamW states need no memory; a resume of a checkpoint saved
    # that way starts the second epoch
    skip = args.size not in TRAINED or not (args.save or args.resume)
    epochs = (2 if args.resume else 1) if skip else None
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, max_epochs=epochs, callbacks=[clock], **QUIET
    )
    model = gpt(args.size, anchor=args.path in ("anchor", "floor"))
    if skip:
        model.on_train_batch_start = lambda batch, index: -1  # type: ignore[method-assign]
    trainer.fit(model, tokens(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    if trainer.is_global_zero:
        t = clock.times
        params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global shape
        row = {
            "setup_s": round(t["fit_start"] - t["setup_all"], 2),
            "to_first_step_s": round(t["first_step"] - t["fit"], 2),
            "launch_s": round(t["setup_all"] - t["fit"], 2),  # the other rank's start, the process group
            "restore_s": round(t["first_step"] - t["fit_start"], 2),  # the checkpoint load on resume
            "params": params,
        }
        print("ROW " + json.dumps(row), flush=True)


def eager(size: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = gpt(size)
    start = time.perf_counter()
    model.configure_model()
    seconds = time.perf_counter() - start
    return {"setup_s": round(seconds, 2), "params": sum(p.numel() for p in model.parameters())}


def launch(*argv: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    out = subprocess.run(
        [sys.executable, __file__, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1800,
        check=False,
    ).stdout
    rows = [line[4:] for line in out.splitlines() if line.startswith("ROW ")]
    if not rows:
        raise RuntimeError(f"{argv} printed no result:\n{out[-3000:]}")
    return {**json.loads(rows[-1]), "loadavg": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["small", "medium", "large", "xl", "2.7b"])
    parser.add_argument("--paths", nargs="+", default=["default", "resume", "anchor", "eager"])
    parser.add_argument("--worker", dest="path")
    parser.add_argument("--size")
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--eager-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="launches of each row; its quickest setup is kept")
    parser.add_argument("--out", type=Path, default=result_path("startup"))
    parser.add_argument("--merge", action="store_true", help="keep the rows of the results file this run does not redo")
    args = parser.parse_args()
    if args.eager_only:
        print("ROW " + json.dumps(eager(args.size)), flush=True)
        return
    if args.path:
        worker(args)
        return
    results = kept_rows(args.out) if args.merge else []
    for size in args.sizes:
        resumed = "resume" in args.paths and size in RESUMED
        with tempfile.TemporaryDirectory() as scratch:
            checkpoint = str(Path(scratch) / "fresh.ckpt")
            for path in [p for p in args.paths if p != "resume" or resumed]:
                runs = []
                for repeat in range(args.repeats):
                    if path == "eager":
                        runs.append(launch("--eager-only", "--size", size))
                    elif path == "resume":
                        runs.append(launch("--worker", "default", "--size", size, "--resume", checkpoint))
                    else:
                        save = ("--save", checkpoint) if path == "default" and resumed and repeat == 0 else ()
                        runs.append(launch("--worker", path, "--size", size, *save))
                        if save:
                            os.sync()  # the checkpoint's dirty pages written now, not during the runs measured next
                # the quickest run: the machine is shared, and what others do only ever adds time
                row = {**min(runs, key=lambda run: run["setup_s"]), "setups_s": [run["setup_s"] for run in runs]}
                ranks = 1 if path == "eager" else 2
                per_billion = row["setup_s"] / (row["params"] / ranks / 1e9)
                new = {
                    "size": NAMES[size], "path": path, "ranks": ranks, **row, "setup_s_per_b": per_billion,
                    "layers": GPT3_SIZES[size][0],
                }  # fmt: skip
                results = in_order([r for r in results if (r["size"], r["path"]) != (new["size"], path)] + [new])
                print(new, flush=True)
                write_result(args.out, "startup", {"rows": results, "report": report(results)})


def kept_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of an earlier run in the results file ``path`` (none without one)."""
    return json.loads(path.read_text())["sections"].get("startup", {}).get("rows", []) if path.exists() else []


def in_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By size, then path in the order of ``LABELS``."""
    sizes, paths = list(NAMES.values()), list(LABELS)
    return sorted(rows, key=lambda row: (sizes.index(row["size"]), paths.index(row["path"])))


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The table of every run, the two targets against the anchor and a fresh start, and the extrapolation."""
    by = {(row["size"], row["path"]): row for row in rows}
    table = []
    for row in rows:
        anchor = by.get((row["size"], "anchor"))
        table.append([
            row["size"], LABELS[row["path"]], f"{row['setup_s']:.2f}",
            " / ".join(f"{setup:.2f}" for setup in row.get("setups_s", [row["setup_s"]])),
            f"{row['setup_s_per_b']:.1f}",
            f"{row['setup_s'] / anchor['setup_s']:.2f}" if anchor and row["path"] != "eager" else "-",
            *(f"{row[key]:.2f}" if key in row else "-" for key in ("to_first_step_s", "launch_s", "restore_s")),
            f"{row['loadavg']:.1f}",
        ])  # fmt: skip
    largest = rows[-1]["size"]
    notes = [
        "Setup = the last rank's arrival at the callbacks' `setup` to rank 0's `on_fit_start` (configure_model, "
        "sharding, materialisation, optimizer; not rank 0's wait for the rank launched after it); launch = `fit` to "
        "that arrival (the second rank's start, the process group); restore = "
        "`on_fit_start` to the first batch (the checkpoint load on resume). s / B / rank: setup per billion "
        "parameters of one rank's share (the whole model for the eager build). Each row is the launch with the "
        "quickest setup of those whose setups are listed (the machine is shared: others only ever add time); the other "
        "columns are that launch's.",
    ]
    if (largest, "default") in by and (largest, "anchor") in by:
        ratio = by[(largest, "default")]["setup_s"] / by[(largest, "anchor")]["setup_s"]
        notes.append(f"Target setup within 1.2x of the anchor at the largest size ({largest}): {ratio:.2f}x.")
    resumes = [
        (size, by[(size, "resume")]["setup_s"] / by[(size, "default")]["setup_s"])
        for size, path in by
        if path == "resume"
    ]
    if resumes:
        shares = ", ".join(f"{size} {share:.0%}" for size, share in resumes)
        notes.append(f"Target resumed setup under 10% of a fresh one: {shares}.")
    floors = [(size, by[(size, "floor")]["setup_s"]) for size, path in by if path == "resume" and (size, "floor") in by]
    if floors:
        against = ", ".join(
            f"{size} {by[(size, 'resume')]['setup_s']:.2f} s against {floor:.2f} s "
            f"({floor / by[(size, 'default')]['setup_s']:.0%})"
            for size, floor in floors
        )
        notes.append(
            "Floor = the anchor with `to_empty` alone (the meta build, `fully_shard`, the allocation, the optimizer): "
            "what no setup that keeps a meta build and FSDP2 goes below. Resumed setup against it (and the share of "
            f"a fresh setup the floor itself is): {against}."
        )
    return {
        "title": "Startup: from `fit` to the first step, fresh and resumed (GPT-3 family, 2 CPU ranks)",
        "question": "How long until training runs, and how much of it is setup (materialisation) - ours, Lightning's "
        "ModelParallelStrategy anchor (`fully_shard` by hand, `to_empty` + `reset_parameters()` on the shards) and "
        "the eager one-process build?",
        "columns": [
            "size",
            "path",
            "setup (s)",
            "setups of the launches (s)",
            "s / B / rank",
            "x anchor",
            "fit -> first step (s)",
            "launch (s)",
            "restore (s)",
            "load avg",
        ],  # fmt: skip
        "rows": table,
        "notes": notes,
        "tables": [extrapolation(by, largest)] if (largest, "default") in by and (largest, "anchor") in by else [],
    }


# Layers of the extrapolated models: fairseq's transformer_lm_gpt3_13 (configs/gpt3_13b.yaml); a 70B Llama.
EXTRAPOLATED = {13e9: 40, 70e9: 80}


def extrapolation(by: dict[tuple[str, str], dict[str, Any]], largest: str) -> dict[str, Any]:
    """Per-rank setup of 13B and 70B on 8 and 64 ranks: fresh from the largest size's seconds per billion of a rank's
    share; resumed from the largest resumed size's seconds per layer (nothing of a resume's setup touches the
    parameters' memory: what is left is per op and per module)."""
    ours, anchor = by[(largest, "default")]["setup_s_per_b"], by[(largest, "anchor")]["setup_s_per_b"]
    resumed = [row for (size, path), row in by.items() if path == "resume"]
    per_layer = resumed[-1]["setup_s"] / resumed[-1]["layers"] if resumed else None
    rows = []
    for params, ranks in ((13e9, 8), (13e9, 64), (70e9, 8), (70e9, 64)):
        share = params / ranks / 1e9
        resume = per_layer * EXTRAPOLATED[params] if per_layer else None
        rows.append([
            f"{params / 1e9:.0f}B, {ranks}", f"{ours * share:.0f}", f"{anchor * share:.0f}",
            f"{resume:.1f} ({resume / (ours * share):.0%})" if resume else "-", f"{BEFORE_S_PER_B * params / 1e9:.0f}",
        ])  # fmt: skip
    resumed_lead = (
        f"a resume at the {resumed[-1]['size']} rate per layer ({per_layer * 1000:.0f} ms; {EXTRAPOLATED[13e9]} "
        f"layers at 13B, {EXTRAPOLATED[70e9]} at 70B), whatever the ranks - its setup writes no parameter memory, "
        "so what is left grows with the ops recorded and the modules sharded"
        if resumed
        else "no resume measured"
    )
    return {
        "lead": f"Extrapolation (assumptions: fresh setup linear in a rank's share of the parameters, at the {largest} "
        "rate measured here on 2 ranks - each rank draws its rows of every weight filled in chunks and moves the "
        "stream once per such weight (a ~10 ms jump at most, so a 70B model's ~560 weights add up to ~6 s), the other "
        f"tensors go through owners at this machine's loopback speed; {resumed_lead}; before issue 37 every rank "
        f"replayed the whole model, {BEFORE_S_PER_B} s per billion parameters - the issue's quiet-machine rate):",
        "columns": [
            "model, ranks",
            "ours fresh (s / rank)",
            "anchor (s / rank)",
            "ours resumed (s / rank, share of fresh)",
            "before: every rank the whole model (s)",
        ],  # fmt: skip
        "rows": rows,
    }


if __name__ == "__main__":
    main()
