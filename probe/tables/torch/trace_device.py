"""Memory and device time for a span, read without ever synchronising a device.

* CUDA in use: memory from the caching allocator's counters (one ``_cuda_memoryStats`` call gives
  current and peak, allocated and reserved; the allocator keeps them on the host, no sync); each span's
  device time from two CUDA events recorded on the current stream, read once the end event has
  completed (``Event.query()`` does not block), at the next step boundary or at query time.
* CPU only: ``allocated`` is the process's resident set (RSS) in MB, read from ``/proc/self/statm`` with
  one ``pread`` on a descriptor kept open, after an ``fstat`` that makes sure the number is still that
  file (two system calls: 3 us in a tight loop here, 30-60 us at a step's end, after the optimizer's
  pass over every parameter, this machine being a nested VM); ``max_allocated`` is the highest RSS this
  trace has seen; ``cached`` and ``max_cached`` are NaN (NULL in the table): there is no caching
  allocator. Spans that end soon after a reading share it: within 1 ms, or within 5000 times what the
  last reading took where that is longer (up to 250 ms), so reading RSS takes at most about 0.02 % of
  the process's time however short its modules or spans are. The step marks read again after 1000 times
  what a reading took (at most 250 ms): every step has its own reading where that costs under 0.1 % of
  the step (a 10 ms step, a reading under 10 us), and a reading at most 0.1 % of the steps' time where
  they are shorter (readings of 50 us: one every 50 ms, every fifth 10 ms step). A child forked with ``os.fork`` (its at-fork hook) opens its own
  entry at its first reading.

The descriptor is the program's to close: a program that closes every descriptor it does not know may
give its number to a file of its own. Before each use the reader checks the number still refers to the
file it opened (device and inode, as the agent's listener does), and where it does not, opens its own
again and leaves the number alone: it never reads or closes a descriptor that is not its own.
"""

import math
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

from probe._fds import Identity, fd_identity

__all__ = ["CpuMemory", "CudaMemory", "CudaTimer", "memory_reader"]

MB = 1024.0 * 1024.0
Memory = Tuple[float, float, float, float]
_NAN = math.nan
_REUSE_NS = 1_000_000
_REUSE_FACTOR = 5000
_REUSE_MAX_NS = 250_000_000
_STEP_FACTOR = 1000  # a step mark's reading serves for 1000 times its cost: at most 0.1 % of the steps' time
_perf_ns = time.perf_counter_ns


class CpuMemory:
    """Process RSS (MB) and the highest RSS seen; cached columns NaN."""

    device = "cpu"

    def __init__(self) -> None:
        self._pid = -1  # the process that opened self._fd (-1: none yet, or forked since)
        self._fd = -1
        self._identity: Optional[Identity] = None  # of the file self._fd was opened on
        self._page_mb = os.sysconf("SC_PAGE_SIZE") / MB
        self._peak = 0.0
        self._at = -_REUSE_MAX_NS
        self._reuse = _REUSE_NS
        self._cost = 0  # ns the last reading took
        self._last: Memory = (_NAN, _NAN, _NAN, _NAN)
        _readers.add(self)

    def __call__(self) -> Memory:
        now = _perf_ns()
        if now - self._at < self._reuse:  # spans that end soon after a reading share it
            return self._last
        return self._read(now)

    def _read(self, now: int) -> Memory:
        if self._pid < 0:  # a forked child must read its own /proc entry (no getpid() a reading: see _forked)
            if self._fd >= 0:
                self._close_ours()  # the parent's descriptor, inherited: the child's copy is ours to close
            self._open()
        elif not self._ours():  # the program closed it, and may have given the number to a file of its own
            self._open()
        try:
            raw = os.pread(self._fd, 96, 0)
            rss = int(raw.split(None, 2)[1]) * self._page_mb
        except (OSError, ValueError, IndexError):
            return (_NAN, _NAN, _NAN, _NAN)
        if rss > self._peak:
            self._peak = rss
        self._at, self._last = now, (rss, self._peak, _NAN, _NAN)
        self._cost = _perf_ns() - now
        self._reuse = min(max(_REUSE_NS, self._cost * _REUSE_FACTOR), _REUSE_MAX_NS)
        return self._last

    @property
    def last(self) -> Memory:
        """The last reading (NaN before the first)."""
        return self._last

    def fresh(self, now: int) -> Tuple[Memory, int]:
        """A reading for the trace's step marks (made now unless the last one still serves them), and the
        clock until which it serves them: they skip this call while it does. A step mark's reading serves
        for ``_STEP_FACTOR`` times what a reading took (at most 250 ms): every step gets its own where a
        reading costs under 0.1 % of the step, and steps shorter than that share one, its cost kept at
        0.1 % of their time (the spans' rule, 5000 times, would have 20 steps of 10 ms share one)."""
        serves = min(self._cost * _STEP_FACTOR, _REUSE_MAX_NS)
        last = self._last if now - self._at < serves else self._read(now)
        return last, self._at + min(self._cost * _STEP_FACTOR, _REUSE_MAX_NS)

    def _ours(self) -> bool:
        """Whether ``self._fd`` still refers to the file it was opened on (never true of -1)."""
        return self._fd >= 0 and self._identity is not None and fd_identity(self._fd) == self._identity

    def _open(self) -> None:
        """Open /proc/self/statm; a number it held before is left as it is (it is not ours any more)."""
        self._pid = os.getpid()
        self._fd, self._identity = -1, None
        try:
            fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        identity = fd_identity(fd)
        if identity is None:
            return
        self._fd, self._identity = fd, identity

    def _close_ours(self) -> None:
        if self._ours():
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self._identity = -1, None

    def close(self) -> None:
        """Close the descriptor where it is still ours (in this process, on its file); else leave it."""
        if self._pid == os.getpid():
            self._close_ours()
        self._fd, self._identity = -1, None


_readers: "weakref.WeakSet[CpuMemory]" = weakref.WeakSet()


def _forked() -> None:
    """In a child just forked (``os.fork``, multiprocessing): every reader opens its own /proc entry at its
    next reading, and shares none of the parent's. A system call less a reading than asking getpid()."""
    for reader in list(_readers):
        reader._pid = -1
        reader._at = -_REUSE_MAX_NS


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class CudaMemory:
    """The CUDA caching allocator's counters of the current device, in MB (host-side, no sync)."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._stats: Optional[Callable[[int], Any]] = getattr(torch._C, "_cuda_memoryStats", None)
        self.device = "cuda:%d" % torch.cuda.current_device()

    def __call__(self) -> Memory:
        index = self._torch.cuda.current_device()
        if self._stats is not None:
            stats = self._stats(index)
            allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
            return (allocated["current"] / MB, allocated["peak"] / MB, reserved["current"] / MB, reserved["peak"] / MB)
        cuda = self._torch.cuda
        return (cuda.memory_allocated(index) / MB, cuda.max_memory_allocated(index) / MB,
                cuda.memory_reserved(index) / MB, cuda.max_memory_reserved(index) / MB)

    def close(self) -> None:
        pass


def memory_reader(torch: Any) -> Any:
    """CUDA counters when this process has initialised CUDA (never initialise it ourselves), else RSS."""
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return CudaMemory(torch)
    except Exception:
        pass
    return CpuMemory()


class CudaTimer:
    """Device time of spans from CUDA event pairs, resolved when the events have completed.

    Events are reused from a pool; at most ``limit`` spans wait for their events (older ones keep their
    host duration), so a stalled device cannot make this grow.
    """

    def __init__(self, torch: Any, limit: int = 20_000) -> None:
        self._event = torch.cuda.Event
        self._pool: List[Any] = []
        self._pending: Deque[Tuple[int, Any, Any, Optional[List[int]]]] = deque()
        self._limit = limit
        self._resolving = threading.Lock()

    def mark(self) -> Any:
        """Record an event on the current stream now (no sync) and return it."""
        event = self._pool.pop() if self._pool else self._event(enable_timing=True)
        event.record()
        return event

    def pending(self, number: int, start: Any, end: Any, children: Optional[List[int]] = None) -> None:
        self._pending.append((number, start, end, children))
        while len(self._pending) > self._limit:
            _, a, b, _ = self._pending.popleft()
            self._pool.extend((a, b))

    def resolve(self, store: Callable[[int, float, Optional[List[int]]], None]) -> None:
        """Store the device time of every span whose end event has completed, in order; stop at the first not yet.

        Called from the training thread at a step's end and from the agent at query time: whoever comes
        second while the other resolves simply returns (never waits in a hook).
        """
        if not self._resolving.acquire(blocking=False):
            return
        try:
            self._resolve(store)
        finally:
            self._resolving.release()

    def _resolve(self, store: Callable[[int, float, Optional[List[int]]], None]) -> None:
        while self._pending:
            number, start, end, children = self._pending[0]
            if not end.query():
                return
            self._pending.popleft()
            store(number, start.elapsed_time(end) / 1000.0, children)
            if len(self._pool) < 4096:
                self._pool.extend((start, end))
