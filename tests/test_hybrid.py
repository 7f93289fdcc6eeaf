"""HYBRID_SHARD on a 2-D ``("replicate", "shard")`` mesh, with two simulated nodes on this machine.

Two ``torchrun --nnodes 2 --nproc_per_node 2 --node_rank {0,1}`` invocations run concurrently (Lightning detects
torchrun's environment) and train the toy model for 4 steps under ``Trainer(devices=2, num_nodes=2)``, as do 4
processes given the variables ``srun`` sets on 2 nodes x 2 tasks (Lightning's SLURMEnvironment); then

* a 2-rank FULL_SHARD run (Lightning's own launcher) resumes that sharded HSDP checkpoint to step 8 and saves;
* a 4-rank HYBRID_SHARD run on one node with ``hybrid_shard_size=2`` (mesh (2, 2)) resumes the FULL_SHARD
  checkpoint to step 10.

Everything is compared with one process (Lightning's single-device strategy) doing the same 4 / 8 / 10 step
chain on the same global batches (``toy.rank_slice_loader``): per-step global losses, full weights and full
optimizer states, tolerance 1e-5 (fp32; measured: bit-identical, 0.0). Every run clips the gradient norm, so the
norm of the 2-D DTensor gradients is covered too. About 70 s on 2 idle cores (100 s when they are busy).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, clean_env, free_port, run_script, srun_env

from lightning_shard.plan.config import ShardingConfig

TOL = 1e-5
SCRIPT = "tests/hybrid_run.py"
# Every run clips the gradient norm (active at 0.05 for the toy model): the norm of 2-D DTensor gradients.
CLIP = ("--clip", "0.05")
TIMEOUT = 150  # seconds for any one run (each takes 5-35 s on 2 cores)


def run_together(out: Path, jobs: list[tuple[list[str], dict[str, str]]], timeout: float = TIMEOUT) -> None:
    """Start every ``(command, env)`` at once, each in a session of its own; wait for all. On the first failure
    or at ``timeout``, kill every process group (a torchrun agent and its workers go together), then fail."""
    out.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for index, (command, env) in enumerate(jobs):
            log = out / f"launch{index}.log"
            with open(log, "w") as handle:
                procs.append(
                    (
                        subprocess.Popen(
                            command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
                        ),
                        log,
                    )
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p, _ in procs):
            if any(p.returncode not in (None, 0) for p, _ in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if any(p.returncode != 0 for p, _ in procs):
        logs = "\n".join(
            f"--- {' '.join(jobs[i][0][-12:])} (exit {p.returncode}) ---\n{log.read_text()[-4000:]}"
            for i, (p, log) in enumerate(procs)
        )
        pytest.fail(f"simultaneous launch failed or timed out after {timeout}s:\n{logs}")


def run_two_nodes(out: Path, *args: str, nproc_per_node: int = 2) -> None:
    """Two torchrun "nodes" of ``nproc_per_node`` ranks on this machine, as on two hosts (static rendezvous)."""
    port, env = free_port(), clean_env()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={nproc_per_node}"]
    address = ["--master_addr=127.0.0.1", f"--master_port={port}"]
    run_together(out, [([*torchrun, f"--node_rank={node}", *address, SCRIPT, *CLIP, *args], env) for node in (0, 1)])


def run_like_srun(out: Path, *args: str, nodes: int = 2, tasks_per_node: int = 2) -> None:
    """One process per task with the variables ``srun`` sets, so Lightning picks its SLURMEnvironment."""
    port, world = free_port(), nodes * tasks_per_node
    command = [sys.executable, SCRIPT, *CLIP, *args]
    run_together(out, [(command, srun_env(rank, port, nodes, tasks_per_node, "hybrid")) for rank in range(world)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hybrid")
    timings: dict[str, float] = {}

    def timed(name: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        start = time.monotonic()
        fn(*args, **kwargs)
        timings[name] = time.monotonic() - start

    # one process: 4 steps + save, resume to 8 + save, resume to 10
    ref = f"--reference --steps 4 --resume-steps 8 10 --out {out}/ref"
    timed("ref", run_script, SCRIPT, *CLIP, *ref.split(), timeout=TIMEOUT)
    # 2 nodes x 2 ranks under torchrun, HYBRID_SHARD, 4 steps + sharded save
    hsdp = f"--devices 2 --num-nodes 2 --sharding HYBRID_SHARD --steps 4 --save --out {out}/hsdp"
    timed("hsdp_2x2", run_two_nodes, out / "hsdp", *hsdp.split())
    # the same under SLURM's variables (as `srun` on 2 nodes x 2 tasks sets them), no save
    slurm = f"--devices 2 --num-nodes 2 --sharding HYBRID_SHARD --steps 4 --out {out}/slurm"
    timed("slurm_2x2", run_like_srun, out / "slurm", *slurm.split())
    # HSDP checkpoint -> FULL_SHARD on 2 ranks (Lightning's launcher), to step 8 + save
    full = f"--devices 2 --sharding FULL_SHARD --steps 8 --ckpt {out}/hsdp/model.ckpt --save --out {out}/full"
    timed("full_resume", run_script, SCRIPT, *CLIP, *full.split(), timeout=TIMEOUT)
    # FULL_SHARD checkpoint -> HYBRID_SHARD, world 4 on one node, shard groups of 2, to step 10
    one_node = (
        f"--devices 4 --sharding HYBRID_SHARD --hybrid-shard-size 2 --steps 10 --ckpt {out}/full/model.ckpt "
        f"--out {out}/hsdp_1node"
    )
    timed("hsdp_1node", run_script, SCRIPT, *CLIP, *one_node.split(), timeout=TIMEOUT)
    print("hybrid run times (s):", {k: round(v, 1) for k, v in timings.items()})
    return out


def result(runs: Path, name: str) -> dict[str, Any]:
    return torch.load(runs / name / "result.pt", weights_only=False)


def max_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two nested structures of tensors and numbers (same structure)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"keys differ: {sorted(map(str, a.keys() ^ b.keys()))}"
        return max((max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max((max_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return abs(a - b)
    assert a == b, f"{a!r} != {b!r}"
    return 0.0


def assert_hybrid_layout(layout: dict[str, Any], nodes: int, shard_size: int) -> None:
    assert layout["mesh_shape"] == (nodes, shard_size)
    assert layout["mesh_dim_names"] == ("replicate", "shard")
    assert layout["params"], "no parameters recorded"
    for name, param in layout["params"].items():
        assert param.get("mesh_shape") == (nodes, shard_size), f"{name}: {param}"
        assert param["mesh_dim_names"] == ("replicate", "shard"), f"{name}: {param}"
        assert param["placements"] == ("Replicate()", "Shard(dim=0)"), f"{name}: {param}"
    # Shard groups are consecutive ranks (one node); replicas are the same local rank on each node.
    world = nodes * shard_size
    assert layout["mesh"] == [list(range(r * shard_size, (r + 1) * shard_size)) for r in range(nodes)]
    for rank, info in enumerate(layout["ranks"]):
        assert info["rank"] == rank
        assert info["shard_group"] == list(range(rank - rank % shard_size, rank - rank % shard_size + shard_size))
        assert info["replicate_group"] == list(range(rank % shard_size, world, shard_size))


def test_two_nodes_build_a_2x2_hybrid_mesh(runs: Path) -> None:
    layout = result(runs, "hsdp")["layout"]
    assert layout["cluster_environment"] == "TorchElasticEnvironment"
    assert layout["world_size"] == 4
    assert_hybrid_layout(layout, nodes=2, shard_size=2)
    assert [(r["node_rank"], r["local_rank"]) for r in layout["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Dim 0 of every parameter is split over the 2 ranks of a node, not over all 4.
    embed = layout["params"]["embed.weight"]
    assert embed["global_shape"] == (16, 8) and embed["local_shape"] == (8, 8)


def test_slurm_tasks_build_the_same_mesh(runs: Path) -> None:
    layout = result(runs, "slurm")["layout"]
    assert layout["cluster_environment"] == "SLURMEnvironment"
    assert_hybrid_layout(layout, nodes=2, shard_size=2)
    assert [(r["node_rank"], r["local_rank"]) for r in layout["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("launch", ["hsdp", "slurm"])
def test_two_nodes_match_one_process(runs: Path, launch: str) -> None:
    hsdp, ref = result(runs, launch), result(runs, "ref")
    assert len(hsdp["losses"]) == len(ref["losses"]) == 4
    assert max_diff(hsdp["losses"], ref["losses"]) < TOL
    assert max_diff(hsdp["end"]["weights"], ref["end"]["weights"]) < TOL
    assert max_diff(hsdp["end"]["optimizer"]["state"], ref["end"]["optimizer"]["state"]) < TOL


def test_hybrid_checkpoint_resumes_under_full_shard(runs: Path) -> None:
    hsdp, full, ref = result(runs, "hsdp"), result(runs, "full"), result(runs, "ref/resume_8")
    assert full["layout"]["mesh_shape"] == (2,)
    # What the 2x2 run saved is exactly what the 2 FULL_SHARD ranks start from...
    assert max_diff(full["start"]["weights"], hsdp["end"]["weights"]) == 0.0
    assert max_diff(full["start"]["optimizer"], hsdp["end"]["optimizer"]) == 0.0
    # ...and training on matches the one-process resume of the one-process checkpoint.
    assert len(full["losses"]) == len(ref["losses"]) == 4
    assert max_diff(full["losses"], ref["losses"]) < TOL
    assert max_diff(full["end"]["weights"], ref["end"]["weights"]) < TOL
    assert max_diff(full["end"]["optimizer"]["state"], ref["end"]["optimizer"]["state"]) < TOL


def test_full_shard_checkpoint_resumes_under_hybrid_shard_size(runs: Path) -> None:
    full, hsdp, ref = result(runs, "full"), result(runs, "hsdp_1node"), result(runs, "ref/resume_10")
    layout = hsdp["layout"]
    assert layout["cluster_environment"] == "LightningEnvironment"
    assert layout["world_size"] == 4
    assert_hybrid_layout(layout, nodes=2, shard_size=2)  # `hybrid_shard_size=2`, not the 4 devices of the node
    assert max_diff(hsdp["start"]["weights"], full["end"]["weights"]) == 0.0
    assert max_diff(hsdp["start"]["optimizer"], full["end"]["optimizer"]) == 0.0
    assert len(hsdp["losses"]) == len(ref["losses"]) == 2
    assert max_diff(hsdp["losses"], ref["losses"]) < TOL
    assert max_diff(hsdp["end"]["weights"], ref["end"]["weights"]) < TOL


@pytest.mark.parametrize(
    ("world", "per_node", "size", "shape"),
    [(16, 8, None, (2, 8)), (4, 2, None, (2, 2)), (4, 4, 2, (2, 2)), (8, 8, 8, (1, 8)), (8, 8, 1, (8, 1))],
)
def test_hybrid_mesh_shape(world: int, per_node: int, size: int | None, shape: tuple[int, int]) -> None:
    config = ShardingConfig(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=size)
    assert config.mesh_shape(world_size=world, devices_per_node=per_node) == shape


def test_hybrid_shard_size_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        ShardingConfig(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=3).mesh_shape(4, 4)
