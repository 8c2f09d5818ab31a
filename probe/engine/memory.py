"""What SQL may take from the process's memory, whatever the values look like.

DuckDB's ``memory_limit`` covers what its buffer manager allocates (hash tables, sorts, materialised
intermediates), not the values themselves: a string that a function builds, a constant folded by the
optimizer and copied into every row of a result chunk, and the Arrow buffers a result is converted to
live outside it. ``SELECT repeat('x', 100000000) FROM range(30)`` peaked at 2.3-3.3 GB of RSS under a
512 MB limit. The engine closes that in two ways:

* each SELECT runs as ``WITH q AS MATERIALIZED (SELECT * FROM (<query>) LIMIT cap + 1) SELECT * FROM q``
  (see ``sandbox._wrapped``): the rows of the result are first copied into a collection that the buffer
  manager owns, so a result larger than the limit fails there, with DuckDB's out-of-memory error, before
  the copies outside it are made (the query above: 0.55 GB peak, a clear error);
* :class:`MemoryGuard` watches the process's resident memory while queries run (every ``_EVERY`` s,
  on the engine's watchdog thread) and interrupts every query in flight once it has grown past the
  bound since the oldest of them began. It acts between DuckDB's chunks of work, so it bounds growth
  that builds up (many values, several queries); a single function call that builds one huge value
  cannot be stopped inside the call.

Stdlib only; runs in the target. No resource limit of the process is changed.
"""

import os
import threading
from typing import Callable, Dict, Optional

__all__ = ["MemoryGuard", "rss_bytes", "parse_size", "return_memory", "page_out_libraries"]

_EVERY = 0.01  # seconds between two looks at the resident memory while a query runs
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> Optional[int]:
    """This process's resident memory now (one read of /proc/self/statm, ~10 us), or None off Linux."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_trim: list = []


def return_memory() -> None:
    """Hand the memory that glibc keeps in its arenas after a large request back to the system
    (``malloc_trim(0)``; a killed client's 400 MB stayed for good without it). Never raises: it runs at
    the edge of the target. A no-op where the C library has no ``malloc_trim`` (musl, macOS)."""
    try:
        if not _trim:
            import ctypes

            # The process's own symbols (libc among them); find_library would start a subprocess.
            _trim.append(getattr(ctypes.CDLL(None), "malloc_trim", None))
        if _trim[0] is not None:
            _trim[0](0)
    except Exception:
        _trim[:] = [None]


_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (file pages are read again when next touched)


def page_out_libraries(names: "tuple[str, ...]") -> int:
    """Give the kernel back the resident pages of the shared libraries whose path holds one of ``names``
    (``"duckdb"``, ``"arrow"``: the agent's own engine, once closed): their code and read-only data are
    read from the file again if ever used (~20 ms for DuckDB's next query). Only mappings that cannot
    hold the process's own data are touched: not writable, file-backed, and with no page of their own
    (``Anonymous: 0 kB`` in smaps; that leaves out RELRO, which the loader wrote before making it
    read-only); the kernel leaves the pages other processes map too. One read of /proc/self/smaps,
    scanned by regular expressions. Returns the bytes of the mappings advised (0: nothing done, off
    Linux, or no MADV_PAGEOUT). Never raises."""
    if not names:
        return 0
    try:
        import ctypes
        import re

        with open("/proc/self/smaps", "rb") as f:
            text = f.read()
        wanted = b"|".join(re.escape(n.encode()) for n in names)
        header = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) r-[-x][ps] \S+ \S+ \S+ +(/\S*(?:%s)\S*\.so[^\n]*)$" % wanted,
                            re.MULTILINE)
        anonymous = re.compile(rb"^Anonymous: +(\d+) kB$", re.MULTILINE)
        regions = []
        for match in header.finditer(text):
            own = anonymous.search(text, match.end())
            if own is not None and own.group(1) == b"0":
                regions.append((int(match.group(1), 16), int(match.group(2), 16)))
        if not regions:
            return 0
        madvise = ctypes.CDLL(None).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        done = 0
        for start, end in regions:
            if madvise(start, end - start, _MADV_PAGEOUT) == 0:
                done += end - start
        return done
    except Exception:
        return 0


def parse_size(text: str) -> Optional[int]:
    """DuckDB's spelling of a size (``"512MB"``, ``"1GiB"``, ``"1.5 GB"``) in bytes; None if it does not parse."""
    units = {"": 1, "B": 1, "BYTES": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    raw = str(text).strip().upper().replace(" ", "")
    number = raw.rstrip("KMGTIBYES")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        return None
    if unit not in units or value < 0:
        return None
    return int(value * units[unit])


class MemoryGuard:
    """Interrupts the queries in flight when the process's RSS grows ``budget`` bytes past its value when
    the oldest of them began. ``schedule(delay, action, repeat)`` runs the checks (the engine's watchdog).
    """

    def __init__(self, budget: int, schedule: Callable[..., int], cancel: Callable[[int], None]) -> None:
        self.budget = budget
        self._schedule = schedule
        self._cancel = cancel
        self._lock = threading.Lock()
        self._active: Dict[int, "tuple[int, Callable[[], None]]"] = {}  # token -> (RSS at its start, stop)
        self._tokens = 0
        self._alarm: Optional[int] = None
        self.peak_growth = 0  # the largest growth seen, for tests and benches

    def enter(self, stop: Callable[[], None]) -> Optional[int]:
        """Watch a query from now; ``stop`` is called (on the watchdog's thread) to interrupt it.
        Returns a token for :meth:`leave`, or None where this system has no /proc to read."""
        now = rss_bytes()
        if now is None:
            return None
        with self._lock:
            self._tokens += 1
            token = self._tokens
            self._active[token] = (now, stop)
            if self._alarm is None:
                self._alarm = self._schedule(_EVERY, self._check, _EVERY)
        return token

    def leave(self, token: Optional[int]) -> None:
        if token is None:
            return
        with self._lock:
            self._active.pop(token, None)
            alarm = self._alarm if not self._active else None
            if alarm is not None:
                self._alarm = None
        if alarm is not None:
            self._cancel(alarm)

    def _check(self) -> None:
        now = rss_bytes()
        if now is None:
            return
        with self._lock:
            if not self._active:
                return
            base = min(start for start, _ in self._active.values())
            growth = now - base
            self.peak_growth = max(self.peak_growth, growth)
            stops = [stop for _, stop in self._active.values()] if growth > self.budget else []
        for stop in stops:
            try:
                stop()
            except Exception:
                pass
