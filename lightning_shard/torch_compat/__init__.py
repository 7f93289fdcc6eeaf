"""Every private torch name lightning-shard relies on, in one place: this folder, one module per torch area.

FSDP2, torch.distributed.checkpoint and torch's dispatch machinery leave a few things we need without a public
name: the FSDP state behind a module, the parameter re-registration after ``_apply``, DCP's nested-dict writer and
its archive reader, the Hugging Face reader's per-request hook, the memory tracker's categories, a module's
non-persistent buffers, the decay inside ``get_ema_avg_fn``'s function. Each is reached through these modules only,
so that a torch release that moves one breaks here, loudly, and in ``tests/test_torch_compat.py``, which exercises
every name:

- :mod:`~lightning_shard.torch_compat.fsdp`: FSDP2's unit state, forward hooks, comm interfaces, memory tracker;
- :mod:`~lightning_shard.torch_compat.modules`: the activation-checkpoint wrapper, the wrappers' names in parameter
  names, non-persistent buffers;
- :mod:`~lightning_shard.torch_compat.optim`: the ``_foreach`` averaging functions, the fused kernels' devices;
- :mod:`~lightning_shard.torch_compat.checkpoint`: DCP's writer, readers and hooks, torch's archive reader;
- :mod:`~lightning_shard.torch_compat.dispatch`: ATen ops, dispatch modes, pytrees, fake tensors;
- :mod:`~lightning_shard.torch_compat.tensors`: a tensor's storage;
- :mod:`~lightning_shard.torch_compat.distributed`: process groups, device meshes, DTensor chunks;
- :mod:`~lightning_shard.torch_compat.compile_config`: torch.compile's activation memory budget.

Checked on torch 2.11.0, 2.13.0, 2.14.1 and 2.15.0 (``scripts/torch_matrix.sh``; CI runs the tests on 2.11, 2.13 and
2.15). Where a name differs between versions, the difference is handled here and says so; no other module of the
package names a private torch attribute (``tests/test_torch_compat.py`` reads their source to keep it so).
"""
