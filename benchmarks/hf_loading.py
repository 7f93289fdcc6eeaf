"""Peak memory per rank while loading a 134M-parameter Hugging Face Llama on 2 CPU ranks, and while exporting it.

    python benchmarks/hf_loading.py                     # -> benchmarks/results/checkpoints.json
    python benchmarks/hf_loading.py --repeats 1 --dir /data/tmp

The model (Llama, vocabulary 32000, width 768, 12 layers, float32: 134M parameters, 537 MB) is written once with
random weights by ``save_pretrained`` to ``--dir`` (nothing is downloaded). Every measurement runs ``--repeats``
times in fresh processes; each process resets its peak-RSS counter (``/proc/self/clear_refs``, VmHWM) right before
the work, so a figure is "peak RSS during the work minus RSS when it began" (MiB = 2**20 bytes). RSS includes the
file pages a process maps (safetensors are read through mmap, by transformers and by torch's HF reader alike): clean
page cache the kernel can drop. A thread therefore also samples the anonymous part (RssAnon) every millisecond.

* sharded: ``lightning_shard.hf.from_pretrained(AutoModelForCausalLM, dir)`` in ``configure_model()`` under
  ``ShardedStrategy`` (torchrun, 2 ranks): from the Trainer's ``setup`` hook to ``on_fit_start`` (meta build,
  ``fully_shard``, each rank reading its slices). Goal: this rank's shard + the largest tensor + 20%.
* rank 0 loads all (Accelerate's ``cpu_ram_efficient_loading``): rank 0 ``from_pretrained`` (the whole model), every
  rank builds on meta and shards it (``fully_shard`` per decoder layer + root), then ``set_model_state_dict(...,
  broadcast_from_rank0=True)`` sends tensor after tensor from rank 0 and each rank keeps its shard.
* export-hf: ``lightning-shard export-hf`` in one process, from the sharded and the full checkpoint of the same model
  trained 1 step on 2 ranks (built eagerly in ``__init__``, AdamW: the checkpoints also hold optimizer states, which
  the export must not read), with the default ``--max-shard-size 5GB`` (one file: the whole model is one shard)
  and with ``100MB``. Goal: the largest output file + the largest tensor + 20%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_shard.hf  # noqa: E402
from benchmarks.common import PeakRSS, cpu_trainer, machine, median, small_llama  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402

LLAMA = small_llama(12, vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12)
MODEL = dict(model_type="llama", **LLAMA, dtype="float32")
GOAL_MARGIN = 1.2
MIB = 2**20


# ------------------------------------------------------------------ workers (one process each, or torchrun ranks)


def worker_write_model(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from examples.hf.model import write_random_model

    n_params = write_random_model(args.model, MODEL)
    print(f"wrote a random Llama with {n_params:,} parameters to {args.model}")


def _model_figures(model: Any) -> dict[str, float]:
    """This rank's shard bytes and the largest (whole) parameter's bytes of a sharded model."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {
        "shard_mib": sum(t.numel() * t.element_size() for t in local) / MIB,
        "largest_tensor_mib": max(p.numel() * p.element_size() for p in model.parameters()) / MIB,
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def worker_load_sharded(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from transformers import AutoModelForCausalLM

    import lightning_shard
    import lightning_shard.hf

    class Probe(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            self.peak = PeakRSS()  # before configure_model(): nothing of the model exists yet

        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.record = {**self.peak.result(), **_model_figures(pl_module.model)}

    class Loaded(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, args.model)

        def training_step(self, batch: Any, batch_idx: int) -> None:  # never reached (max_steps=0)
            raise AssertionError

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_shard.ShardedStrategy(),
        max_steps=0,
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Loaded(), torch.utils.data.DataLoader(torch.zeros(2, 4, dtype=torch.long)))
    _gather_to_json(probe.record, args.json)


def worker_load_rank0(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    peak = PeakRSS()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    full = AutoModelForCausalLM.from_pretrained(args.model).state_dict() if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    dist.barrier()
    _gather_to_json({**peak.result(), **_model_figures(model)}, args.json)
    dist.destroy_process_group()


def _gather_to_json(record: dict[str, Any], path: str) -> None:
    import torch.distributed as dist

    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(records))


def worker_train(args: argparse.Namespace) -> None:
    """The checkpoints export-hf reads: the HF model built eagerly in __init__, 1 AdamW step, saved both ways."""
    import dataclasses

    import lightning as L
    import torch
    from transformers import AutoModelForCausalLM

    import lightning_shard

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(args.model)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self.model(input_ids=batch[:, :-1]).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    trainer = cpu_trainer(2, lightning_shard.ShardedStrategy(), [], max_steps=1)
    tokens = torch.randint(0, MODEL["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(0))
    trainer.fit(FineTune(), torch.utils.data.DataLoader(tokens, batch_size=1))
    out = Path(args.out)
    trainer.save_checkpoint(out / "sharded.ckpt")
    trainer.strategy.config = dataclasses.replace(trainer.strategy.config, state_dict_type="full")
    trainer.save_checkpoint(out / "full.ckpt")


def worker_export(args: argparse.Namespace) -> None:
    import huggingface_hub  # noqa: F401  (imported before the measurement starts, as export_hf would)
    import safetensors.torch  # noqa: F401
    import transformers  # noqa: F401

    from lightning_shard.hf import export_hf

    peak = PeakRSS()
    done = export_hf(args.ckpt, args.out, args.model, max_shard_size=args.max_shard_size)
    record = peak.result()
    sizes = [(Path(args.out) / f).stat().st_size for f in done.files]
    record.update(files=len(done.files), largest_file_mib=max(sizes) / MIB, total_mib=done.total_bytes / MIB)
    Path(args.json).write_text(json.dumps(record))


WORKERS = {
    "write-model": worker_write_model,
    "load-sharded": worker_load_sharded,
    "load-rank0": worker_load_rank0,
    "train": worker_train,
    "export": worker_export,
}


# ------------------------------------------------------------------ orchestration


def _run(*args: str, torchrun: bool = False) -> None:
    launcher = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] * torchrun)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([*launcher, str(Path(__file__).resolve()), *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"`{' '.join(args)}` failed with exit code {proc.returncode}")


COLUMNS = [
    "what",
    "rank",
    "peak RSS over start (MiB): median (max)",
    "of it anonymous (MiB)",
    "shard / largest file (MiB)",
    "goal (MiB)",
    "max within goal: RSS / anonymous",
    "seconds",
]


def _row(label: str, rank: int | str, runs: list[dict[str, float]], held_mib: float) -> list[Any]:
    """One report row over the repeats; the goal: what the rank must hold (its shard, or one output file) + the
    largest tensor, + 20%, met by the worst repeat."""
    goal = GOAL_MARGIN * (held_mib + runs[0]["largest_tensor_mib"])
    cells, met = [], []
    for key in ("peak_over_start_mib", "peak_anon_over_start_mib"):
        values = [run[key] for run in runs]
        cells.append(f"{median(values):.0f} ({max(values):.0f})")
        met.append("yes" if max(values) <= goal else "NO")
    seconds = median([run["seconds"] for run in runs])
    return [label, rank, *cells, f"{held_mib:.0f}", f"{goal:.0f}", " / ".join(met), f"{seconds:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("worker", nargs="?", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--max-shard-size", default="5GB", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default="/tmp/lightning_shard_hf_loading", help="model, checkpoints, exports")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement")
    parser.add_argument("--output", default=str(result_path("hf_loading")))
    args = parser.parse_args()
    if args.worker is not None:
        WORKERS[args.worker](args)
        return

    root = Path(args.dir)
    model_dir = root / "llama-134m"
    machine_start = machine()
    if not (model_dir / "config.json").is_file():
        _run("write-model", "--model", str(model_dir))
    rows, records = [], {}

    # Sharded loading needs lightning_shard.hf.from_pretrained; a commit without it measures the other rows.
    sharded_loader = hasattr(lightning_shard.hf, "from_pretrained")
    methods = [("load-sharded", "sharded from_pretrained")] * sharded_loader + [("load-rank0", "rank 0 loads all")]
    for method, label in methods:
        out = root / f"{method}.json"
        records[method] = []  # [repeat][rank]
        for _ in range(args.repeats):
            _run(method, "--model", str(model_dir), "--json", str(out), torchrun=True)
            records[method].append(json.loads(out.read_text()))
        for rank, record in enumerate(records[method][0]):
            rows.append(_row(label, rank, [ranks[rank] for ranks in records[method]], record["shard_mib"]))
    checkpoints = root / "checkpoints"
    if not (checkpoints / "full.ckpt").is_file():
        shutil.rmtree(checkpoints, ignore_errors=True)
        _run("train", "--model", str(model_dir), "--out", str(checkpoints), torchrun=True)
    largest_tensor_mib = MODEL["vocab_size"] * MODEL["hidden_size"] * 4 / MIB  # the embedding (and lm_head)
    for fmt in ("sharded", "full"):
        for shard_size in ("5GB", "100MB"):
            out, result, runs = root / "export", root / "export.json", []
            for _ in range(args.repeats):
                shutil.rmtree(out, ignore_errors=True)
                ckpt = checkpoints / f"{fmt}.ckpt"
                _run("export", "--ckpt", str(ckpt), "--out", str(out), "--model", str(model_dir),
                     "--json", str(result), "--max-shard-size", shard_size)  # fmt: skip
                runs.append({**json.loads(result.read_text()), "largest_tensor_mib": largest_tensor_mib})
            shutil.rmtree(out, ignore_errors=True)
            records[f"export-{fmt}-{shard_size}"] = runs
            label = f"export-hf, {fmt} checkpoint, --max-shard-size {shard_size} ({runs[0]['files']} files)"
            rows.append(_row(label, "-", runs, runs[0]["largest_file_mib"]))
    notes = [
        f"Model: HF Llama {MODEL['num_hidden_layers']} layers x {MODEL['hidden_size']}, vocabulary "
        f"{MODEL['vocab_size']}, float32, random weights written once by save_pretrained; largest tensor "
        f"{largest_tensor_mib:.0f} MiB (embedding, lm_head).",
        "Peak RSS over start: the process's peak RSS (VmHWM, reset through /proc/self/clear_refs when the work "
        "begins) minus its RSS at that moment: what loading or exporting added at its worst, including the file "
        "pages it maps (transformers' from_pretrained, the export and torch.load(mmap=True) read through mmap, the "
        "sharded loader with plain reads; clean page cache the kernel can drop). Anonymous: the same for RssAnon, "
        "sampled every millisecond by a thread (can miss shorter peaks).",
        "Goal: (this rank's shard, or the export's largest output file, + the largest tensor) x 1.2.",
        "rank 0 loads all: Accelerate's cpu_ram_efficient_loading done with torch's set_model_state_dict("
        "broadcast_from_rank0=True) after fully_shard on meta. transformers' from_pretrained hands back tensors "
        "backed by the mmapped safetensors file, so rank 0's whole model shows as file pages, not anonymous memory.",
    ]
    if not sharded_loader:
        notes.append("Sharded loading not measured: lightning_shard.hf.from_pretrained is not in this commit.")
    write_result(
        Path(args.output),
        "hf_loading",
        {
            "benchmark": "hf_loading",
            "machine": machine_start,
            "machine_end": machine(),
            "model": MODEL,
            "records": records,
            "report": {
                "title": "Hugging Face Llama (134M, fp32): peak memory per rank while loading on 2 ranks and exporting",
                "question": "Does sharded loading keep each rank within its shard + the largest tensor + 20%, "
                "against rank 0 loading everything, and how much memory does export-hf take?",
                "columns": COLUMNS,
                "rows": rows,
                "notes": notes,
            },
        },
    )
    for row in rows:
        print(" | ".join(map(str, row)))


if __name__ == "__main__":
    main()
