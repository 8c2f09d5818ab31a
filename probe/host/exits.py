"""How a rank of this node ended, where something saw it: the words a record says of a death.

A process killed by SIGKILL (the OOM killer, ``kill -9``, a scheduler) runs no handler: its crash record
holds its header alone, and the kernel tells the signal only to its parent, in the wait status, once.
Two places still know it:

- the zombie, before its parent reaps it: the exit status is field 52 of ``/proc/PID/stat`` (any process
  of the same user may read it); the watch looks at every dead rank it sees;
- torchrun's launcher, which reaps its ranks (``Popen.poll`` every ``--monitor-interval``, 0.1 s) and logs
  ``failed (exitcode: -9) local_rank: 1 (pid: N)`` for the first rank that failed, and ``Sending process N
  closing signal SIGTERM`` for the ranks it ends itself. The node helper in the launcher reads those two
  log records as they are made (a :class:`logging.Filter` on the logger, which lets every record pass
  and changes nothing of what the launcher prints), from their arguments, not their text.

Where neither saw it, nobody knows the signal: the words say so. Nothing here raises.
"""

import logging
import signal
import threading
from typing import Any, Dict, Optional, Tuple

__all__ = ["observe_launcher", "note_zombie", "seen", "death_words", "amend_record", "LAUNCHER_LOGGER"]

LAUNCHER_LOGGER = "torch.distributed.elastic.multiprocessing.api"
MAX_KEPT = 4096  # exits remembered (a node's ranks, over many restarts)

_lock = threading.Lock()
_exits: Dict[int, Tuple[int, str]] = {}  # pid -> (exit code as Popen gives it: -N for signal N, who saw it)
_ended_by_launcher: Dict[int, str] = {}  # pid -> the signal the launcher sent it (its own closing of the job)


def _remember(table: Dict[int, object], pid: int, value: object) -> None:
    with _lock:
        if pid not in table and len(table) >= MAX_KEPT:
            table.pop(next(iter(table)))
        table[pid] = value


class _LauncherLog(logging.Filter):
    """Reads torchrun's records of its ranks' ends; lets every record pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            args = record.args if isinstance(record.args, tuple) else ()
            if record.msg == "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s" and len(args) >= 3:
                code, pid = int(args[0]), int(args[2])  # type: ignore[arg-type]
                _remember(_exits, pid, (code, "torchrun"))  # type: ignore[arg-type]
            elif record.msg == "Sending process %s closing signal %s" and len(args) >= 2:
                sig = args[1]
                name = sig.name if isinstance(sig, signal.Signals) else str(sig)
                _remember(_ended_by_launcher, int(args[0]), name)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 -- a record we do not understand: nothing learnt
            pass
        return True


def observe_launcher() -> None:
    """In torchrun's launcher: learn its ranks' exit codes from its own log records; never raises."""
    try:
        logger = logging.getLogger(LAUNCHER_LOGGER)
        if not any(isinstance(f, _LauncherLog) for f in logger.filters):
            logger.addFilter(_LauncherLog())
    except Exception:  # noqa: BLE001
        pass


def note_zombie(pid: int, start_ticks: int) -> None:
    """Read a dead rank's exit status while it is a zombie (its parent has not reaped it yet); only that
    very process's (``start_ticks``, field 22), not a later one's with its pid."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] != b"Z" or int(fields[19]) != start_ticks:
            return
        status = int(fields[49])
    except (OSError, ValueError, IndexError):
        return
    code = -(status & 0x7F) if status & 0x7F else status >> 8
    _remember(_exits, pid, (code, "its exit status"))


def seen(pid: int) -> Optional[Tuple[int, str]]:
    """(exit code, who saw it) where known: a negative code is the signal that ended it."""
    with _lock:
        return _exits.get(pid)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "signal %d" % number


def death_words(pid: int, cause: str) -> str:
    """``cause`` (a crash record's words) made exact where the end was seen: a rank whose handler could not
    run gets the signal that killed it, or is said to be of unknown signal (most likely SIGKILL)."""
    known = seen(pid)
    silent = cause.startswith("ended without a word")
    if known is not None and known[0] < 0:
        name = _signal_name(-known[0])
        where = "torchrun saw exitcode %d" % known[0] if known[1] == "torchrun" else "%s: signal %d" % (
            known[1], -known[0])
        if silent:
            return "killed by %s (%s); no handler runs for it: no stacks" % (name, where)
        return "%s; killed by %s (%s)" % (cause, name, where) if name not in cause else cause
    if known is not None and silent:
        return "exited with code %d (%s) without a word: os._exit or a C exit" % (
            known[0], "torchrun saw it" if known[1] == "torchrun" else known[1])
    with _lock:
        sent = _ended_by_launcher.get(pid)
    if silent and sent:
        return "ended by the launcher (it sent %s), no handler ran" % sent
    if silent:
        return ("killed by a signal that runs no handler (most likely SIGKILL: the OOM killer, kill -9, a "
                "scheduler), or os._exit; no process saw which")
    return cause


def amend_record(record: Dict[str, Any], pid: int) -> None:
    """A dead rank's record, its evidence saying how it ended as exactly as this node saw it."""
    try:
        from probe.reader import crash

        found = crash.dead_record(pid)
        if found is None:
            return
        words = death_words(pid, found.cause)
        before = record.get("died_how") if isinstance(record.get("died_how"), str) else found.cause
        record["died_how"] = words
        if words == before:
            return
        for look in record.get("evidence") or ():
            if isinstance(look, dict) and isinstance(look.get("why"), str):
                look["why"] = look["why"].replace(before, words)
    except Exception:  # noqa: BLE001 -- the record stands as captured
        pass
