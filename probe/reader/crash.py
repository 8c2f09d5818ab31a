"""Crash records left by agents whose process died (``probe.agent.crash`` writes them): found, read
into stacks, and cleaned up.

Clean-up rule: a record of a process that is gone is kept for ``KEEP_DAYS`` days; one without stacks
(a process ended by a signal that runs no handler: SIGTERM, SIGKILL, the OOM killer) only for
``KEEP_SILENT_S``. Of the records of processes stopped on purpose (SIGTERM, Ctrl-C: a demo, a test, a
cancelled job) the newest ``KEEP_STOPPED_RECORDS`` are kept, and of the others (crashes, and deaths
that left no word) the newest ``KEEP_RECORDS``: each kind within its own bound, so that many demo runs
cannot push out the record of a real crash. Older ones are removed whenever ``probe list`` runs. A
record of a live process is never touched. Stdlib only.
"""

import os
import re
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from probe import _paths
from probe.reader.stacks import OutsideFrame, Stacks, ThreadStack

__all__ = ["CrashRecord", "records", "dead_record", "clean_up", "stopped_on_purpose", "KEEP_DAYS", "KEEP_RECORDS",
           "KEEP_STOPPED_RECORDS", "KEEP_SILENT_S"]

KEEP_DAYS = 7
KEEP_RECORDS = 20  # crashes (and deaths without a word), the newest
KEEP_STOPPED_RECORDS = 20  # processes stopped on purpose, the newest: a bound of their own
KEEP_SILENT_S = 3600
_MAGIC = "probe-crash-record 1"
_NAME = re.compile(r"^(\d+)-(\d+)\.crash$")
_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_FATAL = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
          "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}
_MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class CrashRecord:
    path: str
    pid: int
    start_ticks: int
    header: Dict[str, str]
    body: str
    written_at: float  # the file's mtime: when the process died, for a record with a cause

    @property
    def alive(self) -> bool:
        """The very process that wrote the record still runs (same pid, same start time)."""
        from probe.reader import proc

        try:
            same = _paths.process_start_ticks(str(self.pid)) == self.start_ticks
        except (OSError, ValueError, IndexError):
            return False
        return same and proc.state(self.pid) not in (None, "Z", "X")

    @property
    def cause(self) -> str:
        """How the process died, in a few words."""
        for line in self.body.splitlines():
            if line.startswith("Fatal Python error: "):
                what = line[len("Fatal Python error: "):].strip()
                signal = _FATAL.get(what)
                return "%s (%s)" % (signal, what.lower()) if signal else what
            if line.startswith("Uncaught exception: "):
                return "uncaught exception: " + line[len("Uncaught exception: "):].strip()
        if self.header.get("sigterm") == "stacks" and self.has_stacks:
            return "SIGTERM (terminated)"  # the only signal whose stacks come without a fatal-error line
        if self.header.get("faulthandler") == "program":
            return "ended without a record here (the program's own faulthandler had its crash output)"
        return "ended without a word: a signal that runs no handler (SIGKILL, the OOM killer, SIGTERM) or os._exit"

    @property
    def stopped_on_purpose(self) -> bool:
        """Ended by SIGTERM or Ctrl-C, as a person or a scheduler ends a process: not a crash."""
        return stopped_on_purpose(self.cause)

    @property
    def died_at(self) -> Optional[float]:
        """When it died: the time the handler wrote; None for a header-only record (the file was last
        written at start, so it does not tell)."""
        return self.written_at if self.body.strip() else None

    @property
    def has_stacks(self) -> bool:
        return any(_HEADER.match(line) for line in self.body.splitlines())

    def stacks(self) -> Stacks:
        main = _int(self.header.get("main_thread", ""), 16)
        agent = {_int(t, 16) for t in self.header.get("agent_threads", "").split(",") if t}
        threads = []
        for ident, frames in _blocks(self.body):
            is_main = ident == main
            # The agent's threads: those it had at start, and request workers started later.
            is_agent = ident in agent or any(f.file.endswith("probe/agent/listener.py") for f in frames)
            threads.append(ThreadStack(None, ident, "MainThread" if is_main else None, is_main, tuple(frames),
                                       is_agent=is_agent))
        threads.sort(key=lambda t: not t.is_main)
        died = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.written_at))
        return Stacks(self.pid, "crash record %s, written when the process died (%s)" % (self.path, died),
                      tuple(threads), self.header.get("python"), {"cause": self.cause, "died_at": self.written_at})


def stopped_on_purpose(cause: str) -> bool:
    """Whether a record's ``cause`` is SIGTERM or Ctrl-C (an uncaught KeyboardInterrupt), not a crash."""
    return cause.startswith("SIGTERM") or cause.startswith("uncaught exception: KeyboardInterrupt")


def _int(text: str, base: int) -> Optional[int]:
    try:
        return int(text, base)
    except ValueError:
        return None


def _blocks(body: str) -> List[Tuple[int, List[OutsideFrame]]]:
    """Thread blocks in faulthandler's format, innermost frame first; a thread's first block wins."""
    out: List[Tuple[int, List[OutsideFrame]]] = []
    seen = set()
    current: Optional[List[OutsideFrame]] = None
    for line in body.splitlines():
        header = _HEADER.match(line)
        if header:
            ident = int(header.group(2), 16)
            current = None if ident in seen else []
            if current is not None:
                seen.add(ident)
                out.append((ident, current))
            continue
        if current is None:
            continue
        frame = _FRAME.match(line)
        if frame:
            current.append(OutsideFrame(frame.group(3), frame.group(1), int(frame.group(2))))
        elif not line.strip():
            current = None
    return out


def _read(path: str) -> Optional[CrashRecord]:
    match = _NAME.match(os.path.basename(path))
    if not match:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            data = handle.read(_MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    head, sep, body = data.partition("\n---\n")
    lines = head.splitlines()
    if not sep or not lines or lines[0] != _MAGIC:
        return None
    header = {}
    for line in lines[1:]:
        key, _, value = line.partition(" ")
        header[key] = value
    return CrashRecord(path, int(match.group(1)), int(match.group(2)), header, body, info.st_mtime)


def records(directory: Optional[str] = None) -> List[CrashRecord]:
    """Every record in the runtime directory, newest first."""
    directory = directory or _paths.runtime_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [r for r in (_read(os.path.join(directory, n)) for n in names if n.endswith(".crash")) if r]
    found.sort(key=lambda r: r.written_at, reverse=True)
    return found


def dead_record(pid: int) -> Optional[CrashRecord]:
    """The newest record of a process ``pid`` that is no longer running (None if there is none)."""
    for record in records():
        if record.pid == pid and not record.alive:
            return record
    return None


def _noticed_dead(record: CrashRecord, now: float) -> float:
    """When a header-only record was first seen dead: its mtime, once touched here. Untouched, its mtime
    is its process's start (the header is written then), so it is touched now: a job killed after two
    days keeps its record for KEEP_SILENT_S after that, not zero."""
    try:
        started = float(record.header.get("started_at", "0"))
    except ValueError:
        started = 0.0
    if record.written_at - started > 5.0:
        return record.written_at
    try:
        os.utime(record.path, (now, now))
    except OSError:
        pass
    return now


def clean_up(now: Optional[float] = None) -> int:
    """Remove records of dead processes past the rule above; returns how many went."""
    now = now or time.time()
    removed = 0
    kept = {True: 0, False: 0}  # records kept so far, newest first: stopped on purpose, or not
    for record in records():
        if record.alive:
            continue
        since = record.written_at
        if not record.has_stacks:
            since = _noticed_dead(record, now)
        keep_for = KEEP_DAYS * 86400 if record.has_stacks else KEEP_SILENT_S
        on_purpose = record.stopped_on_purpose
        bound = KEEP_STOPPED_RECORDS if on_purpose else KEEP_RECORDS
        if kept[on_purpose] < bound and now - since <= keep_for:
            kept[on_purpose] += 1
        else:
            try:
                os.unlink(record.path)
                removed += 1
            except OSError:
                pass
    return removed
