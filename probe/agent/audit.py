"""The audit trail: who asked this process to do what, recorded before it runs and with its outcome after.

Every control and eval request (eval and REPL input, checkpoint, debug start and stop, trace changes and
export, learning-rate changes, interrupts) is written as two JSON lines to ``audit-PID-TICKS.jsonl`` in the
runtime directory, beside the agent's socket:

    {"seq": 3, "phase": "start", "time": 1764090000.123, "pid": 4242, "scope": "eval", "by": "full token",
     "peer": "10.0.0.5:51234", "command": "eval", "detail": {...}, "code": "...", "code_sha256": "...",
     "code_bytes": 27}
    {"seq": 3, "phase": "end", "time": ..., "pid": 4242, "command": "eval", "outcome": "ok" | "error" |
     "interrupted", "error": "...", "elapsed_ms": 1.9}

Refused requests go to ``audit-PID-TICKS.refused.jsonl``, counted per asker and minute
(``probe.agent.audit_refusals``: ``{"phase": "refused", ..., "count": 512, "last": ...}``), and reads,
recorded only with ``PROBE_AUDIT_READS=1``, to ``audit-PID-TICKS.reads.jsonl``: a caller with a read token
can neither refuse nor read the records of what ran out of the trail.

Each file is the owner's only (0600), opened with O_APPEND, and each record is one ``os.write``, so that
records of concurrent requests never interleave. Each kind is bounded on its own: past
``PROBE_AUDIT_MAX_BYTES`` (1 MB) the actions' file is renamed to ``.1`` (the older ``.1`` to ``.2``;
``PROBE_AUDIT_KEEP`` such files, default 2) and a new one begun; the refusals' and the reads' files rotate
at a quarter of that (at least 4 KB) with one older file each. So one process's trail holds at most
(KEEP + 1) x MAX_BYTES + 4 x MAX_BYTES / 4: 4 MB by default. It stays when the process ends, for a
post-mortem (``probe PID audit`` reads it); the trails of processes that no longer run are pruned to the
newest ``KEEP_DEAD`` when a new trail is begun.

Nothing here raises into the target: a trail that cannot be written says so once on stderr. The files are
read (the table ``probe.audit``, ``probe PID audit``) by ``probe.tables.probe_audit``: the agent writes,
the table reads, and the import runs from here to there only. Stdlib only.
"""

import atexit
import hashlib
import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from probe import _paths
from probe._stderr import say as _say
from probe.agent.audit_refusals import Refusals
from probe.tables import probe_audit
from probe.tables.probe_audit import _NAME, ACTIONS, KINDS, READS, REFUSED, actions, records, trail_files

__all__ = ["AuditLog", "trail", "records", "actions", "trail_files", "MAX_SNIPPET"]

MAX_SNIPPET = 4096  # bytes of a snippet kept in a record (its sha256 and length are of the whole)
MAX_DETAIL = 1024  # characters of a detail value
MAX_BYTES = 1 << 20
KEEP = 2
KEEP_DEAD = 32  # trails of processes that no longer run, kept in the runtime directory
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


def trail_path(pid: int, ticks: int) -> str:
    return os.path.join(_paths.runtime_dir(), "audit-%d-%d.jsonl" % (pid, ticks))


def kind_path(path: str, kind: str) -> str:
    """The file of one kind of record beside the actions' ``path``: ``audit-P-T.refused.jsonl``."""
    if not kind:
        return path
    stem, dot, ext = path.rpartition(".")
    return "%s.%s.%s" % (stem, kind, ext) if dot else "%s.%s" % (path, kind)


def _env_int(name: str, default: int, low: int) -> int:
    try:
        return max(low, int(os.environ.get(name, "") or default))
    except ValueError:
        return default


class _Appender:
    """One kind of record's files: ``BASE`` (owner-only, O_APPEND, one ``os.write`` a line), rotated to
    ``BASE.1`` .. ``BASE.KEEP`` past ``max_bytes``. Re-opened in a forked child (its own path)."""

    def __init__(self, path: Callable[[], str], max_bytes: int, keep: int) -> None:
        self._where = path
        self.max_bytes, self.keep = max_bytes, keep
        self.fd, self.pid, self.size = -1, -1, 0
        self.path = ""

    def write(self, line: bytes) -> None:
        """Called under the trail's lock; raises OSError where the file cannot be written."""
        if self.pid != os.getpid():
            self._open()
        if self.size + len(line) > self.max_bytes and self.size > 0:
            self._rotate()
        if self.fd < 0:
            return
        os.write(self.fd, line)
        self.size += len(line)

    def _open(self) -> None:
        self.fd = -1  # a descriptor inherited across fork is the parent's trail, not ours
        path = self.path = self._where()
        self.pid = os.getpid()
        if not os.path.exists(path):
            _prune_dead(os.path.dirname(path))
        self.fd = os.open(path, _FLAGS, 0o600)
        info = os.fstat(self.fd)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            os.close(self.fd)
            self.fd = -1
            raise OSError("%s is not a file of this user's alone (mode %04o)" % (path, info.st_mode & 0o7777))
        self.size = info.st_size

    def _rotate(self) -> None:
        path = self.path
        for index in range(self.keep, 0, -1):
            older = "%s.%d" % (path, index)
            try:
                if index == self.keep:
                    os.unlink(older)
                else:
                    os.rename(older, "%s.%d" % (path, index + 1))
            except OSError:
                pass
        os.rename(path, path + ".1")
        os.close(self.fd)
        self.fd = -1
        self.fd = os.open(path, _FLAGS | os.O_EXCL, 0o600)
        self.size = 0

    def close(self) -> None:
        if self.fd >= 0 and self.pid == os.getpid():
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd, self.pid = -1, -1


class AuditLog:
    """The trail of one process (re-made in a forked child that serves requests: its own files).

    Three kinds of record go to three sets of files, each rotated on its own, so that no kind pushes
    another out: the eval and control actions (``BASE``, ``keep`` rotated files of ``max_bytes``), the
    reads recorded with ``PROBE_AUDIT_READS=1`` (``BASE`` with ``.reads``, one rotated file) and the
    refusals, counted per asker and minute (``.refused``, one rotated file; ``probe.agent.audit_refusals``).
    """

    def __init__(self, path: Optional[str] = None, max_bytes: Optional[int] = None, keep: Optional[int] = None) -> None:
        self._fixed = path
        self._path: Optional[str] = None
        self._path_pid = -1
        self.max_bytes = max_bytes if max_bytes is not None else _env_int("PROBE_AUDIT_MAX_BYTES", MAX_BYTES, 4096)
        self.keep = keep if keep is not None else _env_int("PROBE_AUDIT_KEEP", KEEP, 1)
        minor = max(4096, self.max_bytes // 4)
        self._files = {kind: _Appender(lambda kind=kind: kind_path(self.path, kind),  # type: ignore[misc]
                                       self.max_bytes if kind == ACTIONS else minor,
                                       self.keep if kind == ACTIONS else 1)
                       for kind in KINDS}
        self._lock = threading.Lock()
        self._seq = 0
        self._failed = False
        self._refusals = Refusals(self._next_seq)
        self._refusals_pid = os.getpid()
        atexit.register(self.flush)  # the counts of the last minute, where the process ends normally

    @property
    def path(self) -> str:
        """This process's trail file of actions (``audit-PID-TICKS.jsonl``, unless one was given)."""
        if self._fixed is not None:
            return self._fixed
        if self._path is None or self._path_pid != os.getpid():
            try:
                ticks = _paths.process_start_ticks()
            except (OSError, ValueError):
                ticks = 0
            self._path, self._path_pid = trail_path(os.getpid(), ticks), os.getpid()
        return self._path

    @property
    def max_disk(self) -> int:
        """The most bytes this trail's files ever hold together."""
        return sum(f.max_bytes * (f.keep + 1) for f in self._files.values())

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    # -- writing ----------------------------------------------------------------------------------

    def begin(self, scope: str, by: str, peer: str, command: str, detail: Optional[Dict[str, Any]] = None,
              code: Optional[str] = None) -> int:
        """Record an action about to run; its number, for :meth:`end`."""
        seq = self._next_seq()
        record: Dict[str, Any] = {"seq": seq, "phase": "start", "time": round(time.time(), 6), "pid": os.getpid(),
                                  "scope": scope, "by": by, "peer": peer, "command": command}
        if detail:
            record["detail"] = {k: _bounded(v) for k, v in detail.items() if v is not None}
        if code is not None:
            raw = code.encode("utf-8", "surrogatepass")
            record["code"] = raw[:MAX_SNIPPET].decode("utf-8", "ignore")
            record["code_sha256"] = hashlib.sha256(raw).hexdigest()
            record["code_bytes"] = len(raw)
        self.write(record, READS if scope == "read" else ACTIONS)
        self._write_refusals(self._refusals.due(os.getpid(), time.time()))
        return seq

    def end(self, seq: int, command: str, outcome: str, error: Optional[str], started: float,
            scope: str = "") -> None:
        record = {"seq": seq, "phase": "end", "time": round(time.time(), 6), "pid": os.getpid(), "command": command,
                  "outcome": outcome, "elapsed_ms": round((time.monotonic() - started) * 1000.0, 3)}
        if error:
            record["error"] = error[:MAX_DETAIL]
        self.write(record, READS if scope == "read" else ACTIONS)

    def refused(self, scope: str, by: str, peer: str, command: str, error: str) -> None:
        """Count a refusal (``probe.agent.audit_refusals``): written at once only when its window is new,
        or its count reaches a power of two."""
        try:
            if self._refusals_pid != os.getpid():  # a forked child counts its own
                self._refusals, self._refusals_pid = Refusals(self._next_seq), os.getpid()
            due = self._refusals.add(os.getpid(), time.time(), scope, by, peer, command, error[:MAX_DETAIL])
        except Exception:
            return
        self._write_refusals(due)

    def flush(self) -> None:
        """Write the refusal counts not written yet (before the trail is read, and at exit)."""
        try:
            if self._refusals_pid != os.getpid():
                return  # a forked child's copy of its parent's counts: the parent's to write
            self._write_refusals(self._refusals.pending(os.getpid()))
        except Exception:
            pass

    def _write_refusals(self, records: List[Dict[str, Any]]) -> None:
        for record in records:
            self.write(record, REFUSED)

    def write(self, record: Dict[str, Any], kind: str = ACTIONS) -> None:
        """One line, one ``os.write`` on an O_APPEND descriptor; never raises."""
        try:
            line = (json.dumps(record, default=str, ensure_ascii=False) + "\n").encode("utf-8", "replace")
            with self._lock:
                self._files[kind].write(line)
        except Exception as exc:
            if not self._failed:
                self._failed = True
                _say("probe: the audit trail %s cannot be written: %s" % (self._files[kind].path or self.path, exc))

    def close(self) -> None:
        self.flush()
        with self._lock:
            for appender in self._files.values():
                appender.close()


def _bounded(value: Any) -> Any:
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:MAX_DETAIL]


def _prune_dead(directory: str) -> None:
    """Keep the trails of the newest ``KEEP_DEAD`` processes that no longer run; remove the older ones."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    dead: Dict[Tuple[int, int], float] = {}
    for name in names:
        match = _NAME.match(name)
        if not match:
            continue
        key = (int(match.group(1)), int(match.group(2)))
        if key not in dead and _alive(*key):
            continue
        try:
            dead[key] = max(dead.get(key, 0.0), os.stat(os.path.join(directory, name)).st_mtime)
        except OSError:
            continue
    for pid, ticks in sorted(dead, key=dead.__getitem__, reverse=True)[KEEP_DEAD:]:
        for name in names:
            match = _NAME.match(name)
            if match and (int(match.group(1)), int(match.group(2))) == (pid, ticks):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass


def _alive(pid: int, ticks: int) -> bool:
    try:
        return _paths.process_start_ticks(str(pid)) == ticks
    except (OSError, ValueError):
        return False


_trail: Optional[AuditLog] = None
_trail_lock = threading.Lock()


def trail() -> AuditLog:
    """This process's trail (made on first use)."""
    global _trail
    if _trail is None:
        with _trail_lock:
            if _trail is None:
                _trail = AuditLog()
                probe_audit.before_read(_trail.flush)  # the table reads the refusal counts not written yet
    return _trail
