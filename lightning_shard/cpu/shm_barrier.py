"""A barrier for the processes of one host: one futex word per rank in a shared page.

The shared-memory collectives (``shm_comms``) synchronise once per collective. Through gloo a barrier is a round
trip through gloo's worker thread and the loopback socket on every rank, 0.5 ms from the last arrival to the exit in
training on 2 CPU ranks; here the last rank to arrive wakes the others directly (0.03 ms), and a waiting rank sleeps
in the kernel, leaving the core to the others.

Each rank counts its barriers and writes the count into its word, then waits until every other rank's word has
moved past the previous count. A rank can be at most one barrier ahead of any other, so "moved past" is "differs from
the previous count", and the count may wrap.

Only on x86-64 Linux: there, stores become visible to other cores in program order, so the collective's data
written before a rank's word is visible to whoever sees the word. Elsewhere that takes memory fences that Python
cannot issue, and ``barrier_supported`` says no (the collectives then keep gloo's barrier).

A waiting rank wakes every ``POLL_SECONDS`` to check that the ranks it waits for are alive (through pidfds opened
while they were) and that the process group's timeout has not passed: a rank that died or hangs ends the job with an
error that names it, as gloo's barrier would, instead of leaving this rank waiting.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import select
import sys
import time

import torch

WORD_BYTES = 64  # one cache line per rank's word: no false sharing between ranks
POLL_SECONDS = 0.5
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not the _PRIVATE variants: the words are shared between processes
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def barrier_supported() -> bool:
    """Whether this process can take part in a ``FutexBarrier``: x86-64 Linux with pidfds (Linux 5.3)."""
    return sys.platform == "linux" and platform.machine() == "x86_64" and hasattr(os, "pidfd_open")


def pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[inode]``); peers' pids mean something only within the same one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def page_bytes(world: int) -> int:
    """Bytes of shared memory a barrier of ``world`` ranks needs."""
    return WORD_BYTES * world


class FutexBarrier:
    """A barrier of ``len(pids)`` processes of one host on futex words in ``page`` (shared, zeroed, at least
    ``page_bytes(world)`` bytes, the same mapping on every rank).

    Example:
        >>> page = torch.zeros(page_bytes(2), dtype=torch.uint8)  # in practice: a MAP_SHARED mapping
        >>> barrier = FutexBarrier(page, rank=0, pids=[os.getpid(), peer_pid], timeout=1800.0)  # doctest: +SKIP
        >>> barrier()  # returns once the other rank has called it as often  # doctest: +SKIP
    """

    def __init__(self, page: torch.Tensor, rank: int, pids: list[int], timeout: float) -> None:
        self._pidfds: dict[int, int] = {}
        if page.numel() * page.element_size() < page_bytes(len(pids)):
            raise ValueError(f"a barrier of {len(pids)} ranks needs {page_bytes(len(pids))} bytes, got a smaller page")
        self._page = page  # keeps the mapping alive while the words point into it
        self._words = [ctypes.c_uint32.from_address(page.data_ptr() + WORD_BYTES * r) for r in range(len(pids))]
        self._rank = rank
        self._timeout = timeout
        # Opened now, while every rank is alive: a pidfd keeps naming its process (no pid reuse) and turns readable
        # when that process exits, even while it is a zombie that no one has reaped.
        for peer, pid in enumerate(pids):
            if peer != rank:
                self._pidfds[peer] = os.pidfd_open(pid)
        self._count = 0

    def __call__(self) -> None:
        previous = self._count
        self._count = (self._count + 1) & 0xFFFFFFFF
        mine = self._words[self._rank]
        mine.value = self._count
        _futex(mine, _FUTEX_WAKE, _WAKE_ALL)
        start = time.monotonic()
        for peer in self._pidfds:
            word = self._words[peer]
            while (seen := word.value) == previous:
                # Returns at once if the word has changed since it was read, when the peer wakes us, or after a poll.
                _futex(word, _FUTEX_WAIT, seen, POLL_SECONDS)
                if word.value == previous:
                    self._check(peer, start)

    def _check(self, peer: int, start: float) -> None:
        ready, _, _ = select.select([self._pidfds[peer]], [], [], 0)
        if ready:
            raise RuntimeError(
                f"lightning_shard: rank {peer} of this process group exited while rank {self._rank} waited for it "
                "in a shared-memory barrier; see that rank's error"
            )
        if time.monotonic() - start > self._timeout:
            raise RuntimeError(
                f"lightning_shard: rank {self._rank} waited {self._timeout:g} s (the process group's timeout) for "
                f"rank {peer} in a shared-memory barrier; the ranks are running different collectives or one is stuck"
            )

    def close(self) -> None:
        """Close the pidfds (also done when the barrier is garbage-collected)."""
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds = {}

    def __del__(self) -> None:
        self.close()


@functools.cache
def _syscall() -> ctypes._CFuncPtr:
    function = ctypes.CDLL(None, use_errno=True).syscall
    function.restype = ctypes.c_long
    # number, uaddr, futex_op, val, timeout, uaddr2, val3
    function.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_uint32]  # fmt: skip
    return function


def _futex(word: ctypes.c_uint32, op: int, value: int, timeout: float | None = None) -> None:
    """``futex(2)``. A wait that returns early (the word changed, a signal, the timeout) is fine: every caller reads
    the word again; any other error (a sandbox that forbids futexes) is raised."""
    spec = None
    if timeout is not None:
        spec = ctypes.byref(_Timespec(int(timeout), int(timeout % 1 * 1e9)))
    if _syscall()(_SYS_FUTEX, ctypes.addressof(word), op, value, spec, None, 0) == -1:
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(code, f"futex: {os.strerror(code)}")
