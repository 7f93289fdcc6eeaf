"""``end_process_group`` waits, before the interpreter finalises, until no native thread is mid-work: the gloo
worker that still holds a collective's tensors gets to drop them while the GIL can be taken (``process_exit``).

The abort itself is a race (about 1 launch in 10 under load on 2 cores): what is tested here is the wait's
condition, with a native thread that runs without the GIL (hashing releases it) standing in for the gloo worker.
``tests/cpu_comms_run.py`` ends with ``end_process_group``, and every launch of the strategy runs it at exit.
"""

from __future__ import annotations

import hashlib
import threading
import time

from lightning_shard.core.process_exit import wait_for_native_threads

DATA = b"\0" * (64 << 20)


def hash_seconds() -> float:
    start = time.monotonic()
    hashlib.sha256(DATA).digest()
    return time.monotonic() - start


def test_returns_at_once_when_no_thread_runs() -> None:
    assert wait_for_native_threads() < 0.1


def test_waits_while_a_native_thread_runs() -> None:
    alone = hash_seconds()
    worker = threading.Thread(target=hashlib.sha256, args=(DATA,))
    worker.start()
    waited = wait_for_native_threads(max_wait_s=30)
    worker.join()
    # The wait lasts as long as the worker's native work (0.5x: the two compete for 2 cores, so it is not faster).
    assert waited > 0.5 * alone, (waited, alone)
