"""Exit status of the SLURM requeue relaunch, many times over: ``python tests/requeue_exits.py --runs 20``.

``tests/test_preemption.py``'s SLURM scenario once ended with rank 1 of the requeued job aborting at exit
(``terminate called without an active exception``, rc -6) after training to the end. This script stops a 2-task job
as that test does (SIGUSR1 to both tasks after step 3, a fake ``scontrol``), then starts the requeued job - the same
command, resuming from ``hpc_ckpt_1.ckpt`` by itself - ``--runs`` times, each from a fresh copy of the stopped job's
folder, and counts the runs whose two tasks both exit with 0 and trained to the last step. It stops at the first
failure and prints its output. Not collected by pytest (each relaunch takes 15-40 s on 2 shared cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import free_port, srun_env  # noqa: E402
from test_preemption import SCRIPT, STEPS, TIMEOUT, finish, losses, start  # noqa: E402


def job(root: Path, logs: Path, bin_dir: Path, signal_after_step: int | None = None) -> tuple[list[int], str]:
    """The two tasks of one SLURM job on ``root``; their exit codes and output."""
    port = free_port()
    args = ["--step-sleep", "0.5", "--marker-step", "3"] if signal_after_step else []
    envs = [dict(srun_env(rank, port, job_name="preempt"), PATH=f"{bin_dir}:{os.environ['PATH']}") for rank in (0, 1)]
    files = [logs / f"task{rank}.log" for rank in (0, 1)]
    command = [sys.executable, SCRIPT, "--out", str(root), "--steps", str(STEPS), *args]
    procs = [start(command, env, log) for env, log in zip(envs, files, strict=True)]
    deadline = time.monotonic() + TIMEOUT
    if signal_after_step is not None:
        marker = root / f"reached_{signal_after_step}"
        while not marker.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        for proc in procs:
            os.kill(proc.pid, signal.SIGUSR1)
    codes = finish(procs, files, deadline)
    return codes, "\n".join(log.read_text() for log in files)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        bin_dir, stopped = tmp / "bin", tmp / "stopped"
        bin_dir.mkdir()
        stopped.mkdir()
        (bin_dir / "scontrol").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "scontrol").chmod(0o755)
        codes, output = job(stopped, tmp, bin_dir, signal_after_step=3)
        assert codes == [75, 75], output[-6000:]
        clean = 0
        for run in range(args.runs):
            root = tmp / f"relaunch{run}"
            shutil.copytree(stopped, root)
            started = time.monotonic()
            codes, output = job(root, tmp, bin_dir)
            finished = losses(root)[-1]["step"] == STEPS
            print(f"relaunch {run + 1}: exit codes {codes}, trained to step {STEPS}: {finished}, "
                  f"{time.monotonic() - started:.0f} s", flush=True)  # fmt: skip
            if codes != [0, 0] or not finished:
                print(output[-8000:])
                break
            clean += 1
            shutil.rmtree(root)
        print(f"CLEAN EXITS {clean} of {args.runs}")


if __name__ == "__main__":
    main()
