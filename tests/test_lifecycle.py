"""Lifecycle and buffers: ``tests/lifecycle_run.py`` on 2 gloo ranks in one torchrun launch (35-95 s on the 2 shared
cores), read by every test here; the rest run in this process in well under a second.

Lifecycle: every run - fit, a fit that fails (a wrong ``ckpt_path``), fit again on the same Trainer, validate / test /
predict before and after fit, a second Trainer and a second Fabric on a sharded model, compile under a memory
budget, five ``preemptible()`` blocks - leaves the process as it found it: signal handlers, torch's process-wide
settings, process groups, Python threads, the class and patched attributes of the Trainer's callbacks, connector and
loops (the run script's ``snapshot``). On 5f9ef12: the ``_link_checkpoint`` patch and ``inference_mode=False`` stay
on the user's objects, one process group more per fit and five per five blocks, the budget stays 0.5, the fit after
the failed one raises ``AttributeError: '_SignalConnector' object has no attribute 'register_signal_handlers'``, and a
second Trainer asking bf16-mixed and activation checkpointing trains in fp32 without checkpointing.

Buffers: a ResNet-like CNN with BatchNorm, 4 steps under Lightning's DDP and the sharded strategy: per-rank training
and validation losses, final weights and buffers within 1e-5 of DDP's, the ranks' buffers equal, the checkpoint's
buffers rank 0's. On 5f9ef12 the ranks' buffers differ by 0.249 (so does the checkpoint from rank 0's) and rank 1's
validation loss by 5.5e-3.
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import run_torchrun_result
from torch import nn

from lightning_shard.core.sharded_with import check_same_sharding, record_sharding
from lightning_shard.core.undo import UndoLog
from lightning_shard.plan.config import ShardingConfig
from lightning_shard.plan.precision import ShardedPrecision

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def result() -> dict:
    return run_torchrun_result(2, "tests/lifecycle_run.py", timeout=480)


def runs(result: dict) -> dict[str, dict]:
    return {name: run for name, run in result["lifecycle"].items() if isinstance(run, dict) and "changed" in run}


def test_every_run_leaves_the_process_as_it_found_it(result: dict) -> None:
    changed = {name: run["changed"] for name, run in runs(result).items() if run["changed"]}
    assert not changed, changed
    assert result["lifecycle"]["memory budget during the run"] == [0.5]  # applied while it ran


def test_a_fit_after_a_failed_fit_and_evaluation_in_any_order_work(result: dict) -> None:
    lifecycle = runs(result)
    assert lifecycle["fit with a wrong ckpt_path"]["error"].startswith("FileNotFoundError")
    expected_to_fail = {"fit with a wrong ckpt_path", "a second Trainer with other settings",
                        "a second Fabric with other settings"}  # fmt: skip
    errors = {name: run["error"] for name, run in lifecycle.items() if run["error"] and name not in expected_to_fail}
    assert not errors, errors
    assert result["lifecycle"]["steps after the second fit"] == 4


def test_a_second_trainer_or_fabric_with_other_settings_stops_naming_them(result: dict) -> None:
    trainer = runs(result)["a second Trainer with other settings"]["error"]
    assert trainer.startswith("ValueError: EvaluatedToy was sharded by an earlier run with other settings")
    assert "activation_checkpointing=[<class 'torch.nn.modules.linear.Linear'>] (sharded with None)" in trainer
    assert "precision='bf16-mixed' (sharded with '32-true')" in trainer
    fabric = runs(result)["a second Fabric with other settings"]["error"]
    assert "precision='bf16-mixed' (sharded with '32-true')" in fabric


def test_buffers_are_rank_zeros_after_each_step_as_under_ddp(result: dict) -> None:
    buffers = result["buffers"]
    assert buffers["steps"] == 4 and len(buffers["buffer names"]) == 15  # 5 BatchNorms
    assert buffers["layers"] == [["BatchNorm2d"], ["BatchNorm2d"]]  # DDP's and ours
    assert max(buffers["loss differences"]) < TOLERANCE
    assert max(buffers["validation loss differences"]) < TOLERANCE  # evaluation with rank 0's statistics, as DDP
    assert buffers["weight and buffer difference"] < TOLERANCE
    assert buffers["buffers across ranks"] == 0.0
    assert buffers["checkpoint buffers vs rank 0"] == 0.0


def test_buffers_of_every_dtype_and_layout_are_broadcast(result: dict) -> None:
    rank0 = [[True, True], "[(1+0j)]", 0.0, [0]]
    assert result["buffers of every kind"]["ranks"] == [rank0, rank0]


def test_sync_batchnorm_is_applied_not_ignored(result: dict) -> None:
    # torch's SyncBatchNorm computes on GPUs only: here the conversion is what can be checked (on 5f9ef12 the model
    # kept its BatchNorm2d layers and trained with per-rank statistics, without a word).
    assert result["sync_batchnorm"]["layers"] == ["SyncBatchNorm"]
    assert "SyncBatchNorm expected input tensor to be on GPU" in result["sync_batchnorm"]["error"]


# ------------------------------------------------------------------ in this process


def test_undo_log_undoes_newest_first_and_every_action_even_after_a_failure() -> None:
    target = types.SimpleNamespace(kept=1)
    module = types.ModuleType("settings")
    module.budget = 1.0
    log, undone = UndoLog(), []
    log.set_attribute(target, "kept", 2)
    log.set_attribute(target, "added", 3)
    log.set_attribute(module, "budget", 0.5)
    log.add("failing", lambda: 1 / 0)
    log.add("last", lambda: undone.append("last"))
    with pytest.raises(ZeroDivisionError):
        log.undo()
    assert undone == ["last"] and (target.kept, hasattr(target, "added"), module.budget) == (1, False, 1.0)
    assert len(log) == 0


def test_a_second_run_with_the_same_settings_built_again_is_not_a_conflict() -> None:
    model = nn.Linear(2, 2)

    def policy(module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    first = ShardingConfig(auto_wrap_policy=policy, activation_checkpointing=["Block"], sharding_strategy="auto")
    record_sharding(model, first, ShardingConfig(auto_wrap_policy=policy, sharding_strategy="SHARD_GRAD_OP"),
                    ShardedPrecision("32-true"), None)  # fmt: skip

    def same_policy(module: nn.Module) -> bool:  # defined again: another function object, the same place and name
        return isinstance(module, nn.Linear)

    same_policy.__qualname__ = policy.__qualname__
    again = ShardingConfig(auto_wrap_policy=same_policy, activation_checkpointing=["Block"], sharding_strategy="auto",
                           state_dict_type="full")  # fmt: skip
    applied = check_same_sharding(model, again, ShardedPrecision("32-true"))
    assert applied.sharding_strategy == "SHARD_GRAD_OP" and applied.state_dict_type == "full"
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.bfloat16 \(sharded with None\)"):
        check_same_sharding(model, again, ShardedPrecision("bf16-mixed", reduce_dtype=torch.bfloat16))
