"""The gloo collectives of ``lightning_shard.gloo_comms`` against the ones FSDP2 calls by default, on 2 gloo ranks.

    torchrun --nproc_per_node 2 tests/gloo_comms_run.py

Prints one ``RESULT <json>`` line from rank 0:
  collectives: for each (dtype, op, numel), whether GlooAllGather / GlooReduceScatter wrote exactly the bytes that
               ``all_gather_single`` / ``reduce_scatter_single`` write.
  training:    the toy model's blocks sharded by ``fully_shard`` twice from the same weights, one with FSDP2's
               default comms and one with ``install_gloo_collectives``; 6 AdamW steps on rank-specific data; the
               largest difference of the per-step losses and of the final local shards; how many buffers each
               pool holds at the end (never more than its capacity).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toy import IN_FEATURES, ToyModel  # noqa: E402

from lightning_shard.gloo_comms import GlooAllGather, GlooReduceScatter, install_gloo_collectives  # noqa: E402

STEPS = 6


def compare_collectives(rank: int, world: int) -> list[dict]:
    results = []
    all_gather, reduce_scatter = GlooAllGather(), GlooReduceScatter()
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 1000, 300_001):
            shard = torch.randn(numel, generator=torch.Generator().manual_seed(rank + numel)).to(dtype)
            expected = torch.empty(numel * world, dtype=dtype)
            dist.all_gather_single(expected, shard)
            got = all_gather.allocate((numel * world,), dtype=dtype, device=cpu)
            all_gather(got, shard, dist.group.WORLD)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                full = torch.randn(numel * world, generator=torch.Generator().manual_seed(7 * rank + numel)).to(dtype)
                reduced = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_single(reduced, full.clone(), op=op)
                ours = reduce_scatter.allocate((numel,), dtype=dtype, device=cpu)
                reduce_scatter(ours, full.clone(), dist.group.WORLD, op)
                results.append(
                    {
                        "dtype": str(dtype),
                        "numel": numel,
                        "op": str(op),
                        "all_gather_equal": torch.equal(got, expected),
                        "reduce_scatter_equal": torch.equal(ours, reduced),
                    }
                )
    return results


def train(mesh, rank: int, gloo: bool) -> tuple[list[float], list[torch.Tensor], ToyModel]:
    torch.manual_seed(0)
    model = ToyModel()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if gloo:
        install_gloo_collectives(model)
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


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"collectives": compare_collectives(rank, world)}
    mesh = init_device_mesh("cpu", (world,))
    ref_losses, ref_shards, _ = train(mesh, rank, gloo=False)
    losses, shards, model = train(mesh, rank, gloo=True)
    comm_group = model._get_fsdp_state()._fsdp_param_group
    all_gather, reduce_scatter = comm_group._all_gather_comm, comm_group._reduce_scatter_comm
    # Some local shards are empty (the head's bias on rank 1), so compare the concatenation.
    weight_diff = (torch.cat([a.flatten() for a in shards]) - torch.cat([b.flatten() for b in ref_shards])).abs().max()
    dist.all_reduce(weight_diff, op=dist.ReduceOp.MAX)
    result["training"] = {
        "installed": [type(all_gather).__name__, type(reduce_scatter).__name__],
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "weight_diff": weight_diff.item(),
        "pool_sizes": [len(all_gather._buffers), len(reduce_scatter._buffers)],
        "capacity": all_gather.capacity,
    }
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
