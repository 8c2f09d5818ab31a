"""The alerts on the loss each rank's framework logged (issue 36): a spike (the newest logged loss over k times
the median of the ones before it) and a NaN or Inf logged as the loss, while the job still steps.

Why here and not in the watch: the values come from inside the ranks (``torch.trainer``, read by the helper's
one ``probe.host.framework.FrameworkReader``, at most every ``PROBE_METRICS_EVERY`` s, on its own thread), and
the watch's look must stay cheap: each look hands the reader the live ranks (a few dict writes; a read starts
on the reader's thread when due) and judges the points read since the last look, a median of at most
``PROBE_ALERT_LOSS_WINDOW`` numbers a rank. Only where a webhook is set: no webhook, no read for alerts.

One event is one alert: a spike that lasts several logged steps is one spike (keyed by rank and the step it
began at) until a logged loss falls back under the line; a rank that logs NaN step after step is one ``nan``
alert until it logs a finite loss again. Each rule's cooldown (``PROBE_ALERT_COOLDOWN``) holds as for the others.
"""

import math
import os
import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from probe.host import framework

__all__ = ["look", "LossRule", "SPIKE_K", "WINDOW", "MIN_POINTS"]

SPIKE_K = 3.0  # the newest loss over this many times the median (PROBE_ALERT_LOSS_SPIKE; 0: off)
WINDOW = 20  # of this many logged losses before it (PROBE_ALERT_LOSS_WINDOW)
MIN_POINTS = 5  # and at least this many of them (PROBE_ALERT_LOSS_MIN_POINTS)


def _setting(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value >= 0 and math.isfinite(value) else default


class LossRule:
    """The state of the two rules for one ``Alerts``: what was judged already, and which ranks are in an event."""

    def __init__(self) -> None:
        self.k = _setting("PROBE_ALERT_LOSS_SPIKE", SPIKE_K)
        self.window = max(1, int(_setting("PROBE_ALERT_LOSS_WINDOW", WINDOW)))
        self.min_points = max(1, min(self.window, int(_setting("PROBE_ALERT_LOSS_MIN_POINTS", MIN_POINTS))))
        self.judged: Dict[int, Tuple[Optional[int], float]] = {}  # pid -> the newest point judged
        self.spiking: Set[int] = set()  # ranks whose spike was said, until a loss falls back
        self.bad: Set[int] = set()  # ranks whose NaN or Inf was said, until a finite loss

    def look(self, alerts: Any, watch: Any, live: Sequence[Any], where: Callable[..., Dict[str, Any]]) -> None:
        reader = framework.reader_of(watch.helper)
        if reader.every is None:
            return
        reader.ask([r.pid for r in live])
        pids = {r.pid for r in live}
        for pid in [p for p in self.judged if p not in pids]:
            del self.judged[pid]
        self.spiking &= pids
        self.bad &= pids
        for rank in live:
            history = reader.points(rank.pid)
            if not history or self.judged.get(rank.pid) == history[-1]:
                continue
            self.judged[rank.pid] = history[-1]
            got = reader.values.get(rank.pid) or {}
            self._judge(alerts, watch, rank, history, got.get("loss_from"), where)

    def _judge(self, alerts: Any, watch: Any, rank: Any, history: List[Tuple[Optional[int], float]],
               loss_from: Optional[str], where: Callable[..., Dict[str, Any]]) -> None:
        step, loss = history[-1]
        at = "step %s" % step if step is not None else "a step not logged"
        if not math.isfinite(loss):
            if rank.pid not in self.bad:
                self.bad.add(rank.pid)
                text = "rank %d's framework logged a loss of %s at %s" % (rank.rank, loss, at)
                fields = dict(where(watch, None), rule="nan", summary=text, culprits=[rank.rank], ranks=[rank.rank],
                              pid=rank.pid, step=step, loss=str(loss), loss_from=loss_from)
                alerts.fire("nan", "loss rank %d pid %d step %s" % (rank.rank, rank.pid, step), lambda: fields)
            return
        self.bad.discard(rank.pid)
        before = [v for _, v in history[:-1] if math.isfinite(v)][-self.window:]
        if not self.k or len(before) < self.min_points:
            return
        median = statistics.median(before)
        if median <= 0 or loss <= self.k * median:
            self.spiking.discard(rank.pid)  # fell back under the line: a later spike is a new event
            return
        if rank.pid in self.spiking:
            return  # the same spike, still high
        self.spiking.add(rank.pid)
        text = ("rank %d's logged loss spiked to %.4g at %s: %.1f times the median %.4g of its %d logged losses "
                "before (PROBE_ALERT_LOSS_SPIKE %g)" % (rank.rank, loss, at, loss / median, median, len(before), self.k))
        fields = dict(where(watch, None), rule="loss_spike", summary=text, culprits=[rank.rank], ranks=[rank.rank],
                      pid=rank.pid, step=step, loss=loss, median=median, factor=loss / median, points=len(before),
                      threshold=self.k, loss_from=loss_from)
        alerts.fire("loss_spike", "rank %d pid %d step %s" % (rank.rank, rank.pid, step), lambda: fields)


def look(alerts: Any, watch: Any, live: Sequence[Any], where: Callable[..., Dict[str, Any]]) -> None:
    """Each look of the watch (``Alerts.look``): the rules, where a webhook is set; never raises into the watch."""
    if not alerts.hooks:
        return
    try:
        rule = alerts.__dict__.get("loss_rule")
        if rule is None:
            rule = alerts.__dict__["loss_rule"] = LossRule()
        rule.look(alerts, watch, live, where)
    except Exception as exc:  # noqa: BLE001 -- the watch's look goes on; said once
        if not alerts.__dict__.get("loss_rule_failed"):
            alerts.__dict__["loss_rule_failed"] = True
            alerts.log("probe: the loss alerts' look failed: %s: %s" % (type(exc).__name__, exc))
