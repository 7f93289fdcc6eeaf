"""Ending a process that ran collectives without the abort at interpreter exit.

A gloo collective runs on one of the process group's native worker threads, which wakes the caller when the
collective is done and only then drops its own reference to the collective's tensors. On torch 2.11 and later,
dropping a tensor that has a Python object takes the GIL. If the interpreter has begun to finalise by then, Python
ends the worker with ``pthread_exit``, whose unwinding crosses C++ frames that may not throw, and the process
aborts after its work is done: ``terminate called without an active exception``, exit status -6. In CI, under load,
this happened to about 1 launch in 10 (a core dump's stack: ``ProcessGroupGloo::runLoop`` ->
``~AsyncAllreduceWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``).
``destroy_process_group`` does not prevent it. Gloo has no shutdown, so its threads are joined only when the
group's last reference goes, and a ``DeviceMesh`` or a sharded model keeps that reference until finalisation.

So :func:`end_process_group` (run at exit by the strategy, and called at the end of scripts that start
``torch.distributed`` themselves) first waits until no other thread of the process is running, while the
interpreter is still whole. Each native thread then blocks, whether as an idle gloo worker on its queue, or on
the GIL, which the waiting main thread has released so that such a thread takes it and finishes. After that it
destroys the process groups.

Example:
    >>> end_process_group()  # no process group: returns at once
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch.distributed as dist

_TASKS = Path("/proc/self/task")
_POLL_S = 0.002
_QUIET_POLLS = 3  # consecutive polls with no other thread running
# A worker descheduled under load runs again within milliseconds; a thread that spins for good (a GPU library's
# progress thread) must not hold every exit for long.
_MAX_WAIT_S = 0.5


def _other_threads_running() -> bool | None:
    """Whether any thread of this process other than the caller is running or runnable (``R`` in its
    ``/proc/self/task/<tid>/stat``); ``None`` where ``/proc`` does not say (not Linux)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    me = str(threading.get_native_id())
    for tid in tids:
        if tid == me:
            continue
        try:
            stat = (_TASKS / tid / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rindex(")") + 2] == "R":
            return True
    return False


def wait_for_native_threads(max_wait_s: float = _MAX_WAIT_S) -> float:
    """Sleep (GIL released) until no other thread of this process has run for a few polls, at most ``max_wait_s``;
    return the seconds waited. Where ``/proc`` is missing it sleeps a fixed 50 ms.

    Example:
        >>> wait_for_native_threads() < 1.0
        True
    """
    start = time.monotonic()
    quiet = 0
    while quiet < _QUIET_POLLS and time.monotonic() - start < max_wait_s:
        time.sleep(_POLL_S)
        running = _other_threads_running()
        if running is None:
            time.sleep(0.05)
            break
        quiet = 0 if running else quiet + 1
    return time.monotonic() - start


def end_process_group() -> None:
    """Let the collectives' native threads finish what they hold, then destroy every process group. Safe to call
    when none exists, and twice.

    Example:
        >>> end_process_group()
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as Lightning's handler: Ctrl+C does not cut it short
    try:
        wait_for_native_threads()
        dist.destroy_process_group()
    finally:
        signal.signal(signal.SIGINT, previous)
