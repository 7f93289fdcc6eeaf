"""Node loss: two torchrun agents (``--nnodes=1:2``, c10d rendezvous on localhost) train the toy model with the
Trainer under ``ShardedStrategy``, saving a sharded ``last.ckpt`` every step; at step ``--kill-at`` the second agent's
worker kills its agent and itself (SIGKILL: a node gone). The first agent restarts its worker, the rendezvous closes
at world size 1, and the worker resumes ``last.ckpt`` (``ckpt_path="last"``) resharded 2 -> 1 and finishes
``--steps``. The reference is one process stopped at the same step and resumed from its own ``last.ckpt`` (a
resume restarts the epoch's batches, Lightning's rule for a plain sampler, so an uninterrupted run sees others):
its final weights against the survivor's.

    python scripts/node_loss.py [--steps 12] [--kill-at 6] [--out DIR]

Prints the survivor's resume (step, world size it resumed at, world size that saved), the agents' exit codes, the
seconds, and the largest difference of the final weights from the reference; exits 1 if it exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def worker(out: Path, steps: int, kill_at: int) -> None:
    """One rank: fit from ``last.ckpt`` if there is one; the victim agent's rank dies at step ``kill_at``."""
    sys.path.insert(0, str(REPO / "tests"))
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from toy import FULL, QUIET, ToyModel, rank_slice_loader

    import lightning_shard  # noqa: F401  (registers "fully_sharded")

    class DieAt(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            # The checkpoint of step `kill_at` is published: ModelCheckpoint saved it at the end of that step.
            if os.environ.get("NODE_LOSS_VICTIM") == "1" and trainer.global_step == kill_at:
                os.kill(os.getppid(), signal.SIGKILL)  # the agent: the whole node is gone
                os.kill(os.getpid(), signal.SIGKILL)

    class RecordResume(L.Callback):
        def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step and trainer.is_global_zero:
                record = {"resumed_at_step": trainer.global_step, "world_size": trainer.world_size}
                (out / "resumed.json").write_text(json.dumps(record))

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    L.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(dirpath=out / "ckpts", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=world_size, strategy="fully_sharded", max_steps=steps,
        callbacks=[saver, DieAt(), RecordResume()], **{**QUIET, "enable_checkpointing": True},
    )  # fmt: skip
    model = ToyModel()
    trainer.fit(model, rank_slice_loader(8), ckpt_path="last" if (out / "ckpts").exists() else None)
    weights = get_model_state_dict(model, options=FULL)
    if trainer.is_global_zero:
        torch.save(weights, out / "final.pt")


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, str(Path(__file__).resolve()), "--worker"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=6)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", action="store_true")
    args, _ = parser.parse_known_args()
    out = Path(os.environ.get("NODE_LOSS_OUT", "")) if args.worker else (args.out or Path(tempfile.mkdtemp()))
    if args.worker:
        worker(out, args.steps, args.kill_at)
        return
    import torch

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    common = ["--steps", str(args.steps), "--kill-at", str(args.kill_at)]
    reference, elastic = out / "reference", out / "elastic"
    reference.mkdir(parents=True)
    elastic.mkdir()
    start = time.time()
    for steps in (args.kill_at, args.steps):  # stopped where the victim dies, then resumed: the same batches
        subprocess.run([*torchrun("--standalone", "--nproc_per_node=1"), "--steps", str(steps)],
                       env={**env, "NODE_LOSS_OUT": str(reference)}, check=True)  # fmt: skip
    reference_seconds = time.time() - start
    port = free_port()
    rendezvous = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                  "--rdzv_id=node-loss", "--max_restarts=2", "--rdzv_conf=last_call_timeout=5"]  # fmt: skip
    start = time.time()
    logs = {name: open(out / f"agent-{name}.log", "w") for name in ("survivor", "victim")}  # noqa: SIM115
    survivor = subprocess.Popen([*torchrun(*rendezvous), *common], env={**env, "NODE_LOSS_OUT": str(elastic)},
                                stdout=logs["survivor"], stderr=subprocess.STDOUT)  # fmt: skip
    time.sleep(3)  # the survivor's agent hosts the rendezvous store
    victim = subprocess.Popen([*torchrun(*rendezvous), *common],
                              env={**env, "NODE_LOSS_OUT": str(elastic), "NODE_LOSS_VICTIM": "1"},
                              stdout=logs["victim"], stderr=subprocess.STDOUT)  # fmt: skip
    codes = {"survivor": survivor.wait(timeout=900), "victim": victim.wait(timeout=60)}
    elastic_seconds = time.time() - start
    expected, found = torch.load(reference / "final.pt"), torch.load(elastic / "final.pt")
    difference = max((expected[k] - found[k]).abs().max().item() for k in expected)
    result = {
        "agents_exit_codes": codes,
        "resume": json.loads((elastic / "resumed.json").read_text()),
        "saved_world_size": 2,
        "final_weights_max_abs_difference_vs_reference": difference,
        "tensors_compared": len(expected),
        "seconds": {"reference": round(reference_seconds, 1), "elastic_with_node_loss": round(elastic_seconds, 1)},
        "out": str(out),
    }
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0 if codes["survivor"] == 0 and codes["victim"] != 0 and difference <= args.tolerance else 1)


if __name__ == "__main__":
    main()
