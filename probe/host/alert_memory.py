"""The CUDA-memory alert (issue 36): a rank whose CUDA memory reserved by torch's caching allocator passes
``PROBE_ALERT_CUDA_FRACTION`` (0.95) of its device's total.

Why: near the device's end the next large allocation fails (an out-of-memory error that ends the job) or
the allocator starts freeing its cache and retrying at every step (slow steps, no error). The values come
from the rank's progress file (``probe.tables.torch.step_extras``: refreshed at a step, at most once a
second), read by the watch's look at most every ``PROBE_ALERT_CUDA_EVERY_S`` (10 s): no word to the rank.
One alert when a rank passes the line; it may fire again once it has fallen below and passed it again
(and the rule's cooldown, ``PROBE_ALERT_COOLDOWN``, is over), as the RSS-rise rule of ``probe.host.alerts``.
"""

import socket
import time
import weakref
from typing import Any, Dict, Optional, Sequence

from probe.host.alert_rules import number

__all__ = ["look", "over", "FRACTION", "EVERY_S"]

FRACTION = 0.95
EVERY_S = 10.0


class _State:
    """One Alerts' rule state: when it reads next, which ranks are over the line now, events so far."""

    def __init__(self) -> None:
        self.next = 0.0
        self.over: Dict[int, bool] = {}
        self.events = 0


_states: "weakref.WeakKeyDictionary[Any, _State]" = weakref.WeakKeyDictionary()


def over(extras: Any, fraction: float) -> bool:
    """Whether the extras' CUDA reserved memory is above ``fraction`` of the device's total (False where
    they have no CUDA memory)."""
    if extras is None or extras.cuda_reserved is None or not extras.cuda_total:
        return False
    return extras.cuda_reserved > fraction * extras.cuda_total


def look(alerts: Any, watch: Any, live: Sequence[Any]) -> None:
    """The watch's look (every second): every ``EVERY_S``, each live rank's extras from its progress file;
    an alert for each rank that passed the line since the last read. Never raises."""
    try:
        if not alerts.hooks:
            return
        state = _states.get(alerts)
        if state is None:
            state = _states[alerts] = _State()
        now = time.monotonic()
        if now < state.next:
            return
        state.next = now + number("PROBE_ALERT_CUDA_EVERY_S", EVERY_S)  # 0: at each look
        fraction = number("PROBE_ALERT_CUDA_FRACTION", FRACTION)
        pids = {rank.pid for rank in live}
        for pid in [p for p in state.over if p not in pids]:
            del state.over[pid]
        for rank in live:
            extras = _extras(rank)
            now_over = over(extras, fraction)
            if now_over and not state.over.get(rank.pid):
                state.events += 1
                _fire(alerts, watch, rank, extras, fraction, state.events)
            state.over[rank.pid] = now_over
    except Exception as exc:  # noqa: BLE001 -- the watch goes on
        alerts.log("probe: the CUDA-memory alert's look failed: %s: %s" % (type(exc).__name__, exc))


def _extras(rank: Any) -> Optional[Any]:
    """The rank's step extras, where its progress file is that very process's (pid and start time)."""
    from probe import _paths
    from probe.tables.torch.step_extras import read_extras
    from probe.tables.torch.steps import read_progress

    path = _paths.progress_path(rank.pid)
    head = read_progress(path)
    if head is None or head.pid != rank.pid or (head.start_ticks and rank.ticks and head.start_ticks != rank.ticks):
        return None
    return read_extras(path)


def _fire(alerts: Any, watch: Any, rank: Any, extras: Any, fraction: float, event: int) -> None:
    from probe.host.members import node_host

    gib = 2.0 ** 30
    text = ("rank %d's CUDA memory reserved is %.1f GiB of its device's %.1f GiB (%.0f %%, over %.0f %%); "
            "allocated %.1f GiB" % (rank.rank, extras.cuda_reserved / gib, extras.cuda_total / gib,
                                    100.0 * extras.cuda_reserved / extras.cuda_total, 100.0 * fraction,
                                    extras.cuda_allocated / gib))
    fields: Dict[str, Any] = {
        "host": node_host() or socket.gethostname(), "probe_port": watch.helper.base_port,
        "node": watch.helper.members.node_key(),
        "time": time.time(), "rule": "cuda_memory", "summary": text, "culprits": [rank.rank], "pid": rank.pid,
        "cuda_device": extras.cuda_device, "cuda_reserved_bytes": extras.cuda_reserved,
        "cuda_allocated_bytes": extras.cuda_allocated, "cuda_total_bytes": extras.cuda_total}
    alerts.fire("cuda_memory", "cuda %d %d" % (rank.pid, event), lambda: fields)
