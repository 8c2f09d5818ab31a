"""Refused requests, counted rather than written one by one, so that refusals cannot wash out the trail.

A caller with a weak token (or none of its own: a unix peer of a lowered socket) can send refused requests
as fast as the agent answers them. Written one record each, they would fill the trail and rotate the
records of what actually ran out of it. So refusals are counted per *window*: one asker (its host on
TCP, its uid on the unix socket), what gave it its scope, the scope needed and the command, within one
wall-clock minute. A window's first refusal is written at once (count 1); the same record, with its count
so far, again each time the count reaches a power of two, and once more with its final count when the
window closes (the minute is over and something else is recorded) or the trail is read or closed.
A reader keeps the record with the highest count of each window: at most a factor of two short of the
truth for a process that died in the middle of a burst, exact otherwise.

At most ``MAX_OPEN`` windows are open at once (bounded memory against many source addresses): past it the
window refused least recently is closed early. Stdlib only.
"""

import re
import threading
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["Refusals", "asker", "MAX_OPEN"]

MAX_OPEN = 256
_TCP = re.compile(r"^(\[[^\]]*\]|[^\s:]*):\d+(.*)$")


def asker(peer: str) -> str:
    """Who a refusal is counted against: ``uid U`` for ``uid U pid P``, the host (and any certificate name)
    for ``HOST:PORT (CN=...)``: a new connection's pid or port makes no new window."""
    if peer.startswith("uid "):
        return " ".join(peer.split()[:2])
    match = _TCP.match(peer)
    return match.group(1) + match.group(2) if match else peer


class _Window:
    __slots__ = ("seq", "minute", "first", "last", "count", "written", "fields")

    def __init__(self, seq: int, minute: int, now: float, fields: Dict[str, Any]) -> None:
        self.seq, self.minute, self.first, self.last = seq, minute, now, now
        self.count, self.written = 1, 0
        self.fields = fields

    def record(self, pid: int) -> Dict[str, Any]:
        self.written = self.count
        out: Dict[str, Any] = {"seq": self.seq, "phase": "refused", "time": round(self.first, 6), "pid": pid}
        out.update(self.fields)
        out.update(outcome="refused", count=self.count, last=round(self.last, 6))
        return out


class Refusals:
    """The open windows of one process; each call returns the records to write (outside its lock)."""

    def __init__(self, next_seq: Callable[[], int], max_open: int = MAX_OPEN) -> None:
        self._next_seq = next_seq
        self._max_open = max(1, max_open)
        self._open: Dict[Tuple[str, str, str, str], _Window] = {}
        self._minute = -1
        self._lock = threading.Lock()

    def add(self, pid: int, now: float, scope: str, by: str, peer: str, command: str,
            error: str) -> List[Dict[str, Any]]:
        """Count one refusal; the records due now (the window's first, a power-of-two count, closed ones)."""
        minute = int(now // 60)
        key = (asker(peer), by, scope, command)
        with self._lock:
            out = self._close_before(pid, minute)
            window = self._open.get(key)
            if window is not None:
                window.count += 1
                window.last = max(window.last, now)
                if window.count & (window.count - 1) == 0:
                    out.append(window.record(pid))
                return out
            if len(self._open) >= self._max_open:
                oldest = min(self._open, key=lambda k: self._open[k].last)
                out.extend(self._close(pid, [oldest]))
            window = _Window(self._next_seq(), minute, now, {"scope": scope, "by": by, "peer": peer,
                                                             "command": command, "error": error})
            self._open[key] = window
            out.append(window.record(pid))
            return out

    def due(self, pid: int, now: float) -> List[Dict[str, Any]]:
        """The final records of the windows whose minute is over (cheap when none is)."""
        with self._lock:
            return self._close_before(pid, int(now // 60))

    def pending(self, pid: int) -> List[Dict[str, Any]]:
        """The counts not written yet (before a read of the trail, or at its close); the windows stay open,
        so that reads between refusals do not make a record of each."""
        with self._lock:
            return [w.record(pid) for w in self._open.values() if w.count != w.written]

    def _close_before(self, pid: int, minute: int) -> List[Dict[str, Any]]:
        if minute == self._minute:
            return []
        self._minute = minute
        return self._close(pid, [k for k, w in self._open.items() if w.minute != minute])

    def _close(self, pid: int, keys: List[Tuple[str, str, str, str]]) -> List[Dict[str, Any]]:
        out = []
        for key in keys:
            window = self._open.pop(key)
            if window.count != window.written:
                out.append(window.record(pid))
        return out
