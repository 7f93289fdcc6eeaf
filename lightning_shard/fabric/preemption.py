"""Preemption in a Fabric loop: what :class:`~lightning_shard.PreemptionCheckpoint` does for the Trainer, called from
the user's loop once per optimizer step.

```python
with fabric.strategy.preemptible() as preemption:
    for step, batch in enumerate(loader, start):
        ...
        optimizer.step()
        preemption.step_end("ckpts/last.ckpt", {"model": model, "optimizer": optimizer, "step": step})
```

Inside the ``with`` block ``SIGTERM`` (torchrun, Kubernetes, Lightning's launcher, SLURM's ``scancel``) and, under
``SLURMEnvironment(auto_requeue=True)``, SLURM's requeue signal are only noted by their handlers; ``step_end`` votes
(the same non-blocking 8-byte all-reduce, read a step later) and, once all ranks agree on a stop, saves ``state`` to
``path`` as ``fabric.save`` does, waits until it is published, requeues the SLURM job if asked and raises
:class:`~lightning_shard.core.preemption.Preempted` (exit status 75) on every rank. Leaving the block restores the
handlers that were there before. With ``preemption=False`` in the strategy's settings it installs nothing and never
stops.
"""

from __future__ import annotations

import signal
import threading
from types import TracebackType
from typing import Any

from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import _PATH
from lightning.fabric.wrappers import _unwrap_objects

from lightning_shard.core.preemption import PREEMPTED_EXIT_CODE, StopRequests, stop_after_checkpoint


class Preemptible:
    """The context of ``fabric.strategy.preemptible()``; see the module docstring.

    Example:
        >>> with fabric.strategy.preemptible() as preemption:  # doctest: +SKIP
        ...     for step in range(steps):
        ...         train_step()
        ...         preemption.step_end("ckpts/last.ckpt", {"model": model, "optimizer": optimizer, "step": step})
    """

    def __init__(self, strategy: ParallelStrategy, enabled: bool, exit_code: int = PREEMPTED_EXIT_CODE) -> None:
        self.strategy = strategy
        self.enabled = enabled
        self.exit_code = exit_code
        self.requests = StopRequests([signal.SIGTERM])
        self._replaced: dict[signal.Signals, Any] = {}

    def __enter__(self) -> Preemptible:
        if self.enabled:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError(
                    "`preemptible()` installs signal handlers, which Python allows only in the main thread; run the "
                    "loop in the main thread, or pass `preemption=False` to the strategy."
                )
            self._replaced = self.requests.install(self.strategy.cluster_environment)
            self.requests.vote.open()  # a collective: every rank enters the block
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if not self.enabled:
            return
        if kind is None:
            self.requests.vote.close()  # a request in the last step needs no checkpoint: the loop is done
        else:
            self.requests.vote.abandon()  # after an error other ranks may never complete the votes
        for signum, handler in self._replaced.items():
            signal.signal(signum, handler)

    def step_end(self, path: _PATH, state: dict[str, Any]) -> None:
        """Call on every rank after each optimizer step: when all ranks have agreed on a stop, save ``state`` to
        ``path`` (as ``fabric.save(path, state)``) and end the run (see the module docstring); otherwise return."""
        if not self.enabled:
            return
        agreed = self.requests.agreed(self.strategy.global_rank)
        if agreed is None:
            return
        signum, requeue = agreed
        rank_zero_info(f"Preemption: {signum.name} agreed by all ranks; saving {path}")
        self.strategy.save_checkpoint(path, _unwrap_objects(state))
        stop_after_checkpoint(self.strategy, str(path), requeue, self.exit_code)
