"""The node helper's reader of what each rank's training framework logged (issue 36): the loss, the learning
rate, the grad norm and their step, from ``torch.trainer`` (HF Trainer's log history, Lightning's logged
metrics, a LearningRateMonitor; ``probe.tables.torch.logged`` says where), asked of each answering rank's
agent over its unix socket.

Why one reader for the helper: the metrics (``probe.host.metrics``) serve these values and the loss-spike
alert (``probe.host.alert_loss``) judges them; both ask the same reader, so a rank is asked at most once
every ``PROBE_METRICS_EVERY`` seconds (default 15; ``0``: never) whoever wants the values, and only while
someone does (a scrape came, or an alert webhook is set). The reads run on one background thread, one rank
after another, never in a scrape or a look of the watch; each read's wall time is kept: what it cost the
rank's agent, GIL included. A rank whose agent has not run for 2 s (GIL held, stopped) is not asked.
"""

import collections
import os
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

__all__ = ["FrameworkReader", "reader_of", "every", "EVERY_S", "COLUMNS"]

EVERY_S = 15.0  # the framework's values are read at most this often ($PROBE_METRICS_EVERY)
READ_TIMEOUT_S = 5.0  # one rank's read of them
HISTORY_KEPT = 64  # (step, loss) points kept a rank, for the spike rule
COLUMNS = ["loss", "lr", "grad_norm", "logged_step", "loss_from"]
_FORGET_S = 120.0  # a rank nobody asked for this long (beyond three periods) is forgotten
_lock = threading.Lock()


def every(environ: Optional[Dict[str, str]] = None) -> Optional[float]:
    """``PROBE_METRICS_EVERY`` in seconds (default ``EVERY_S``); None where it is 0 (never read)."""
    raw = (environ if environ is not None else os.environ).get("PROBE_METRICS_EVERY", "").strip()
    try:
        value = float(raw) if raw else EVERY_S
    except ValueError:
        value = EVERY_S
    return value if value > 0 and value == value and value != float("inf") else None


def reader_of(helper: Any) -> "FrameworkReader":
    """The helper's one reader (made at the first ask, kept on the helper), whoever asks first."""
    with _lock:
        reader = getattr(helper, "framework_reader", None)
        if reader is None:
            reader = FrameworkReader(every())
            try:
                helper.framework_reader = reader
            except AttributeError:  # a helper that takes no attribute: a reader of its own each time
                pass
        return reader


class FrameworkReader:
    """The last values each rank's framework logged, a short history of its logged losses, and the reads'
    cost. ``ask`` is cheap and never waits: it starts a round of reads on a thread when one is due."""

    def __init__(self, period: Optional[float]) -> None:
        self.every = period
        self.values: Dict[int, Dict[str, Any]] = {}  # pid -> loss, lr, grad_norm, step, loss_from, took, at
        self.history: Dict[int, Deque[Tuple[Optional[int], float]]] = {}  # pid -> (step, loss), oldest first
        self.rounds = 0  # rounds of reads finished
        self.last = float("-inf")
        self.busy = False
        self._asked: Dict[int, float] = {}  # pid -> when someone last asked for it
        self._lock = threading.Lock()
        self._points = threading.Lock()  # the histories: appended on the reader's thread, copied on the watch's

    def points(self, pid: int) -> List[Tuple[Optional[int], float]]:
        """The rank's logged losses kept, oldest first: (step or None, loss)."""
        with self._points:
            return list(self.history.get(pid) or ())

    def ask(self, pids: Sequence[int]) -> None:
        """Someone wants these ranks' values: a round of reads starts where ``every`` has passed since the
        last (it reads every rank asked for within the last two periods)."""
        if self.every is None:
            return
        now = time.monotonic()
        for pid in pids:
            self._asked[pid] = now
        forget = max(3 * self.every, _FORGET_S)
        for pid in [p for p, at in list(self._asked.items()) if now - at > forget]:
            with self._points:
                for kept in (self._asked, self.values, self.history):
                    kept.pop(pid, None)
        if not self._asked or now - self.last < self.every:
            return
        with self._lock:
            if self.busy:
                return
            self.busy, self.last = True, now
        wanted = [p for p, at in list(self._asked.items()) if now - at <= 2 * self.every + READ_TIMEOUT_S]
        try:
            threading.Thread(target=self._round, args=(wanted,), name="probe-framework-read", daemon=True).start()
        except RuntimeError:
            self.busy = False

    def _round(self, pids: List[int]) -> None:
        try:
            for pid in pids:
                if _silent(pid):
                    continue  # its agent would not answer within the timeout: the others wait for none
                got = self.read(pid)
                if got is None:
                    self.values.pop(pid, None)
                    continue
                self.values[pid] = got
                if isinstance(got["loss"], float):
                    self._note(pid, got["step"], got["loss"])
        finally:
            self.rounds += 1
            self.busy = False

    def read(self, pid: int) -> Optional[Dict[str, Any]]:
        """One rank's values, now (the first trainer that logged a loss, else the first found); None where it
        does not answer or has no torch."""
        from probe.client.client import Client
        from probe.client.targets import parse_target

        client = Client(parse_target(str(pid)), None, READ_TIMEOUT_S)
        start = time.perf_counter()
        try:
            got = client.table_rows("torch.trainer", 8, COLUMNS)
        except Exception:  # noqa: BLE001 -- no torch there, an older agent, no answer: nothing to show
            return None
        took = time.perf_counter() - start
        names = [c[0] for c in got.columns]  # the table's order, not the order asked in
        rows = [dict(zip(names, r)) for r in got.rows]
        row = next((r for r in rows if _number(r.get("loss")) is not None), rows[0] if rows else {})
        step = row.get("logged_step")
        where = row.get("loss_from")
        return {"loss": _number(row.get("loss")), "lr": _number(row.get("lr")),
                "grad_norm": _number(row.get("grad_norm")), "step": step if isinstance(step, int) else None,
                "loss_from": where if isinstance(where, str) else None, "took": took, "at": time.time()}

    def _note(self, pid: int, step: Optional[int], loss: float) -> None:
        """A point of the rank's loss history: the same logged value read again (its step, or with no step
        its value, unchanged) is the one point it was."""
        with self._points:
            self._add(self.history.setdefault(pid, collections.deque(maxlen=HISTORY_KEPT)), step, loss)

    @staticmethod
    def _add(kept: Deque[Tuple[Optional[int], float]], step: Optional[int], loss: float) -> None:
        if kept:
            last_step, last_loss = kept[-1]
            if step is not None and last_step is not None and step == last_step:
                return  # the same entry read again
            if step is not None and last_step is not None and step < last_step:
                kept.clear()  # a resume from an earlier checkpoint: its steps again, a history anew
            if step is None and (last_loss == loss or (last_loss != last_loss and loss != loss)):
                return
        kept.append((step, loss))


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _silent(pid: int) -> bool:
    """Whether the rank's agent has not run for ``STALE_HEARTBEAT_S`` (its socket's mtime is its heartbeat)."""
    from probe import _paths
    from probe.host.members import STALE_HEARTBEAT_S

    try:
        return time.time() - os.stat(_paths.socket_path(pid)).st_mtime > STALE_HEARTBEAT_S
    except OSError:
        return True


_FAMILIES = (
    ("loss", "probe_loss", "The last training loss the framework logged (HF Trainer's log history, Lightning's "
                           "logged metrics), read every PROBE_METRICS_EVERY s."),
    ("lr", "probe_framework_lr", "The learning rate the framework logged last (HF's log history, Lightning's "
                                 "logged lr or LearningRateMonitor), else its first optimizer's now."),
    ("grad_norm", "probe_grad_norm", "The gradient norm the framework logged last (HF's log history, a "
                                     "grad_norm Lightning logged)."),
    ("step", "probe_framework_logged_step", "The step the logged loss belongs to."),
    ("took", "probe_framework_read_seconds", "Wall time of the last read of the framework's values from the "
                                             "rank's agent: what it cost the rank."),
)


def families(reader: FrameworkReader, ranks: Sequence[Tuple[int, List[str]]], labels: Sequence[str]) -> List[Any]:
    """The Prometheus families of what ``reader`` holds of ``ranks`` ((pid, label values) each); none where
    the reads are off (``PROBE_METRICS_EVERY=0``)."""
    from prometheus_client.core import GaugeMetricFamily

    if reader.every is None:
        return []
    out = []
    for key, name, text in _FAMILIES:
        family = GaugeMetricFamily(name, text, labels=list(labels))
        for pid, values in ranks:
            got = reader.values.get(pid)
            value = None if got is None else got.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family.add_metric(values, float(value))
        out.append(family)
    return out
