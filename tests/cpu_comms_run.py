"""The CPU collectives of ``lightning_shard.cpu.gloo_comms`` and ``lightning_shard.cpu.shm_comms`` against the ones
FSDP2 calls by default, on 2 (or more) gloo ranks.

    torchrun --nproc_per_node 2 tests/cpu_comms_run.py [--collectives-only]

Prints one ``RESULT <json>`` line from rank 0:
  collectives: for each (implementation, dtype, op, numel), on the worst rank, the largest difference between what
               the implementation wrote and what FSDP2's default collectives write (also in
               units of the last place of the largest value summed), and whether the bytes are equal. The cases run
               back to back, so the shared segments are taken in turn (also with segments of 64 KiB, where the
               larger cases run in pieces, and with gloo's barrier in place of the futex barrier, as on the ranks
               that cannot use it); one rank is slowed down after every barrier, so a rank that wrote into a
               segment the other still reads would show up as a difference.
  training:    (not with ``--collectives-only``) the toy model's blocks sharded by ``fully_shard`` from the same
               weights, with FSDP2's default comms and with each installer (the shared-memory one also when the
               ranks claim different hosts, when one rank cannot reserve its segments, and when one rank's segments
               are private memory, and when the last rank cannot use the futex barrier); 6 AdamW steps on
               rank-specific data; the largest difference of the per-step losses and of the final local shards
               against the default run; which comm classes were installed; whether the shared-memory transport
               fell back to gloo for the group, and which barrier it uses.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toy import IN_FEATURES, ToyModel  # noqa: E402

from lightning_shard.core.process_exit import end_process_group  # noqa: E402
from lightning_shard.cpu import shm_comms  # noqa: E402
from lightning_shard.cpu.gloo_comms import GlooAllGather, GlooReduceScatter, install_collectives  # noqa: E402
from lightning_shard.cpu.shm_barrier import FutexBarrier  # noqa: E402

STEPS = 6
CPU = torch.device("cpu")


@contextmanager
def slow_rank_after_barrier(rank: int):
    """Rank 1 sleeps 5 ms after each barrier: its reads then come well after rank 0 could have written again."""
    synchronize = shm_comms._GroupSegments.synchronize

    def slowed(self):
        synchronize(self)
        if rank == 1:
            time.sleep(0.005)

    with mock.patch.object(shm_comms._GroupSegments, "synchronize", slowed):
        yield


# What FSDP2's default comms call: torch 2.13 names them `*_single`, torch 2.11 `all_gather_into_tensor` /
# `reduce_scatter_tensor`.
FSDP2_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
FSDP2_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def reference_cases(rank: int, world: int) -> list[dict]:
    """Inputs and what FSDP2's default collectives make of them."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 1000, 300_001):
            shard = torch.randn(numel, generator=torch.Generator().manual_seed(rank + numel)).to(dtype)
            expected = torch.empty(numel * world, dtype=dtype)
            FSDP2_ALL_GATHER(expected, shard)
            cases.append({"collective": "all_gather", "dtype": dtype, "numel": numel, "op": None, "input": shard})
            cases[-1]["expected"] = expected
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                seed = 7 * rank + numel
                full = torch.randn(numel * world, generator=torch.Generator().manual_seed(seed)).to(dtype)
                reduced = torch.empty(numel, dtype=dtype)
                FSDP2_REDUCE_SCATTER(reduced, full.clone(), op=op)
                cases.append({"collective": "reduce_scatter", "dtype": dtype, "numel": numel, "op": op, "input": full})
                cases[-1]["expected"] = reduced
    return cases


def compare_collectives(rank: int, world: int) -> list[dict]:
    cases = reference_cases(rank, world)
    small = 1 << 16  # the largest cases run in 19-37 pieces
    implementations = {
        "gloo": (GlooAllGather(), GlooReduceScatter(), nullcontext()),
        "shm": (*shared_memory_collectives(), nullcontext()),
        "shm in pieces": (*shared_memory_collectives(small), nullcontext()),
        "shm, gloo barrier": (*shared_memory_collectives(), without_futex_barrier(rank, world)),
    }
    results = []
    for name, (all_gather, reduce_scatter, barrier) in implementations.items():
        outputs = []
        # one implementation's collectives back to back, nothing in between
        with slow_rank_after_barrier(rank), barrier:
            for c in cases:
                dtype, numel = c["dtype"], c["numel"]
                if c["collective"] == "all_gather":
                    outputs.append(all_gather.allocate((numel * world,), dtype=dtype, device=CPU))
                    all_gather(outputs[-1], c["input"], dist.group.WORLD)
                else:
                    outputs.append(reduce_scatter.allocate((numel,), dtype=dtype, device=CPU))
                    reduce_scatter(outputs[-1], c["input"].clone(), dist.group.WORLD, c["op"])
        results += [compare(name, c, got) for c, got in zip(cases, outputs, strict=True)]
    return worst_over_ranks(results, world)


def shared_memory_collectives(segment_bytes: int = shm_comms.SEGMENT_BYTES) -> tuple:
    transport = shm_comms.SharedMemoryTransport(segment_bytes)
    return shm_comms.SharedMemoryAllGather(transport), shm_comms.SharedMemoryReduceScatter(transport)


def without_futex_barrier(rank: int, world: int):
    """The last rank cannot use the futex barrier (another architecture, or another pid namespace): the group must
    agree on gloo's barrier."""
    return mock.patch.object(shm_comms, "_barrier_namespace", lambda: None) if rank == world - 1 else nullcontext()


def worst_over_ranks(results: list[dict], world: int) -> list[dict]:
    """Each case as the worst rank saw it: a rank that read too late is often not rank 0."""
    per_rank: list[list[dict]] = [[] for _ in range(world)]
    dist.all_gather_object(per_rank, results)
    for i, row in enumerate(results):
        row["equal"] = all(rows[i]["equal"] for rows in per_rank)
        row["max_diff"] = max(rows[i]["max_diff"] for rows in per_rank)
        row["ulps"] = max(rows[i]["ulps"] for rows in per_rank)
    return results


def compare(name: str, case: dict, got: torch.Tensor) -> dict:
    expected, dtype = case["expected"], case["dtype"]
    diff = (got.float() - expected.float()).abs().max()
    return {
        "implementation": name,
        "collective": case["collective"],
        "dtype": str(dtype),
        "numel": case["numel"],
        "op": str(case["op"]),
        "equal": torch.equal(got, expected),
        "max_diff": diff.item(),
        # the difference in units of the last place of the largest value summed (the precision of one rounding)
        "ulps": (
            diff / (torch.finfo(dtype).eps * max(expected.float().abs().max(), case["input"].float().abs().max()))
        ).item(),
    }


def install_gloo(model) -> None:
    install_collectives(model, GlooAllGather(), GlooReduceScatter())


def claim_different_hosts(rank: int):
    return mock.patch.object(shm_comms, "_host_identity", lambda: f"host-{rank}")


def reserve_on_rank_1(rank: int, replacement):
    """Rank 1 gets ``replacement(path, nbytes)`` in place of a mapped segment; the other ranks map theirs."""
    reserve = shm_comms._reserve_segment
    return mock.patch.object(
        shm_comms, "_reserve_segment", lambda path, nbytes: (replacement if rank == 1 else reserve)(path, nbytes)
    )


def fail_reservation_on_rank_1(rank: int):
    return reserve_on_rank_1(rank, lambda path, nbytes: None)


def separate_memory_on_rank_1(rank: int):
    """Rank 1's segments are private memory: what two containers with one hostname but separate /dev/shm give."""
    return reserve_on_rank_1(rank, lambda path, nbytes: torch.zeros(nbytes, dtype=torch.uint8))


def train(mesh, rank: int, install) -> tuple[list[float], list[torch.Tensor], ToyModel]:
    torch.manual_seed(0)
    model = ToyModel()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if install is not None:
        install(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(4, IN_FEATURES, generator=data), torch.randn(4, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item())
    return losses, [p.to_local().detach().clone() for p in model.parameters()], model


def barrier_kind(segments: shm_comms._GroupSegments) -> str:
    return "futex" if isinstance(segments.barrier, FutexBarrier) else "gloo"


def compare_training(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    ref_losses, ref_shards, _ = train(mesh, rank, None)
    runs = {
        "gloo": (install_gloo, None),
        "shm": (shm_comms.install_shared_memory_collectives, None),
        "shm, ranks on different hosts": (shm_comms.install_shared_memory_collectives, claim_different_hosts),
        "shm, no segment on rank 1": (shm_comms.install_shared_memory_collectives, fail_reservation_on_rank_1),
        "shm, memory not shared": (shm_comms.install_shared_memory_collectives, separate_memory_on_rank_1),
        "shm, gloo barrier": (shm_comms.install_shared_memory_collectives, lambda r: without_futex_barrier(r, world)),
    }
    result = {}
    for name, (install, patch) in runs.items():
        with warnings.catch_warnings(record=True) as caught, patch(rank) if patch else nullcontext():
            warnings.simplefilter("always")
            losses, shards, model = train(mesh, rank, install)
        comm_group = model._get_fsdp_state()._fsdp_param_group
        all_gather, reduce_scatter = comm_group._all_gather_comm, comm_group._reduce_scatter_comm
        # Some local shards are empty (the head's bias on rank 1), so compare the concatenation.
        diff = (torch.cat([a.flatten() for a in shards]) - torch.cat([b.flatten() for b in ref_shards])).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        transport = getattr(all_gather, "transport", None)
        result[name] = {
            "installed": [type(all_gather).__name__, type(reduce_scatter).__name__],
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "weight_diff": diff.item(),
            "pool_sizes": [len(all_gather._buffers), len(reduce_scatter._buffers)],
            "capacity": all_gather.capacity,
            "fell_back_to_gloo": None if transport is None else [s is None for s in transport._groups.values()],
            "barrier": None if transport is None else [barrier_kind(s) for s in transport._groups.values() if s],
            "warnings": [str(w.message) for w in caught if "lightning_shard" in str(w.message)],
        }
    return result


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"world": world, "collectives": compare_collectives(rank, world)}
    if "--collectives-only" not in sys.argv:
        result["training"] = compare_training(rank, world)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
