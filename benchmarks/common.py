"""Shared pieces of the benchmarks: the machine description, the step timer, memory figures, synthetic data.

Nothing here changes the strategy; the "from the outside" speed ideas live in ``train_speed.py``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def machine() -> dict[str, Any]:
    """Cores, memory, load and versions at the moment of the call."""
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        # Uncommitted edits to the package under test (other people work in the same tree).
        "git_dirty": _git("status", "--short", "--", "lightning_shard", "examples").splitlines(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident set (Linux ``ru_maxrss`` is KiB)."""
    return max(psutil.Process().memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def status_mib(*fields: str) -> dict[str, float]:
    """``fields`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``, ...) in MiB (Linux)."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in fields:
            values[name] = int(rest.split()[0]) / 1024  # kB
    return values


class PeakRSS:
    """Peak resident memory from now on, in MiB over what is resident now.

    The kernel's high-water mark (VmHWM, reset here) counts every resident page, including file pages a process
    maps (safetensors and ``torch.load(mmap=True)`` read through mmap): clean page cache that the kernel can drop.
    A thread also samples the anonymous part (RssAnon, the memory the work really allocates) every millisecond;
    a sample can miss a peak shorter than that, or one inside a call that holds the GIL.
    ``reset_high_water_mark=False`` leaves the kernel's mark alone, for a measure inside another one: then only the
    sampled anonymous peak (``peak_anon_over_start_mib``) is this measure's.
    """

    def __init__(self, reset_high_water_mark: bool = True) -> None:
        if reset_high_water_mark:
            Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak RSS to the current RSS
        self.start = status_mib("VmRSS", "RssAnon")
        self.peak_anon = self.start["RssAnon"]
        self.start_time = time.perf_counter()
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak_anon = max(self.peak_anon, status_mib("RssAnon")["RssAnon"])

    def result(self) -> dict[str, float]:
        self._done.set()
        self._sampler.join()
        now = status_mib("VmHWM", "RssAnon")
        peak_anon = max(self.peak_anon, now["RssAnon"])
        return {
            "rss_start_mib": self.start["VmRSS"],
            "peak_rss_mib": now["VmHWM"],
            "peak_over_start_mib": now["VmHWM"] - self.start["VmRSS"],
            "peak_anon_over_start_mib": peak_anon - self.start["RssAnon"],
            "seconds": time.perf_counter() - self.start_time,
        }


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False))
    tmp.replace(path)


def cpu_trainer(devices: int, strategy: Any, callbacks: list, max_steps: int) -> L.Trainer:
    """A Trainer on CPU ranks, fp32, that validates, logs and checkpoints nothing by itself: a benchmark's callbacks
    decide what happens."""
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="32-true",
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def sharded_trainer(devices: int, callbacks: list, max_steps: int, **strategy: Any) -> L.Trainer:
    """:func:`cpu_trainer` with ``ShardedStrategy`` (FULL_SHARD, each ``Block`` a unit, ``strategy`` on top)."""
    import lightning_shard

    sharded = lightning_shard.ShardedStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy=["Block"], **strategy)
    return cpu_trainer(devices, sharded, callbacks, max_steps)


def launch_worker(script: str | Path, *worker_args: str) -> dict[str, Any]:
    """Run ``python script *worker_args --out FILE`` (a benchmark's worker, which starts its ranks with Lightning's
    launcher) with the machine's default threads; return the JSON it wrote to ``FILE`` (``{}`` if none)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(Path(script).resolve()), *worker_args, "--out", out.name]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        env["PYTHONWARNINGS"] = "ignore"
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"`{' '.join(worker_args)}` failed with exit code {proc.returncode}")
        text = Path(out.name).read_text()
        return json.loads(text) if text else {}


def small_llama(num_attention_heads: int, **dims: int) -> dict[str, Any]:
    """``transformers.LlamaConfig`` arguments of a small Llama: ``dims`` (vocabulary, widths, layers), as many
    key/value heads as attention heads, 512 positions.

    Example:
        >>> small_llama(4, vocab_size=256, hidden_size=64)
        {'vocab_size': 256, 'hidden_size': 64, 'num_attention_heads': 4, 'num_key_value_heads': 4, \
'max_position_embeddings': 512}
    """
    heads = {"num_attention_heads": num_attention_heads, "num_key_value_heads": num_attention_heads}
    return {**dims, **heads, "max_position_embeddings": 512}


def random_token_dataset(num_samples: int, block_size: int, vocab_size: int, seed: int = 0) -> torch.utils.data.Dataset:
    """(x, y) windows of random tokens: no data loading cost inside the timed steps."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num_samples, block_size + 1), generator=generator)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
