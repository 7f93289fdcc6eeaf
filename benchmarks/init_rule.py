"""What the initialisation rule costs: recording the construction, replaying it, and the check that nothing unwritten
survives (sentinel fill at allocation, scan after the replay).

    python benchmarks/init_rule.py                      # -> benchmarks/results/startup.json
    python benchmarks/init_rule.py --repeats 1

* 13B simulation: the 13B GPT (``configs/gpt3_13b.yaml``) built on the meta device with and without the recorder, then
  ``fully_shard`` per Block + root for a world of 8 and materialised on fake tensors, as
  ``lightning-shard estimate --mode simulate`` does (one process, a fake process group; no weight allocated, so the
  sentinel check has nothing to scan there).
* 134M Llama: the transformers Llama of ``hf_loading.py`` (fp32) built on the meta device in one process (gloo,
  world 1) and materialised for real: from its config (transformers' init, replayed) and from pretrained files
  written once with ``save_pretrained`` (``lightning_shard.hf.from_pretrained``: each tensor read from the files).
  The sentinel's share is the time spent filling the allocated tensors with it plus the scan after the replay.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import lightning_shard.hf  # noqa: E402
import lightning_shard.init.materialize as materialize  # noqa: E402
from benchmarks.common import REPO, median  # noqa: E402
from benchmarks.hf_loading import MODEL as LLAMA  # noqa: E402
from benchmarks.results_files import result_path, write_result  # noqa: E402
from examples.gpt.model import GPT, Block  # noqa: E402
from lightning_shard.init.construction_log import construction_logs  # noqa: E402
from lightning_shard.init.meta_window import end_meta_window  # noqa: E402
from lightning_shard.plan.config import ShardingConfig  # noqa: E402
from lightning_shard.plan.parallelize import parallelize_module  # noqa: E402
from lightning_shard.torch_compat.fsdp import memory_simulation_tools  # noqa: E402


class Timer:
    """Seconds spent inside the wrapped functions, summed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


@contextlib.contextmanager
def sentinel_timers() -> Iterator[tuple[Timer, Timer]]:
    fill, scan = Timer(), Timer()
    original_fill, original_scan = materialize.fill_unset, materialize.refuse_unwritten
    materialize.fill_unset, materialize.refuse_unwritten = fill.wrap(original_fill), scan.wrap(original_scan)
    try:
        yield fill, scan
    finally:
        materialize.fill_unset, materialize.refuse_unwritten = original_fill, original_scan


def simulate_13b(model_args: dict[str, Any], world_size: int) -> dict[str, float]:
    start = time.perf_counter()
    with torch.device("meta"):
        GPT(**model_args).configure_model()
    plain = time.perf_counter() - start
    start = time.perf_counter()
    with materialize.meta_construction():
        model = GPT(**model_args)
        model.configure_model()
    end_meta_window()  # as setup does before sharding (the recording lasts until then)
    recorded = time.perf_counter() - start
    ops = sum(len(log.ops) for log in construction_logs(model))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with memory_simulation_tools()["FakeTensorMode"](allow_non_fake_inputs=True):
        start = time.perf_counter()
        materialize.materialize_sharded_module(model, torch.device("cpu"))
        materialised = time.perf_counter() - start
    return {"build_plain_s": plain, "build_recorded_s": recorded, "ops": ops, "materialise_s": materialised}


def llama_run(source: Callable[[], torch.nn.Module], mesh: Any) -> dict[str, float]:
    with materialize.meta_construction():
        model = source()
    second_pass = Timer()  # the skipped draws made up at the end of setup (skipped_draws.py)
    original_pay = materialize.SKIPPED.pay
    materialize.SKIPPED.pay = second_pass.wrap(original_pay)  # type: ignore[method-assign]
    with sentinel_timers() as (fill, scan):
        start = time.perf_counter()
        parallelize_module(
            model, mesh, ShardingConfig(auto_wrap_policy="auto"), mp_policy=MixedPrecisionPolicy(),
            offload_policy=OffloadPolicy(), device=torch.device("cpu"),
        )  # fmt: skip
        total = time.perf_counter() - start
    materialize.SKIPPED.pay = original_pay  # type: ignore[method-assign]
    params = sum(p.numel() for p in model.parameters())
    return {
        "total_s": total,
        "fill_s": fill.seconds,
        "scan_s": scan.seconds,
        "second_pass_s": second_pass.seconds,
        "params": params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--output", default=str(result_path("init_rule")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM

    model_args = yaml.safe_load((REPO / "configs" / "gpt3_13b.yaml").read_text())["model"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    sims = [simulate_13b(model_args, args.world_size) for _ in range(args.repeats)]
    dist.destroy_process_group()
    print("13B:", sims, flush=True)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    config = AutoConfig.for_model(**LLAMA)
    runs: dict[str, list[dict[str, float]]] = {"config": [], "pretrained": []}
    with tempfile.TemporaryDirectory() as files:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(files)
        for _ in range(args.repeats):
            runs["config"].append(llama_run(lambda: AutoModelForCausalLM.from_config(config), mesh))
            pretrained = lambda: lightning_shard.hf.from_pretrained(AutoModelForCausalLM, files)  # noqa: E731
            runs["pretrained"].append(llama_run(pretrained, mesh))
            print(runs["config"][-1], runs["pretrained"][-1], flush=True)
    dist.destroy_process_group()

    sim = {key: median([run[key] for run in sims]) for key in sims[0]}
    llama = {name: {key: median([run[key] for run in rs]) for key in rs[0]} for name, rs in runs.items()}
    params = runs["config"][0]["params"]
    rows = [
        ["13B GPT, simulated (world 8, fake tensors)", f"{sim['build_plain_s']:.2f}", f"{sim['build_recorded_s']:.2f}",
         f"{sim['materialise_s']:.2f}", "-", "-", "-"],
    ]  # fmt: skip
    for name, label in (("config", "from its config"), ("pretrained", "from pretrained files")):
        run = llama[name]
        share = (run["fill_s"] + run["scan_s"]) / run["total_s"]
        rows.append(
            [f"{params / 1e6:.0f}M Llama, {label} (1 rank)", "-", "-", f"{run['total_s']:.2f}", f"{run['fill_s']:.3f}",
             f"{run['scan_s']:.3f}", f"{share:.1%}"]
        )  # fmt: skip
    report = {
        "title": "The initialisation rule's cost",
        "question": "What do recording, replaying and the unwritten-tensor check cost on the 13B simulation and a "
        "pretrained load?",
        "columns": [
            "model",
            "build on meta (s)",
            "build recorded (s)",
            "shard + materialise (s)",
            "sentinel fill (s)",
            "sentinel scan (s)",
            "sentinel share",
        ],  # fmt: skip
        "rows": rows,
        "notes": [
            f"13B: {sim['ops']:.0f} ops recorded; the recorder's cost is the build time difference. On fake tensors "
            "the replay computes nothing and there is nothing to scan.",
            f"Llama: {params:,} parameters, fp32, one process on gloo; the sentinel's share is (fill + scan) / "
            f"(shard + materialise). Median of {args.repeats} repeats, one thread.",
        ],
    }
    write_result(
        Path(args.output),
        "init_rule",
        {
            "simulation": sims,
            "llama": runs,
            "report": report,
        },
    )


if __name__ == "__main__":
    main()
