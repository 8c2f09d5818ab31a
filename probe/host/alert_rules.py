"""The rules the watch's look runs itself, cheap enough for it (a read of /proc, no word to a rank), and the
settings every rule reads (``PROBE_ALERT_*`` numbers).

A rule here is an object with ``look(alerts, watch, live, now)``: it reads what the watch already knows of
its live ranks and calls ``alerts.fire`` for an event, whose fields are made on the alerts' thread.
"""

import collections
import os
from typing import Any, Deque, Dict, Optional, Sequence, Tuple

from probe.host.alert_body import where

__all__ = ["number", "RssRise"]

RSS_EVERY_S = 60.0  # how often each rank's RSS is read from /proc (PROBE_ALERT_RSS_EVERY_S)
RSS_SAMPLES = 10  # readings in a row that each rose or held (PROBE_ALERT_RSS_SAMPLES)
RSS_RISE = 0.2  # and rose by this fraction of the first (PROBE_ALERT_RSS_RISE)
RSS_MIN_MB = 256.0  # and by at least this much (PROBE_ALERT_RSS_MIN_MB)


def number(name: str, default: float) -> float:
    """The environment's ``name`` as a finite number at least 0; ``default`` where unset or not one."""
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value >= 0 and value == value and value != float("inf") else default


class RssRise:
    """A rank whose RSS rose or held at ``RSS_SAMPLES`` readings in a row, by ``RSS_RISE`` of the first and
    ``RSS_MIN_MB`` at least (then a new window begins). Read every ``RSS_EVERY_S`` (one read of
    /proc/PID/statm), from a rank's first step on: before it, a start-up's imports and loading rise as
    steadily."""

    def __init__(self) -> None:
        self._kept: Dict[int, Deque[Tuple[float, int]]] = {}  # pid -> its last readings (when, bytes)
        self._next = 0.0
        self._alerts = 0

    def look(self, alerts: Any, watch: Any, live: Sequence[Any], now: float) -> None:
        if now < self._next:
            return
        self._next = now + (number("PROBE_ALERT_RSS_EVERY_S", RSS_EVERY_S) or RSS_EVERY_S)
        count = max(2, int(number("PROBE_ALERT_RSS_SAMPLES", RSS_SAMPLES)))
        pids = {r.pid for r in live}
        for pid in [p for p in self._kept if p not in pids]:
            del self._kept[pid]
        for rank in live:
            rss = rss_bytes(rank.pid) if rank.steps else None  # a start-up's imports and loading rise too
            if rss is None:
                continue
            kept = self._kept.setdefault(rank.pid, collections.deque(maxlen=count))
            if kept and rss < kept[-1][1]:
                kept.clear()  # it fell: no steady rise
            kept.append((now, rss))
            since, first = kept[0]
            rise = rss - first
            if len(kept) < count or rise < max(number("PROBE_ALERT_RSS_MIN_MB", RSS_MIN_MB) * 2 ** 20,
                                               number("PROBE_ALERT_RSS_RISE", RSS_RISE) * first):
                continue
            kept.clear()
            self._alerts += 1
            text = ("rank %d's RSS rose or held at %d readings in a row, from %.0f MiB to %.0f MiB (+%.0f %%) in %.0f s"
                    % (rank.rank, count, first / 2 ** 20, rss / 2 ** 20, 100.0 * rise / max(first, 1), now - since))
            fields = dict(where(watch, None), rule="memory", summary=text, culprits=[rank.rank], pid=rank.pid,
                          rss_bytes=rss, rss_from_bytes=first)
            alerts.fire("memory", "rss %d %d" % (rank.pid, self._alerts), lambda made=fields: made)


def rss_bytes(pid: int) -> Optional[int]:
    """A process's resident memory, from /proc/PID/statm (its second field, in pages)."""
    try:
        with open("/proc/%d/statm" % pid, "rb") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
