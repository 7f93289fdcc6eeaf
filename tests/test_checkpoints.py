"""Sharded and full checkpoints with real 2-process runs: round trips, resharding, exact resume, atomic writes.

The reference for resume is Lightning's own single-device resume of the same run (4 steps, save, resume to 8).
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import run_script
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from toy import FULL, ToyModel

from lightning_shard import ShardedCheckpointIO, is_sharded_checkpoint
from lightning_shard.checkpoint import convert, reader, unit_load
from lightning_shard.checkpoint.reader import InPlaceFileSystemReader
from lightning_shard.cli import main as cli_main

TOL = 1e-5
SCRIPT = "tests/checkpoint_run.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("checkpoints")

    def run(*args: str) -> None:
        run_script(SCRIPT, *args, timeout=180)

    run("train", "--devices", "1", "--reference", "--out", str(out / "ref_train"))
    run(
        "resume",
        "--devices",
        "1",
        "--reference",
        "--steps",
        "8",
        "--ckpt",
        str(out / "ref_train/model.ckpt"),
        "--out",
        str(out / "ref_resume"),
    )
    run("train", "--devices", "2", "--out", str(out / "sharded"))
    run("train", "--devices", "2", "--format", "full", "--out", str(out / "full"))
    for devices in ("1", "3", "4"):
        run(
            "resume",
            "--devices",
            devices,
            "--steps",
            "8",
            "--ckpt",
            str(out / "sharded/model.ckpt"),
            "--out",
            str(out / f"resume_sharded_{devices}"),
        )
    # a full file saved by one rank into a sharded model at two: rank 0 maps it and broadcasts it unit by unit,
    # the other rank is forbidden to open the file
    run("train", "--devices", "1", "--format", "full", "--out", str(out / "full_1"))
    run("resume", "--devices", "2", "--steps", "8", "--ckpt", str(out / "full_1/model.ckpt"),
        "--out", str(out / "resume_full_2"))  # fmt: skip
    # the same file converted to a sharded directory resumes like the file itself
    assert convert(out / "full_1/model.ckpt", out / "converted_sharded.ckpt") == "full -> sharded"
    run("resume", "--devices", "2", "--steps", "8", "--ckpt", str(out / "converted_sharded.ckpt"),
        "--out", str(out / "resume_converted_2"))  # fmt: skip
    return out


def result(runs: Path, name: str) -> dict[str, Any]:
    return torch.load(runs / name / "result.pt", weights_only=False)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def max_optimizer_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a["state"].keys() == b["state"].keys()
    return max(max_diff(a["state"][name], b["state"][name]) for name in a["state"])


def test_sharded_checkpoint_is_a_dcp_directory_that_torch_converts(runs: Path, tmp_path: Path) -> None:
    ckpt = runs / "sharded/model.ckpt"
    assert is_sharded_checkpoint(ckpt)
    out = tmp_path / "converted.ckpt"
    dcp_to_torch_save(ckpt, out)
    converted = torch.load(out, weights_only=False)
    saved = result(runs, "sharded")["end"]
    # plain module names, no FSDP or checkpoint-wrapper prefixes; equal tensors
    assert set(converted["state_dict"]) == set(ToyModel().state_dict())
    assert max_diff(converted["state_dict"], saved["weights"]) == 0.0
    assert max_optimizer_diff(converted["optimizer_states"][0], saved["optimizer"]) == 0.0
    assert converted["global_step"] == 4 and "loops" in converted and "callbacks" in converted
    assert converted["lr_schedulers"] == [result(runs, "sharded")["scheduler"]]  # lr_lambdas: [{}] kept
    assert converted["callbacks"]["StepCounter"] == {"batches": 4, "notes": []}
    assert converted["hyper_parameters"]["lr"] == 0.01
    model = ToyModel.load_from_checkpoint(out)
    assert max_diff(model.state_dict(), saved["weights"]) == 0.0


def test_full_checkpoint_loads_without_lightning_shard(runs: Path) -> None:
    code = (
        "import sys, torch; sys.modules['lightning_shard'] = None\n"
        "sys.path.insert(0, 'tests'); from toy import ToyModel\n"
        f"ckpt = torch.load({str(runs / 'full/model.ckpt')!r}, weights_only=False)\n"
        f"model = ToyModel.load_from_checkpoint({str(runs / 'full/model.ckpt')!r})\n"
        f"torch.save(model.state_dict(), {str(runs / 'full/plain_load.pt')!r})\n"
        "print(sorted(ckpt))"
    )
    output = run_script("-c", code)
    assert "optimizer_states" in output and "state_dict" in output
    loaded = torch.load(runs / "full/plain_load.pt")
    assert max_diff(loaded, result(runs, "full")["end"]["weights"]) == 0.0


SAVED_BY = {"resume_full_2": "full_1", "resume_converted_2": "full_1"}


@pytest.mark.parametrize(
    "name",
    [
        "resume_sharded_1",
        "resume_sharded_3",
        "resume_sharded_4",
        "resume_full_2",
        "resume_converted_2",
    ],
)
def test_load_at_any_world_size_restores_weights_and_optimizer(runs: Path, name: str) -> None:
    saved = result(runs, SAVED_BY.get(name, "sharded"))["end"]
    loaded = result(runs, name)["start"]
    assert max_diff(loaded["weights"], saved["weights"]) == 0.0
    assert max_optimizer_diff(loaded["optimizer"], saved["optimizer"]) == 0.0


@pytest.mark.parametrize("name", ["resume_sharded_1", "resume_sharded_4", "resume_full_2"])
def test_resume_matches_lightning_resume(runs: Path, name: str) -> None:
    ours, reference = result(runs, name), result(runs, "ref_resume")
    assert len(ours["losses"]) == len(reference["losses"]) == 4
    assert ours["losses"] == pytest.approx(reference["losses"], abs=TOL)
    assert max_diff(ours["end"]["weights"], reference["end"]["weights"]) < TOL


def test_full_to_sharded_conversion_resumes_like_the_full_file(runs: Path) -> None:
    """Loops, the callback's empty list and the partial LR lambda's `{}` survive: the resume is the same run."""
    converted, original = result(runs, "resume_converted_2"), result(runs, "resume_full_2")
    assert converted["losses"] == original["losses"] and len(converted["losses"]) == 4
    assert max_diff(converted["end"]["weights"], original["end"]["weights"]) == 0.0
    assert max_optimizer_diff(converted["end"]["optimizer"], original["end"]["optimizer"]) == 0.0
    assert converted["scheduler"] == original["scheduler"] and converted["lr"] == original["lr"]
    assert converted["callback"] == original["callback"] == {"batches": 8, "notes": []}


def test_sharded_to_full_conversion_keeps_every_state(runs: Path, tmp_path: Path) -> None:
    sharded = ShardedCheckpointIO().load_checkpoint(runs / "sharded/model.ckpt")
    full = tmp_path / "full.ckpt"
    assert convert(runs / "sharded/model.ckpt", full) == "sharded -> full"
    converted = torch.load(full, weights_only=False)
    for key in sharded.keys() - {"state_dict", "optimizer_states"}:
        assert converted[key] == sharded[key], key
    assert converted["lr_schedulers"][0]["lr_lambdas"] == [{}]
    assert max_diff(ToyModel.load_from_checkpoint(full).state_dict(), result(runs, "sharded")["end"]["weights"]) == 0


def test_full_file_saved_at_two_ranks_loads_into_one(runs: Path, one_rank_group: DeviceMesh) -> None:
    model, optimizer = sharded_toy(one_rank_group)
    rest = ShardedCheckpointIO().load_into(runs / "full/model.ckpt", model, [optimizer])
    saved = result(runs, "full")["end"]
    assert max_diff(get_model_state_dict(model, options=FULL), saved["weights"]) == 0.0
    assert max_optimizer_diff(get_optimizer_state_dict(model, optimizer, options=FULL), saved["optimizer"]) == 0.0
    assert rest["global_step"] == 4 and "state_dict" not in rest and "optimizer_states" not in rest


def test_optimizer_states_keyed_by_position_are_refused(runs: Path, one_rank_group: DeviceMesh) -> None:
    """Lightning's own single-device checkpoint keys optimizer states by parameter position: refused with a way out
    (its weights load)."""
    model, optimizer = sharded_toy(one_rank_group)
    with pytest.raises(ValueError, match="keyed by parameter position"):
        ShardedCheckpointIO().load_into(runs / "ref_train/model.ckpt", model, [optimizer])
    ShardedCheckpointIO().load_into(runs / "ref_train/model.ckpt", model, [optimizer], weights_only=True)
    assert max_diff(get_model_state_dict(model, options=FULL), result(runs, "ref_train")["end"]["weights"]) == 0.0


def test_weights_only_checkpoints(runs: Path, tmp_path: Path) -> None:
    for fmt in ("sharded", "full"):
        path = runs / fmt / "weights.ckpt"
        checkpoint = ShardedCheckpointIO().load_checkpoint(path)
        assert "optimizer_states" not in checkpoint
        assert max_diff(checkpoint["state_dict"], result(runs, fmt)["end"]["weights"]) == 0.0


def test_cli_inspect_and_convert_round_trip(runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["inspect", str(runs / "sharded/model.ckpt"), "--json"]) == 0
    info = capsys.readouterr().out
    assert '"format": "sharded"' in info and '"saved_world_size": 2' in info and '"global_step": 4' in info
    assert '"n_params": 3473' in info and '"param_bytes": 13892' in info
    full, sharded = tmp_path / "full.ckpt", tmp_path / "sharded.ckpt"
    assert cli_main(["convert", str(runs / "sharded/model.ckpt"), str(full)]) == 0
    assert cli_main(["convert", str(full), str(sharded)]) == 0
    assert is_sharded_checkpoint(sharded)
    back = ShardedCheckpointIO().load_checkpoint(sharded)
    assert max_diff(back["state_dict"], result(runs, "sharded")["end"]["weights"]) == 0.0
    assert cli_main(["inspect", str(full)]) == 0 and "format: full" in capsys.readouterr().out
    assert cli_main(["inspect", str(tmp_path / "missing.ckpt")]) == 2
    assert "Checkpoint not found" in capsys.readouterr().err
    assert cli_main(["convert", str(full), str(sharded)]) == 2  # refuses to overwrite
    assert "exists" in capsys.readouterr().err


@pytest.fixture()
def one_rank_group():
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def sharded_toy(mesh: DeviceMesh, **kwargs: Any) -> tuple[ToyModel, torch.optim.Optimizer]:
    """A ToyModel sharded as the strategy shards it (each block a unit, then the root), with its AdamW."""
    torch.manual_seed(1)
    model = ToyModel(**kwargs)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model.configure_optimizers()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_lightning_state_with_empty_containers_survives_either_save(
    one_rank_group, tmp_path: Path, async_save: bool
) -> None:
    """DCP flattens state dicts and drops empty containers; the Lightning entries are stored whole to keep them. An
    async save first deep-copies the state into its staging buffers, which must copy them whole too."""
    io = ShardedCheckpointIO(async_save=async_save)
    state = {
        "state_dict": {"w": distribute_tensor(torch.arange(4.0), one_rank_group, [Shard(0)])},
        "lr_schedulers": [{"lr_lambdas": [{}], "base_lrs": [0.1]}],  # a LambdaLR with a functools.partial
        "callbacks": {"Counter": {"notes": []}},
    }
    io.save_checkpoint(state, tmp_path / "x.ckpt")
    state["callbacks"]["Counter"]["notes"].append("changed after the save started")
    io.teardown()
    loaded = io.load_checkpoint(tmp_path / "x.ckpt")
    assert loaded["lr_schedulers"] == [{"lr_lambdas": [{}], "base_lrs": [0.1]}]
    assert loaded["callbacks"] == {"Counter": {"notes": []}}


def test_failed_save_keeps_the_last_good_checkpoint(one_rank_group, tmp_path: Path, monkeypatch) -> None:
    io = ShardedCheckpointIO()
    path = tmp_path / "last.ckpt"

    def checkpoint(value: float) -> dict[str, Any]:
        weight = distribute_tensor(torch.full((4,), value), one_rank_group, [Shard(0)])
        return {"state_dict": {"w": weight}, "global_step": int(value)}

    io.save_checkpoint(checkpoint(1.0), path)

    def crash(state_dict: dict, storage_writer: Any, **kwargs: Any) -> None:
        Path(storage_writer.path).mkdir(parents=True)
        (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint(checkpoint(2.0), path)
    monkeypatch.undo()
    survivor = io.load_checkpoint(path)
    assert survivor["global_step"] == 1 and torch.equal(survivor["state_dict"]["w"], torch.full((4,), 1.0))
    # the half-written save was deleted by the failed save itself (tests/test_checkpoint_faults.py: killed saves)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]

    # a full-format save that fails while writing leaves the old file in place too
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["global_step"] == 1

    # the next good save publishes and clears the staging the interrupted ones left
    io.save_checkpoint(checkpoint(3.0), path)
    assert io.load_checkpoint(path)["global_step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_missing_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing.ckpt"):
        ShardedCheckpointIO().load_checkpoint(tmp_path / "nothing.ckpt")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_top_k_and_last_with_checkpoint_directories(tmp_path: Path, async_save: bool) -> None:
    run_script(SCRIPT, "topk", "--devices", "2", "--steps", "4", "--out", str(tmp_path), *["--async-save"] * async_save)
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    # saved every step: top-2 by step and last; removed ones and staging directories are gone
    assert names == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"], names
    assert all(is_sharded_checkpoint(tmp_path / "ckpts" / name) for name in names)
    last = ShardedCheckpointIO().load_checkpoint(tmp_path / "ckpts/last.ckpt")
    assert last["global_step"] == 4
    assert max_diff(last["state_dict"], torch.load(tmp_path / "result.pt", weights_only=False)["end"]["weights"]) == 0


# ------------------------------------------------------------------ the readers, in one process


def test_in_place_reader_reads_what_file_system_reader_reads(
    one_rank_group: DeviceMesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = {
        "plain": torch.randn(8, 32),
        "twin": torch.randn(8, 32),  # laid out like "plain": found from the first one's layout
        "transposed": torch.randn(32, 8).t(),  # shape, dtype and archive length of "plain", but strided: not in place
        "bf16": torch.randn(10).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "shard": distribute_tensor(torch.randn(16, 4), one_rank_group, [Shard(0)]),
        "count": 7,
    }
    dcp.save(saved, checkpoint_id=tmp_path / "ckpt")

    def targets() -> dict[str, Any]:
        out = {key: torch.zeros_like(value) for key, value in saved.items() if isinstance(value, torch.Tensor)}
        out["bf16"] = torch.zeros(10)  # another dtype: read, then converted
        return {**out, "count": 0}

    delegated: list[str] = []
    read_data = dcp.FileSystemReader.read_data
    opened: list[tuple] = []
    open_plain = reader._open_plain
    monkeypatch.setattr(reader, "_open_plain", lambda *args: opened.append(args[3:]) or open_plain(*args))

    def spy(self: dcp.FileSystemReader, plan: Any, planner: Any) -> Any:
        delegated.extend(item.storage_index.fqn for item in plan.items)
        return read_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", spy)
    theirs, ours = targets(), targets()
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path / "ckpt"))
    delegated.clear()
    metadata = dcp.FileSystemReader(tmp_path / "ckpt").read_metadata()
    dcp.load(ours, storage_reader=InPlaceFileSystemReader(tmp_path / "ckpt", metadata))
    assert sorted(delegated) == ["count", "transposed"]
    assert len(opened) == 5  # every tensor's archive but one of the twins was opened with torch's zip reader
    for key, value in saved.items():
        expected = value.full_tensor() if isinstance(value, DTensor) else value
        got = ours[key].full_tensor() if isinstance(ours[key], DTensor) else ours[key]
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(expected).to(torch.as_tensor(got).dtype)), key
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(theirs[key]).full_tensor()
                           if isinstance(theirs[key], DTensor) else torch.as_tensor(theirs[key])), key  # fmt: skip


def resident_bytes(path: Path) -> int:
    """Bytes of ``path``'s file mappings resident in this process (``/proc/self/smaps``)."""
    inode, total, inside = path.stat().st_ino, 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and fields[4].isdigit():
            inside = int(fields[4]) == inode
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page residency is read from /proc")
@pytest.mark.parametrize("drop", [True, False], ids=["unit_by_unit", "control_without_dropping"])
def test_rank_zero_holds_one_unit_of_a_full_file_at_a_time(
    one_rank_group: DeviceMesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drop: bool
) -> None:
    """While loading a full file, the file's pages resident in rank 0 never exceed one FSDP unit's (plus the pages
    the kernel maps around a fault); the control run, which keeps every page, shows the measure sees them."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))
    for layer in model:
        fully_shard(layer, mesh=one_rank_group)
    fully_shard(model, mesh=one_rank_group)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    path = tmp_path / "full.ckpt"
    weights = get_model_state_dict(model, options=FULL)
    states = get_optimizer_state_dict(model, optimizer, options=FULL)
    torch.save({"state_dict": weights, "optimizer_states": [states], "global_step": 1}, path)
    unit_bytes = 3 * (256 * 256 + 256) * 4  # a Linear's weight and bias with AdamW's two moments, fp32
    data_bytes = 6 * unit_bytes

    for layer in model:  # forget the values: the load must bring them back
        for param in layer.parameters():
            param.data.to_local().zero_()
    seen: list[int] = []
    release = unit_load._MappedPages.release

    def record(self: Any) -> None:
        seen.append(resident_bytes(path))
        if drop:
            release(self)

    monkeypatch.setattr(unit_load._MappedPages, "release", record)
    rest = ShardedCheckpointIO().load_into(path, model, [optimizer])
    assert rest["global_step"] == 1 and len(seen) == 7  # the scalars described first, then the 6 layers
    if drop:
        assert max(seen) <= unit_bytes + 256 * 1024, seen
    else:
        assert seen[-1] >= 0.95 * data_bytes, seen
    assert max_diff(get_model_state_dict(model, options=FULL), weights) == 0.0
    assert max_optimizer_diff(get_optimizer_state_dict(model, optimizer, options=FULL), states) == 0.0
    gc.collect()
    assert resident_bytes(path) == 0 and not unit_load._file_mappings(path)  # nothing keeps the file mapped


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
