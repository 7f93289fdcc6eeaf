"""The agreed stop both adapters share: signals noted, a stop agreed by all ranks, the job requeued, the exit code.

Clusters stop jobs with signals (SLURM ``--signal=USR1@90`` and ``SIGTERM``, ``SIGTERM`` from torchrun and Kubernetes,
``SIGINT`` from a terminal), reaching the ranks at different moments or only some of them. Lightning answers them
inside the signal handler - a checkpoint save and a broadcast, collectives that every rank then starts at a
different moment: a rank whose handler waits in ``save_checkpoint`` while another sits in FSDP's all-gather is a
deadlock, and a handler that runs in the middle of the optimizer step saves half-updated weights.

Here the handlers only note the signal (:class:`StopRequests`). At each optimizer-step boundary every rank puts its
note into a tiny all-reduce started without waiting and reads the result of the previous boundary's
(:class:`StopVote`), so all ranks learn of the request at the same step, one step after the first rank noted it. Then
the adapter writes one checkpoint of that step through the strategy's normal (atomic) save, and
:func:`stop_after_checkpoint` waits for it to be published, has rank 0 requeue the SLURM job if that was asked for,
and raises :class:`Preempted`: the job ends with :data:`PREEMPTED_EXIT_CODE`.

Takes a strategy (Trainer or Fabric) and the signals to handle; gives the agreed stop. The adapters call it from
:class:`~lightning_shard.trainer.preemption.PreemptionCheckpoint` (Trainer) and
:class:`~lightning_shard.fabric.preemption.Preemptible` (``fabric.strategy.preemptible()``).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from collections import deque
from collections.abc import Sequence
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_shard.checkpoint import ShardedCheckpointIO

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": stopped on request, resumable from the
# checkpoint it wrote. Not 0 (a Kubernetes Job or a shell loop would take that for a finished run) and not 128 + n
# (which says the signal killed the process).
PREEMPTED_EXIT_CODE = 75


class Preempted(SIGTERMException):
    """Raised on every rank once the stop checkpoint is complete; its ``code`` becomes the process's exit status.

    A ``SystemExit`` (as Lightning's own :class:`SIGTERMException`): ``except Exception`` in a training script does not
    swallow it, and the interpreter exits with the status without a traceback.
    """


class StopVote:
    """Whether any rank has been asked to stop, agreed by all ranks ``lag`` votes after it was cast.

    Every rank calls :meth:`exchange` at the same optimizer-step boundaries. It starts an all-reduce (max) of this
    rank's ballot - two int32 - without waiting, and returns the outcome of the one started ``lag`` exchanges earlier,
    which has had whole steps to finish: all ranks see the same outcome at the same boundary, and a rank that reaches
    a boundary first does not wait there for the others. The all-reduce runs on a gloo group of its own: on GPUs it
    costs no device synchronisation, and it never queues behind FSDP's collectives.

    Example:
        >>> vote = StopVote()
        >>> vote.open()  # without a process group: this process's ballot is the outcome
        >>> vote.exchange((15, 0)), vote.exchange((0, 0))
        ((0, 0), (15, 0))
    """

    def __init__(self, lag: int = 1) -> None:
        self.lag = lag
        self._group: dist.ProcessGroup | None = None
        self._distributed = False
        self._in_flight: deque[tuple[torch.Tensor, dist.Work | None]] = deque()

    def open(self) -> None:
        """Call on every rank before the first exchange (creating the group is a collective)."""
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self._distributed and self._group is None:
            self._group = dist.new_group(backend="gloo")
        self._in_flight.clear()

    def exchange(self, ballot: tuple[int, int]) -> tuple[int, int]:
        """Cast ``ballot``; return the element-wise maximum over ranks of the ballots cast ``lag`` exchanges ago
        (``(0, 0)`` for the first ``lag`` exchanges)."""
        tensor = torch.tensor(ballot, dtype=torch.int32)
        work = (
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            if self._distributed
            else None
        )
        self._in_flight.append((tensor, work))
        return self._outcome(self._in_flight.popleft()) if len(self._in_flight) > self.lag else (0, 0)

    def close(self) -> tuple[int, int]:
        """Wait for every vote in flight (call on every rank); the element-wise maximum of their outcomes. The vote's
        process group goes: a group left behind lives until the process ends (one per vote opened)."""
        outcomes = [self._outcome(vote) for vote in self._in_flight]
        self._in_flight.clear()
        self._release_group()
        return (max((o[0] for o in outcomes), default=0), max((o[1] for o in outcomes), default=0))

    def abandon(self) -> None:
        """Forget the votes in flight without waiting: after an error, other ranks may never complete them. Their
        process group goes too unless a vote still waits in it for another rank (destroying it would wait as long)."""
        waiting = any(work is not None and not work.is_completed() for _, work in self._in_flight)
        self._in_flight.clear()
        if not waiting:
            self._release_group()

    def _release_group(self) -> None:
        if self._group is not None:
            dist.destroy_process_group(self._group)  # local: no other rank takes part
            self._group = None

    @staticmethod
    def _outcome(vote: tuple[torch.Tensor, dist.Work | None]) -> tuple[int, int]:
        tensor, work = vote
        if work is not None:
            work.wait()
        return int(tensor[0]), int(tensor[1])


class StopRequests:
    """The stop requests the signal handlers note, and the vote by which all ranks agree on one at an optimizer-step
    boundary: what :class:`~lightning_shard.trainer.preemption.PreemptionCheckpoint` (Trainer) and the Fabric
    strategy's ``preemptible()`` share.

    Example:
        >>> requests = StopRequests([signal.SIGTERM])
        >>> requests.vote.open()
        >>> requests.note(signal.SIGTERM, None)  # what the handler does
        >>> requests.agreed(), requests.agreed()  # one step later, every rank sees it
        (None, (<Signals.SIGTERM: 15>, False))
    """

    def __init__(self, signals: Sequence[signal.Signals]) -> None:
        self.signals = list(signals)
        self.vote = StopVote()
        self.requested: signal.Signals | None = None  # set by the handlers
        self.requeue_signal: signal.Signals | None = None
        self.requeue_requested = False
        self._announced = False

    def forget(self) -> None:
        """Drop what was noted (a request noted in an earlier fit's last step, which needed no stop)."""
        self.requested, self.requeue_requested, self._announced = None, False, False

    def install(self, environment: ClusterEnvironment | None) -> dict[signal.Signals, Any]:
        """Make :meth:`note` the handler of the signals, and of SLURM's requeue signal under ``auto_requeue``; the
        handlers it replaced (call in the main thread)."""
        handled = list(self.signals)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self.requeue_signal = environment.requeue_signal
            handled.append(environment.requeue_signal)
        return {signum: signal.signal(signum, self.note) for signum in set(handled)}

    def note(self, signum: int, frame: FrameType | None) -> None:
        """The handler: records the request and nothing else (no collective, no I/O, no lock)."""
        received = signal.Signals(signum)
        if received == signal.SIGINT and self.requested == signal.SIGINT:
            signal.default_int_handler(signum, frame)  # Ctrl+C twice: stop now, without a checkpoint
        self.requested = self.requested or received
        self.requeue_requested = self.requeue_requested or received == self.requeue_signal

    def agreed(self, rank: int = 0) -> tuple[signal.Signals, bool] | None:
        """Vote at an optimizer-step boundary (every rank, every step); the stop all ranks agree on now - the signal
        and whether the job is to be requeued - or None."""
        if self.requested is not None and not self._announced:
            self._announced = True
            log.info(f"[rank {rank}] {self.requested.name} received: stopping at an agreed step")
        signum, requeue = self.vote.exchange((int(self.requested or 0), int(self.requeue_requested)))
        if not signum:
            return None
        # Every rank stops at this step with the same votes in flight: finish them, or a gloo thread still holding one
        # at interpreter exit aborts the process ("terminate called without an active exception", rc -6).
        self.vote.close()
        return signal.Signals(signum), bool(requeue)


def stop_after_checkpoint(strategy: Any, path: str, requeue: bool, exit_code: int) -> NoReturn:
    """End a run whose stop checkpoint every rank has just saved to ``path`` through ``strategy`` (a Trainer or
    Fabric one): wait until it is published, requeue the SLURM job if asked (rank 0, before any rank exits: srun
    ``--kill-on-bad-exit`` would end rank 0 before it requeues), and raise :class:`Preempted` on every rank.

    The worker processes Lightning's own launcher started (local ranks > 0 when no cluster started the processes)
    exit with 0, so that the launching process's child observer does not take their exit for a crash and kill it;
    that process exits with ``exit_code``."""
    if isinstance(strategy.checkpoint_io, ShardedCheckpointIO):
        strategy.checkpoint_io.wait()  # a background save: until rank 0 has published it, on every rank
    strategy.barrier("PreemptionCheckpoint.saved")
    if requeue:
        error = strategy.broadcast(_requeue_slurm_job() if strategy.global_rank == 0 else None)
        if error:
            raise RuntimeError(f"{error}. The checkpoint {path} is complete: resubmit the job to resume from it.")
    environment = getattr(strategy, "cluster_environment", None)  # single-device strategies have none
    launched_here = environment is not None and not environment.creates_processes_externally
    rank_zero_info(
        f"Preemption: checkpoint {path} complete{', job requeued' if requeue else ''}; exiting with status {exit_code}"
    )
    raise Preempted(0 if launched_here and strategy.local_rank > 0 else exit_code)


def _requeue_slurm_job() -> str | None:
    """``scontrol requeue`` this job (as Lightning's SLURM handler does); the error, or ``None`` when it worked."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job_id):
        return f"SLURM job id {job_id!r} is not a number"
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`scontrol requeue {job_id}` failed: {error}"
    if done.returncode != 0:
        return f"`scontrol requeue {job_id}` exited with {done.returncode}: {(done.stderr or done.stdout).strip()}"
    log.info(f"Requeued SLURM job {job_id}")
    return None
